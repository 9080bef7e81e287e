"""What a training rank of ``tests/unit/dist_runs.py`` imports, imported once in the forkserver its ranks are forked
from (``PRELOAD`` there): ~5 CPU-s a rank otherwise pays before its first step. Imports only -- no thread started, no
tensor made -- so a forked rank is as fresh as a spawned one. bitsandbytes is hidden first, as in a rank of a run
without quantization (peft and TRL import it whenever installed); a 4-bit run's ranks are spawned instead."""

from ray_jobs.model.loading import forgo_bitsandbytes

forgo_bitsandbytes("none")

import peft  # noqa: E402,F401
import safetensors.torch  # noqa: E402,F401
import torch  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401
import torch.distributed.checkpoint  # noqa: E402,F401
import transformers  # noqa: E402,F401
from transformers import LlamaForCausalLM, get_scheduler  # noqa: E402,F401

import ray_jobs.train.hf  # noqa: E402,F401
import ray_jobs.train.runtime  # noqa: E402,F401
import ray_jobs.train.trainer  # noqa: E402,F401
import tests.unit.dist_runs  # noqa: E402,F401
