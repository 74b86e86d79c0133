"""Load a model from a Hugging Face folder or a GGUF file into a ready-to-run module + tokenizer."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from tokenloom.attention.base import AttentionBackend
from tokenloom.errors import ModelLoadError
from tokenloom.models.config import ModelConfig
from tokenloom.models.default import DEFAULT_MODEL_NAME, default_model_path
from tokenloom.models.llama import LlamaForCausalLM
from tokenloom.tokenizer import Tokenizer

MODEL_FAMILIES: dict[str, type[LlamaForCausalLM]] = {"llama": LlamaForCausalLM}

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    name: str  # served model name
    path: Path
    dtype: torch.dtype
    load_seconds: float


def resolve_dtype(dtype: str | torch.dtype, torch_dtype_hint: str | None = None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        # Checkpoints stored in float32 stay float32; half-precision ones (and GGUF) run in bfloat16.
        return torch.float32 if torch_dtype_hint == "float32" else torch.bfloat16
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model(
    path: str | Path | None,
    dtype: str | torch.dtype,
    device: torch.device,
    backend: AttentionBackend,
    max_position: int | None = None,
) -> LoadedModel:
    """`path` None means the embedded default model. `max_position` sizes the RoPE table."""
    start = time.perf_counter()
    p = default_model_path() if path is None else Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model path {str(p)!r} does not exist")
    if p.is_file() and p.suffix == ".gguf":
        from tokenloom.models.gguf import load_gguf

        dt = resolve_dtype(dtype)
        config, tensors, tokenizer = load_gguf(p, dt)
        weights: Iterator[tuple[str, torch.Tensor]] = iter(tensors.items())
    elif p.is_dir():
        config = ModelConfig.from_hf_folder(p)
        hint = json.loads((p / "config.json").read_text()).get("torch_dtype") or json.loads(
            (p / "config.json").read_text()
        ).get("dtype")
        dt = resolve_dtype(dtype, hint)
        tokenizer = Tokenizer.from_hf_folder(p)
        weights = _safetensors_weights(p)
    else:
        raise ModelLoadError(f"{p}: expected a Hugging Face model folder or a .gguf file")
    if not tokenizer.eos_token_ids and config.eos_token_ids:
        tokenizer.eos_token_ids = config.eos_token_ids
    family = MODEL_FAMILIES[config.family]
    max_pos = max_position or config.max_position_embeddings
    with torch.device("meta"):
        model = family(config, backend, max_pos)
    _materialize(model, device, dt)
    with torch.inference_mode():
        model.load_weights(weights)
    model.eval()
    name = DEFAULT_MODEL_NAME if path is None else (p.stem if p.is_file() else p.name)
    return LoadedModel(model, config, tokenizer, name, p, dt, time.perf_counter() - start)


def _materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give every meta parameter real (uninitialised) storage, keeping tied parameters tied."""
    fresh: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in fresh:
                fresh[id(param)] = nn.Parameter(torch.empty(param.shape, dtype=dtype, device=device), requires_grad=False)
            module._parameters[name] = fresh[id(param)]
        if hasattr(module, "materialize"):
            module.materialize(device)


def _safetensors_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(f.name for f in folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights")
    for fname in files:
        if not (folder / fname).is_file():
            raise ModelLoadError(f"{folder}: shard {fname} named in the index is missing")
        with safe_open(str(folder / fname), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)
