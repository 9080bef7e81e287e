"""The documentation tells today's truth where a test can tell: every config field is documented (the reference is
generated from them: ray_jobs/config/reference.py), every ``unbroken`` command the README and the guides show is one
the command line takes (its subcommand, its arguments and every flag; a block after ``<!-- illustrative ... -->`` is not
checked), every concrete one of them (no placeholder) is run -- here, or by the test named for it -- and the README
stays short. The site itself builds in .ci/run (``make docs``, strict: a broken link or a
page missing from the nav fails it)."""

from __future__ import annotations

import contextlib
import re
import shlex
from pathlib import Path

import pytest

from tests.conftest import ROOT
from unbroken import arguments

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"(<!-- illustrative[^>]*-->\s*)?```(?:bash|sh|shell)\n(.*?)```", re.S)
# A synopsis (``run CONFIG [--set key=value ...]``) is a form, parsed; anything else is a command a reader may paste.
PLACEHOLDER = re.compile(r"\b[A-Z]+\b|\[|\.\.\.")
RUN_HERE = ("--version", "check configs/smollm2-chat-lora.yaml")
# Concrete commands too long for this tier (training, a watchdog that runs until stopped): the test that runs each --
# its own ports and storage, fewer steps -- whose source names the subcommand and every argument.
RUN_BY = {
    "run configs/smollm2-chat-lora.yaml": "tests/integration/test_real_model.py",
    "watchdog --metrics-port 9100": "tests/chaos/test_watchdog_recovery.py",
}


def commands(text: str) -> list[str]:
    """The ``unbroken`` command lines of a page's shell blocks (continuations joined, comments dropped)."""
    found = []
    for illustrative, block in FENCE.findall(text):
        if illustrative:
            continue
        logical, pending = [], ""
        for raw in block.splitlines():
            line = re.sub(r"\s+#.*$", "", raw).rstrip()
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            logical.append(pending + line)
            pending = ""
        for line in logical:
            m = re.search(r"(?:^|\s|/)unbroken\s+(.*)$", line.strip())
            if m and not line.strip().startswith(("pip ", "make ")):
                found.append(m.group(1))
    return found


def test_every_config_field_has_a_description() -> None:
    from ray_jobs.config import Config
    from ray_jobs.config.reference import fields, markdown

    docs = fields(Config)
    assert len(docs) > 100 and not [d.name for d in docs if not d.description]
    page = markdown(Config)
    assert all(f"| `{d.name}` |" in page for d in docs)


def test_every_command_the_docs_show_is_one_the_cli_takes() -> None:
    parser = arguments.parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    shown = [(page.name, cmd) for page in PAGES for cmd in commands(page.read_text())]
    assert len(shown) > 20, shown
    for page, cmd in shown:
        optional = re.findall(r"\[([^\]]*)\]", cmd)
        argv = shlex.split(re.sub(r"\[[^\]]*\]", " ", cmd).replace("...", " "))
        if argv and argv[0] in subparsers:  # flags inside [...] must exist, though their values are not shown
            known = {s for a in subparsers[argv[0]]._actions for s in a.option_strings}
            flags = {f for group in optional for f in re.findall(r"--[a-z-]+", group)}
            assert flags <= known, (page, cmd, flags - known)
        try:
            parser.parse_args(argv)
        except SystemExit as e:
            if e.code != 0:  # --version, --help exit 0
                pytest.fail(f"{page}: `unbroken {cmd}` is not a command unbroken takes")


def test_every_concrete_command_the_docs_show_is_run_by_a_test() -> None:
    from tests.integration.test_quickstart import commands as quickstart

    shown = {cmd.strip() for page in PAGES for cmd in commands(page.read_text()) if not PLACEHOLDER.search(cmd)}
    shown -= {shlex.join(c[1:]) for c in quickstart()}  # the quickstart's: its test runs them as written, in order
    assert shown == set(RUN_HERE) | set(RUN_BY), "a new concrete command: run it in a test, or mark it illustrative"
    for cmd, test in RUN_BY.items():
        source = (ROOT / test).read_text()
        subcommand, *rest = shlex.split(cmd)
        named = [f'"{subcommand}"'] + [Path(a).name for a in rest if not a.isdigit()]
        assert all(n in source for n in named), (cmd, test, [n for n in named if n not in source])


def test_the_concrete_commands_a_guide_shows_run_as_shown(smollm2, tmp_path, capsys) -> None:
    """``--version`` and the real-model recipe's ``check``, from the checkout, as the README shows them (the check on
    this test's own ports and storage: a lane beside it may have a head on the defaults)."""
    from unbroken.cli import main

    with pytest.raises(SystemExit) as e:
        main(shlex.split(RUN_HERE[0]))
    assert e.value.code == 0 and capsys.readouterr().out.startswith("unbroken ")
    own = [f"storage={tmp_path}", "cluster.dashboard_port=8999", "cluster.head_port=6999"]
    with contextlib.chdir(ROOT):
        assert main([*shlex.split(RUN_HERE[1]), *[a for o in own for a in ("--set", o)]]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("no problem found") and "plan" in out, out


def test_the_readme_fits_in_a_head() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


class _N(int):
    """An attempt number that formats as the page's placeholder (``job-spec-<n>.json``)."""

    def __format__(self, spec: str) -> str:
        return "<n>"


def test_the_architecture_pages_storage_layout_is_layouts() -> None:
    """Every path ``ray_jobs.storage.Layout`` names (each method called with placeholders for its arguments) is on a
    line of docs/architecture.md's storage layout: the contract tools and tests read is the one the code writes."""
    import inspect

    from ray_jobs.storage import Layout

    page = (ROOT / "docs" / "architecture.md").read_text()
    block = page[page.index("## Storage layout") :].split("```")[1]
    lines = [ln.split()[0] for ln in block.splitlines() if ln.startswith("<storage>/")]
    layout, missing = Layout("<storage>"), []
    for name, method in inspect.getmembers(Layout, inspect.isfunction):
        if name.startswith("_"):
            continue
        params = list(inspect.signature(method).parameters)[1:]
        args = [_N(1) if p == "attempt" else f"<{p}>" for p in params if p != "outcome"]
        path = getattr(layout, name)(*args)
        wanted = re.sub(r"<[^>]+>", "<[^>/]+>", re.escape(path))  # a placeholder reads as any other name for it
        if not any(re.match(rf"{wanted}(/|\.|,|$)", ln) for ln in lines):
            missing.append(f"{name}: {path}")
    assert not missing, f"Layout's paths docs/architecture.md's storage layout lacks: {missing}"


def tiers_of_every_test() -> dict[str, tuple[str, str]]:
    """Each test's tier (``ci``, ``full``) and its shard (``-`` for make test's own), as tests/tiers.py sees them."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "--list-tiers", "tests"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    rows = [ln.split("\t") for ln in out.stdout.splitlines() if ln.startswith("TIER\t")]
    assert rows, out.stdout[-2000:] + out.stderr[-2000:]
    return {nodeid: (tier, shard) for _, tier, shard, nodeid in rows}


def test_the_tier_table_names_a_proof_in_make_test_for_every_fault_class_and_every_full_only_test() -> None:
    """docs/development.md's tables (tests/tiers.py): each fault class proven by a test make test runs; each test named
    for the full tier is one only it runs, in the shard said; every test only the full tier runs is named there."""
    tiers = tiers_of_every_test()

    def collected(name: str) -> list[tuple[str, str]]:  # a test's tier and shard, each parameter's
        found = [tiers[n] for n in tiers if n == f"tests/{name}" or n.startswith(f"tests/{name}[")]
        assert found, f"docs/development.md names {name}, which is not a test"
        return found

    test_id = re.compile(r"`([^`]+::[^`]+)`")
    section = (ROOT / "docs" / "development.md").read_text().split("### Two tiers", 1)[1]
    table, others = section.split("**The suite times itself.**", 1)[0].split("The full tier's other tests", 1)
    lines = [ln for ln in table.splitlines() if ln.startswith("|")][2:]  # past the header and its rule
    rows = [[cell.strip() for cell in ln.strip().strip("|").split("|")] for ln in lines]
    assert len(rows) >= 18, rows
    for fault, proofs, _ in rows:
        assert test_id.findall(proofs), f"{fault}: no proof in make test"
        for name in test_id.findall(proofs):
            assert {tier for tier, _ in collected(name)} == {"ci"}, f"{fault}: {name} is not in make test"
    named = re.findall(r"`([^`]+::[^`]+)`\s*\(shard (\d)", " ".join(r[2] for r in rows) + others)
    for name, shard in named:
        assert collected(name) == [("full", shard)], f"{name}: not the full tier's own, or not in shard {shard}"
    unnamed = {n for n, (tier, _) in tiers.items() if tier == "full"} - {f"tests/{name}" for name, _ in named}
    assert not unnamed, f"tests only make test-full runs, missing from docs/development.md: {sorted(unnamed)}"
