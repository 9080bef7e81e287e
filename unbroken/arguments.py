"""The ``unbroken`` command line's arguments: each subcommand, its options, its one-line example."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from unbroken import convert, errors, output

STORAGE_ENV = "UNBROKEN_STORAGE"  # the storage root of status, runs, watchdog and serve when --storage is not given
EXAMPLES = {  # one line of each subcommand's help (``unbroken CMD --help``)
    "run": "unbroken run configs/demo.yaml --set train.max_steps=500",
    "check": "unbroken check configs/smollm2-chat-lora.yaml --set cluster.num_workers=4",
    "tune": "unbroken tune configs/demo-tune.yaml",
    "stage": "unbroken stage configs/demo.yaml --set data.train=s3://bucket/data/train.jsonl",
    "train": "unbroken train configs/demo.yaml   (N processes: torchrun --nproc-per-node N -m unbroken train ...)",
    "watchdog": "unbroken watchdog --storage s3://bucket/unbroken --interval 60",
    "serve": "unbroken serve --config configs/demo.yaml --cron '0 3 * * *'",
    "server": "unbroken server --port 4200",
    "status": "unbroken status demo --storage s3://bucket/unbroken",
    "runs": "unbroken runs --series demo",
    "convert": "unbroken convert axolotl.yml -o run.yaml   (or a TRL YAML: trl sft --config's)",
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("unbroken")
    except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
        return "unknown (not installed)"


def _storage(command: argparse.ArgumentParser, what: str) -> None:
    default = os.environ.get(STORAGE_ENV) or ".unbroken/storage"
    command.add_argument(
        "--storage",
        default=default,
        help=f"{what} (default: ${STORAGE_ENV} when set, else .unbroken/storage, the demo's; now {default})",
    )


def parser() -> argparse.ArgumentParser:
    """The command line's parser: every subcommand with its options and an example."""
    p = argparse.ArgumentParser(prog="unbroken", description="Fault-tolerant LLM fine-tuning on Prefect + Ray.")
    p.add_argument("--version", action="version", version=f"unbroken {_version()}")
    p.add_argument(
        "--debug",
        action="store_true",
        help=f"show the traceback of every error, a user's mistake too (also ${errors.DEBUG_ENV}=1)",
    )
    verbose = f"show every library's log lines, Prefect's and the Ray job's too (also ${output.VERBOSE_ENV}=1)"
    p.add_argument("-v", "--verbose", action="store_true", help=verbose)
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, help_: str) -> argparse.ArgumentParser:
        raw = argparse.RawDescriptionHelpFormatter  # the example on one line
        return sub.add_parser(
            name, help=help_, description=help_, epilog=f"example: {EXAMPLES[name]}", formatter_class=raw
        )

    _config_parsers(command)
    _watchdog_parser(command)
    _serving_parsers(command)
    convert.add_parser(command)
    st = command("status", "print a run's registry: state, attempts, incidents, heartbeat, lineage")
    st.add_argument("run", help="run name")
    _storage(st, "storage root")
    rs = command("runs", "list the runs of every series (or one): state, dataset, eval loss, champion")
    rs.add_argument("--series", default=None, help="only this series")
    _storage(rs, "storage root")
    return p


def _config_parsers(command: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """The commands that take a config: run, tune, stage, train."""
    commands = (
        ("run", "run the finetune flow"),
        ("check", "check a run without running it: config, model, data, cluster, storage, and its plan"),
        ("tune", "run the tune flow: a hyperparameter search over the config's tune.space (Ray Tune)"),
        ("stage", "stage the dataset only"),
        ("train", "local mode: train in this process (or each torchrun process), without Ray or Prefect"),
    )
    for name, help_ in commands:
        c = command(name, help_)
        c.add_argument("config", help="YAML config file (see configs/)")
        c.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config field, e.g. --set train.max_steps=100 (repeatable)",
        )
        if name == "check":
            c.add_argument(
                "--worker-memory",
                type=_gb,
                default=None,
                metavar="GB",
                help="memory each worker has "
                "(a GPU's with cluster.use_gpu), for the plan, when the cluster cannot say: 24, 80GB",
            )
        if name == "train":
            c.add_argument(
                "--local",
                action="store_true",
                help="accepted, and implied: `train` trains here (on "
                "Ray, `unbroken run` trains); under torchrun --nproc-per-node N, N processes",
            )


def _serving_parsers(command: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """serve (the deployments) and server (a local Prefect server)."""
    sv = command("serve", "serve the deployments (finetune, tune, stage-dataset, watchdog, dataset-sensor)")
    sv.add_argument("--config", default="configs/demo.yaml", help="config the finetune/stage deployments run")
    _storage(sv, "storage root for runs and the watchdog")
    sv.add_argument("--cron", default=None, help='finetune schedule, e.g. "0 3 * * *" (default: none)')
    sv.add_argument("--watchdog-interval", type=float, default=60.0, help="seconds between watchdog runs")
    sv.add_argument("--watch-source", default=None, help="location the dataset sensor watches (default: data.train)")
    sv.add_argument("--sensor-interval", type=float, default=60.0, help="seconds between dataset sensor runs")
    sv.add_argument("--tune-config", default="configs/demo-tune.yaml", help="config the tune deployment searches")
    srv = command("server", "start a local Prefect server (SQLite) with the UI on 127.0.0.1")
    srv.add_argument("--port", type=int, default=4200)


def _watchdog_parser(command: Callable[[str, str], argparse.ArgumentParser]) -> None:
    wd = command("watchdog", "check every active run under a storage root and recover what broke")
    _storage(wd, "storage root")
    wd.add_argument("--once", action="store_true", help="one pass, then exit (a scheduled deployment does this)")
    wd.add_argument("--interval", type=float, default=30.0, help="seconds between passes when looping (default 30)")
    wd.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="P",
        help="serve Prometheus counters (incidents "
        "and restarts per run) at http://HOST:P/metrics while it runs (0: a free port, printed)",
    )
    wd.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address the metrics endpoint binds (default 127.0.0.1; 0.0.0.0 for a Prometheus on another machine)",
    )


def _gb(text: str) -> float:
    try:
        gb = float(text.upper().removesuffix("B").removesuffix("I").removesuffix("G"))
    except ValueError:
        gb = 0.0
    if gb <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in GB (e.g. 24, 80GB, 80GiB)")
    return gb * 1024**3
