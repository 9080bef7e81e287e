"""What a command shows: unbroken's own log lines and every library's warnings; the libraries' INFO only with -v."""

from __future__ import annotations

import logging
import os

import pytest

from unbroken import output

OWN = output.folders()


def record(path: str, level: int) -> logging.LogRecord:
    return logging.LogRecord("prefect.task_runs", level, path, 1, "a line", None, None)


@pytest.mark.parametrize(
    ("module", "level", "shown"),
    [
        ("tasks/stage.py", logging.INFO, True),  # unbroken's progress, through Prefect's run logger
        ("control/jobs.py", logging.INFO, True),
        ("ray_jobs/progress.py", logging.INFO, True),
        ("prefect/task_engine.py", logging.INFO, False),  # "Finished in state Completed()"
        ("prefect/server/api/server.py", logging.INFO, False),  # the temporary server's banner
        ("transformers/modeling_utils.py", logging.INFO, False),
        ("prefect/task_engine.py", logging.WARNING, True),  # a library's warning always shows
        ("ray/_private/worker.py", logging.ERROR, True),
    ],
)
def test_the_console_keeps_unbroken_s_lines_and_every_warning(module: str, level: int, shown: bool) -> None:
    package, _, rest = module.partition("/")
    ours = [f for f in OWN if f.rstrip(os.sep).endswith(os.sep + package)]
    path = os.path.join(ours[0], rest) if ours else os.path.join("/site-packages", module)
    assert output.OwnLines(OWN).filter(record(path, level)) is shown


def test_a_ray_job_s_relayed_log_lines_stay_in_the_flow_run_s_log_unless_they_warn() -> None:
    from control.logs import RELAYED

    line = record(os.path.join(OWN[0], "jobs.py"), logging.INFO)
    setattr(line, RELAYED, True)
    assert not output.OwnLines(OWN).filter(line)
    line.levelno = logging.WARNING
    assert output.OwnLines(OWN).filter(line)


def test_every_package_of_unbroken_is_found_without_importing_prefect() -> None:
    assert {os.path.basename(f.rstrip(os.sep)) for f in OWN} == set(output.PACKAGES)


def test_the_libraries_own_switches_are_set_unless_the_user_set_them(monkeypatch) -> None:
    for key in output.QUIET_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "info")
    output.quiet_env()
    assert os.environ["TRANSFORMERS_VERBOSITY"] == "info"
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"


@pytest.mark.parametrize(
    ("raw", "relative"),
    [
        (
            {"storage": ".unbroken/storage", "data": {"train": "d.jsonl"}},
            [("storage", ".unbroken/storage"), ("data.train", "d.jsonl")],
        ),
        ({"storage": "s3://b/p", "data": {"train": "/abs/d.jsonl", "eval": "~/e.jsonl"}}, []),
        (
            {"storage": "/s", "data": {"train": [{"path": "a.jsonl"}, {"hub": "o/n"}, "b.jsonl"]}},
            [("data.train[0].path", "a.jsonl"), ("data.train[2]", "b.jsonl")],
        ),
        ({"storage": "/s", "data": {"train": {"path": "a.jsonl"}}}, [("data.train.path", "a.jsonl")]),
    ],
)
def test_a_config_s_relative_paths_are_found_wherever_data_train_names_sources(raw, relative) -> None:
    assert output.relative_paths(raw) == relative


def test_a_missing_path_the_config_gave_relative_says_where_it_was_looked_for(tmp_path, monkeypatch) -> None:
    from ray_jobs.data.formats.base import StagingError

    monkeypatch.chdir(tmp_path)
    e = StagingError(f"data.train: no such file or folder: {tmp_path / 'd.jsonl'}")
    output.note_missing(RuntimeError("the flow failed").with_traceback(None), [("data.train", "d.jsonl")])
    output.note_missing(e, [("storage", "s"), ("data.train", "d.jsonl")])
    assert e.__notes__ == [f"data.train d.jsonl is relative: read from the current folder {tmp_path}, not the config's"]
