"""``unbroken convert FILE``: an Axolotl or TRL (``trl sft``) YAML written as an unbroken config, saying for each key
where it went or why it did not (the tables: ray_jobs/config/convert.py). Reads and writes files only: no Prefect, no
Ray, no torch. Exit 0 when the written config loads; 2 when it does not (it is written all the same, its problems
listed), or for a file that cannot be converted."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ray_jobs.config.convert import TOOL, Conversion, Unconvertible, convert, detect, read

HELP = "write an unbroken config from an Axolotl or TRL (trl sft) YAML, saying where each key went or why not"


def add_parser(command: Callable[[str, str], argparse.ArgumentParser]) -> None:
    c = command("convert", HELP)
    c.add_argument("file", help="the Axolotl or TRL YAML")
    out = "where to write (default: FILE's stem + .unbroken.yaml, beside it)"
    c.add_argument("-o", "--output", default=None, metavar="OUT", help=out)
    whose = "whose config FILE is (default: told by its keys, e.g. Axolotl's base_model, TRL's model_name_or_path)"
    c.add_argument("--from", dest="flavour", choices=tuple(TOOL), default=None, help=whose)
    c.add_argument("--force", action="store_true", help="overwrite OUT if it exists")


def cmd_convert(args: argparse.Namespace) -> int:
    from control.config import load_config

    path = Path(args.file)
    out = Path(args.output) if args.output else path.with_name(f"{path.stem}.unbroken.yaml")
    if out.resolve() == path.resolve():
        raise Unconvertible(f"{out}: that is the file converted; name another with -o")
    if out.exists() and not args.force:
        raise Unconvertible(f"{out} exists; --force overwrites it, -o names another")
    raw = read(path)
    flavour = detect(raw, path, args.flavour)
    result = convert(raw, flavour, path.resolve().parent, path.stem)
    print(f"{path}: {TOOL[flavour]}'s config")
    print("\n".join(report(result)))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(written(result, path))
    print(f"wrote {out}")
    try:
        load_config(out)
    except Exception:
        print(f"{out} does not load as written: fix what follows there", file=sys.stderr)
        raise
    print(f"next: unbroken check {out}")
    return 0


def report(r: Conversion) -> list[str]:
    """What happened to each key: mapped (``key -> field = value``, its notes below it), not honoured (and why), not
    recognised, and empty (nothing to convert)."""
    tool = TOOL[r.flavour]
    lines = ["mapped:"]
    notes: dict[str, list[str]] = {}
    for key, note in r.notes:
        notes.setdefault(key, []).extend(note.splitlines())
    for i, (key, dotted, value) in enumerate(r.mapped):
        lines.append(f"  {key} -> {dotted} = {_shown(value)}")
        if i + 1 == len(r.mapped) or r.mapped[i + 1][0] != key:
            lines += [f"      {n}" for n in notes.get(key, [])]
    if r.dropped:
        lines += ["not honoured:", *(f"  {key}: {why}" for key, why in r.dropped)]
    if r.unknown:
        lines.append("not recognised (left out):")
        lines += [f"  {key}: not a key of {tool}'s that unbroken knows" for key in r.unknown]
    if r.empty:
        lines.append(f"empty or off (nothing to convert): {', '.join(r.empty)}")
    return lines


def _shown(value: Any) -> str:
    """A value as the YAML written says it, on one line."""
    import json

    if isinstance(value, str):
        return value
    return json.dumps(value).replace('"', "")  # true, 0.05, [q_proj, v_proj], {} -- as YAML's flow style has them


def written(r: Conversion, source: Path) -> str:
    """The config's YAML, under a header naming where it came from and what it leaves out."""
    import yaml

    head = [f"# unbroken config converted by `unbroken convert` from {source} ({TOOL[r.flavour]})."]
    if r.dropped or r.unknown:
        head.append(f"# Left out: {', '.join([k for k, _ in r.dropped] + r.unknown)} (the command said why).")
    return "\n".join(head) + "\n" + yaml.safe_dump(r.ordered(), sort_keys=False, default_flow_style=False)
