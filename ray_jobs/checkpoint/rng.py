"""A process's RNG streams (Python's, NumPy's global, torch's CPU and CUDA generators), JSON-safe: what a rank's file
in a checkpoint keeps, and what a live peer sends a replica it heals, so either resumes drawing the same numbers."""

from __future__ import annotations

import random

from ray_jobs.contracts.checkpoint import RngState


def rng_state() -> RngState:
    import numpy as np
    import torch

    py = random.getstate()
    np_state = np.random.get_state(legacy=True)  # numpy's stub types the default call as the dict form
    assert isinstance(np_state, tuple), "the global RandomState is MT19937, whose legacy state is a tuple"
    out: RngState = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state().tolist()
    return out


def set_rng_state(state: RngState) -> None:
    import numpy as np
    import torch

    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))
