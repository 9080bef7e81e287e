"""``python -m bench.gpu``: run the GPU kit's legs (see ``bench/gpu/__init__.py``)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.gpu import kit  # noqa: E402

LEGS = ("throughput", "engine", "lora", "checkpoint", "resume", "precision")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__)
    p.add_argument("--size", choices=sorted(kit.SIZES), default="1b", help="1b on a GPU; toy for a CPU (default 1b)")
    p.add_argument("--legs", default=",".join(LEGS), help=f"comma-separated subset of {','.join(LEGS)}")
    p.add_argument("--variants", default=None,
                   help="throughput variants as ac:compile[:grad_accum], e.g. 0:0,1:0,0:1,1:1 (the default on a GPU; "
                        "on a CPU 0:0,1:0)")  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="also append every line (JSON) to this file")
    p.add_argument("--work", type=Path, default=None, help="working folder (default: a temporary one)")
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)  # one process of the resume leg
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    if args.part:
        kit.emit(kit.run_part(json.loads(args.part)), None)
        return 0
    legs = [leg.strip() for leg in args.legs.split(",") if leg.strip()]
    unknown = sorted(set(legs) - set(LEGS))
    if unknown:
        p.error(f"unknown leg(s) {', '.join(unknown)}; legs: {', '.join(LEGS)}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="unbroken-gpu-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        run(work, kit.SIZES[args.size], legs, args.variants, args.out)
    return 0


def run(work: Path, size: kit.Size, legs: list[str], variants: str | None, out: Path | None) -> None:
    started = time.monotonic()
    model = kit.build_model(size.model, work / f"model-{size.model}")
    small = kit.build_model(size.small, work / f"model-{size.small}") if {"resume", "precision"} & set(legs) else None
    matmul = kit.leg_matmul(size)
    kit.emit(matmul, out)
    if "throughput" in legs:
        cuda = kit.device() == "cuda"
        pairs = variants or ("0:0,1:0,0:1,1:1" if cuda else "0:0,1:0")
        for pair in pairs.split(","):
            ac, compiled, *accum = (int(x) for x in pair.split(":"))
            line = kit.leg_throughput(work, size, model, bool(ac), bool(compiled), matmul["tflops"], *accum)
            kit.emit(line, out)
    if "engine" in legs:
        lines = [kit.leg_engine(work, size, model, engine, liger) for engine, liger in kit.engine_variants()]
        native = lines[0]["tokens_per_s"]
        for line in lines:  # each against the native loop's rate, measured in the same run
            kit.emit({**line, "vs_native": round(line["tokens_per_s"] / native, 3) if native else None}, out)
    if "lora" in legs:
        kit.emit(kit.leg_lora(work, size, model), out)
    if "checkpoint" in legs:
        kit.emit(kit.leg_checkpoint(work, size, model), out)
    if "resume" in legs:
        kit.emit(kit.leg_resume(work, size, small, deterministic=True), out)
        kit.emit(kit.leg_resume(work, size, small, deterministic=False), out)
    if "precision" in legs:
        kit.emit(kit.leg_precision(work, size, small), out)
    kit.emit({**kit.leg_env(), "wall_s": round(time.monotonic() - started, 1)}, out)


if __name__ == "__main__":
    sys.exit(main())
