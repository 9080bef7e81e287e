"""The command line's small promises: a version, an example in every subcommand's help, and UNBROKEN_STORAGE as the
storage root of every command that takes --storage."""

from __future__ import annotations

import tomllib

import pytest

from tests.conftest import ROOT
from unbroken.arguments import EXAMPLES, STORAGE_ENV, parser
from unbroken.cli import main


def test_version_is_the_installed_package_s(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"unbroken {version}"


def test_every_subcommand_shows_an_example_of_itself(capsys) -> None:
    subcommands = set(next(a for a in parser()._actions if a.dest == "command").choices)
    assert set(EXAMPLES) == subcommands
    for name in sorted(subcommands):
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        out = capsys.readouterr().out
        assert e.value.code == 0 and f"example: {EXAMPLES[name]}" in out, out
        assert EXAMPLES[name].startswith(f"unbroken {name} "), "the example is of its own subcommand"


@pytest.mark.parametrize("command", [["status", "r"], ["runs"], ["watchdog"], ["serve"]])
def test_the_storage_root_comes_from_unbroken_storage_unless_given(command, monkeypatch) -> None:
    monkeypatch.delenv(STORAGE_ENV, raising=False)
    assert parser().parse_args(command).storage == ".unbroken/storage"
    monkeypatch.setenv(STORAGE_ENV, "s3://bucket/unbroken")
    assert parser().parse_args(command).storage == "s3://bucket/unbroken"
    assert parser().parse_args([*command, "--storage", "/data/runs"]).storage == "/data/runs"
