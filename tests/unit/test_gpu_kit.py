"""The GPU kit (bench/gpu) at toy size on the CPU: the same code path the lent GPU runs (`make gpu-check`), every
leg's line well-formed, the resume leg bit-identical across processes, precision as promised, no Ray or Prefect."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT


def test_every_leg_of_the_kit_runs_at_toy_size(tmp_path):
    out = tmp_path / "results.jsonl"
    p = subprocess.run([sys.executable, "-m", "bench.gpu", "--size", "toy", "--out", str(out), "--work",
                        str(tmp_path / "work")], cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert p.returncode == 0, (p.stdout + p.stderr)[-5000:]
    lines = [json.loads(ln) for ln in out.read_text().splitlines()]
    printed = [json.loads(ln.removeprefix("UNBROKEN_GPU ")) for ln in p.stdout.splitlines()
               if ln.startswith("UNBROKEN_GPU ")]  # fmt: skip
    assert printed == lines
    legs = [ln["leg"] for ln in lines]
    assert legs == ["matmul", "throughput", "throughput", "engine", "engine", "lora", "checkpoint", "resume", "resume",
                    "precision", "env"]  # fmt: skip
    native, hf = (lines.pop(3) for _ in range(2))  # the engine leg: on a CPU, no Liger variant (Triton needs CUDA)
    assert (native["engine"], hf["engine"], native["liger"], hf["liger"]) == ("native", "hf", False, False)
    assert native["vs_native"] == 1.0 and hf["vs_native"] > 0 and hf["tokens_per_s"] > 0 and hf["steps_timed"] == 3

    assert lines[0]["tflops"] > 0
    for tp in lines[1:3]:
        assert tp["model"] == "toy" and tp["tokens_per_s"] > 0 and tp["model_tflops"] > 0 and tp["params"] > 0
        assert tp["mfu_matmul"] > 0 and tp["mfu_spec"] is None  # no spec peak for a CPU
        assert tp["steps_timed"] == 3 and tp["precision"] == "fp32" and tp["fused_adamw"] is False
    assert [tp["activation_checkpointing"] for tp in lines[1:3]] == [False, True]
    lora = lines[3]
    assert lora["tokens_per_s"] > 0 and 0 < lora["trainable_params"] < lines[1]["params"]
    ck = lines[4]
    assert len(ck["sync_stalls_s"]) == len(ck["async_stalls_s"]) == 2 and ck["sync_stall_s"] > 0
    assert ck["stall_ratio"] is not None and ck["checkpoint_gb"] >= 0
    det, fast = lines[5], lines[6]
    assert det["deterministic"] and det["bit_identical"], det
    assert det["straight_sha256"] == det["resumed_sha256"] and len(det["straight_sha256"]) == 64
    assert det["stopped_at"] == det["steps"] // 2
    assert not fast["deterministic"] and fast["max_abs_diff"] >= 0
    prec = lines[7]
    assert prec["ok"] and prec["params"] == prec["adam_moments"] == prec["checkpoint_moments"] == ["float32"]
    assert prec["export"] == ["bfloat16"]
    env = lines[8]
    assert env["device"] == "cpu" and not env["ray_imported"] and not env["prefect_imported"]
