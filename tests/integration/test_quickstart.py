"""The quickstart's commands (docs/quickstart.md, the block after ``<!-- quickstart: ... -->``), run as written, in
order, by a user's quiet terminal: in a folder holding a copy of the repository's ``configs/`` and ``tests/data/``
(their relative paths, the demo's ``.unbroken/storage`` there), on a real local Ray head and the session's Prefect
server. Docs and CLI cannot drift: a command the CLI no longer takes, or that fails, fails this test.

It is also the Axolotl path end to end: a realistic Axolotl LoRA config (tests/data/axolotl-lora.yml) converted,
checked and trained on the demo model, its unsupported keys named."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

QUICKSTART = ROOT / "docs" / "quickstart.md"
MARK = "<!-- quickstart:"


def commands() -> list[list[str]]:
    """The quickstart's commands: the lines of the fenced block after the mark, comments dropped."""
    text = QUICKSTART.read_text()
    block = text[text.index(MARK) :].split("```bash\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def test_the_quickstart_s_commands_run_as_written_and_say_only_unbroken_s_lines(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "configs", tmp_path / "configs", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "tests" / "data", tmp_path / "tests" / "data")
    env = {k: v for k, v in os.environ.items() if k != "UNBROKEN_VERBOSE"}  # a user's terminal: quiet
    said: dict[str, str] = {}
    cmds = commands()
    assert [c[:2] for c in cmds][:2] == [["unbroken", "check"], ["unbroken", "run"]], cmds
    for cmd in cmds:
        assert cmd[0] == "unbroken", f"the quickstart runs unbroken's commands only: {cmd}"
        argv = [sys.executable, "-m", "unbroken", *cmd[1:]]
        p = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        out = p.stdout + p.stderr
        assert p.returncode == 0, f"{shlex.join(cmd)}: exit {p.returncode}\n{out[-4000:]}"
        said[shlex.join(cmd[:2] + cmd[2:3])] = out
        engine = r"Beginning flow run|Finished in state|Starting temporary server|Created (task|flow) run|\| prefect"
        assert not re.search(engine, out), out[-3000:]  # Prefect's own lines (unbroken's go through its loggers)
        assert "[ray]" not in out and "Writing model shards" not in out, "the job's log and trivial bars stay out"

    runs = [k for k in said if k.startswith("unbroken run ")]
    assert len(runs) == 2, said.keys()
    for key in runs:
        assert re.search(r"^final model: .+/final$", said[key], re.M), said[key][-2000:]
    converted = said[next(k for k in said if k.startswith("unbroken convert"))]
    for key in ("deepspeed", "special_tokens", "flash_attention"):  # Axolotl's keys unbroken does not honour, named
        assert re.search(rf"^  {key}: ", converted, re.M), converted
    assert "num_epochs -> train.epochs = 1" in converted
    axolotl = next(k for k in runs if "demo" not in k)
    assert re.search(r"^run axolotl-lora: \d+ steps", said[axolotl], re.M), said[axolotl][-2000:]
