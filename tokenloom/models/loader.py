"""Load a model from a Hugging Face folder or a GGUF file into a ready-to-run module + tokenizer."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import torch
from safetensors import safe_open
from torch import nn

from tokenloom.attention.base import AttentionBackend
from tokenloom.config import DType, GgufWeights
from tokenloom.errors import ModelLoadError
from tokenloom.kernels import load_quant_kernels
from tokenloom.models.config import ModelConfig, read_config_json
from tokenloom.models.default import DEFAULT_MODEL_NAME, default_model_path
from tokenloom.models.gguf import LOADABLE_DTYPES, config_from_gguf, state_dict_from_gguf
from tokenloom.models.gguf_file import read_gguf
from tokenloom.models.gguf_kept import kept_layers
from tokenloom.models.gguf_tokenizer import tokenizer_from_gguf
from tokenloom.models.gemma import Gemma3ForCausalLM
from tokenloom.models.llama import LlamaForCausalLM
from tokenloom.models.moe import QuantExperts, SparseMoE
from tokenloom.quant.checkpoint import check_quantization_config, split_stored, stored_layers
from tokenloom.tokenizer import Tokenizer

# The model classes share one interface (forward, compute_logits, load_weights, set_kernels) and module paths.
CausalLM = LlamaForCausalLM | Gemma3ForCausalLM
MODEL_FAMILIES: dict[str, type[CausalLM]] = {"llama": LlamaForCausalLM, "gemma": Gemma3ForCausalLM}

GGUF_WEIGHTS = get_args(GgufWeights)
# The --dtype values other than auto, as torch dtypes.
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in get_args(DType) if name != "auto"}


@dataclass
class LoadedModel:
    model: CausalLM
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
    gguf_weights: str = "keep",
) -> LoadedModel:
    """`path` None means the embedded default model. `max_position` sizes the RoPE table.
    `gguf_weights` "keep": a GGUF's linear weights of type Q8_0/Q4_0/Q4_1/Q5_0/Q4_K/Q5_K/Q6_K stay
    quantized, and so does its token table (a QuantEmbedding installed as `embed_tokens`, sharing the tied
    LM head's blocks), all from models/gguf_kept.py (bfloat16 on CPU with the quantized kernels built;
    otherwise, and with "dequantize", they are expanded to `dtype`).
    A folder written by `tokenloom quantize` loads its quantized layers from their stored codes."""
    start = time.perf_counter()
    p = default_model_path() if path is None else Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model path {str(p)!r} does not exist")
    quantized: dict[str, nn.Module] = {}  # module path -> layer built from quantized storage
    stored: dict[str, dict[str, torch.Tensor]] = {}  # a quantized checkpoint's buffers, by module path
    layout = 0  # and the layout version of their codes (quant/layout.py)
    if p.is_file() and p.suffix == ".gguf":
        dt = resolve_dtype(dtype)
        if dt not in LOADABLE_DTYPES:
            raise ModelLoadError(f"dtype {dt} is not supported for GGUF weights; use float32 or bfloat16")
        f = read_gguf(p)
        config, tokenizer = config_from_gguf(f), tokenizer_from_gguf(f)
        consumed: set[str] = set()
        if _keep_gguf(gguf_weights, dt, device):
            kept, consumed = kept_layers(f, config)
            quantized.update(kept)
        tensors = state_dict_from_gguf(f, config, dt, frozenset(consumed))
        weights: Iterator[tuple[str, torch.Tensor]] = iter(tensors.items())
    elif p.is_dir():
        config = ModelConfig.from_hf_folder(p)
        raw = read_config_json(p)
        dt = resolve_dtype(dtype, raw.get("torch_dtype") or raw.get("dtype"))
        tokenizer = Tokenizer.from_hf_folder(p)
        weights = _safetensors_weights(p)
        qcfg = raw.get("quantization_config")
        if qcfg is not None:
            layout = check_quantization_config(qcfg, p)
            if dt != torch.bfloat16 or device.type != "cpu":
                raise ModelLoadError(f"{p}: a tokenloom-quantized checkpoint runs in bfloat16 on CPU")
            plain, stored = split_stored(weights)
            weights = iter(plain)
    else:
        raise ModelLoadError(f"{p}: expected a Hugging Face model folder or a .gguf file")
    if not tokenizer.eos_token_ids and config.eos_token_ids:
        tokenizer.eos_token_ids = config.eos_token_ids
    family = MODEL_FAMILIES[config.family]
    max_pos = max_position or config.max_position_embeddings
    with torch.device("meta"):
        model = family(config, backend, max_pos)
    if stored:
        quantized.update(stored_layers(stored, model, layout))
    for name, layer in quantized.items():
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        if isinstance(owner, SparseMoE) and isinstance(layer, QuantExperts):
            owner.set_experts(layer)  # drops the float expert stacks before they are allocated
        else:
            setattr(owner, attr, layer)
    _materialize(model, device, dt)
    with torch.inference_mode():
        model.load_weights(weights)
    model.eval()
    name = DEFAULT_MODEL_NAME if path is None else (p.stem if p.is_file() else p.name)
    return LoadedModel(model, config, tokenizer, name, p, dt, time.perf_counter() - start)


def _keep_gguf(mode: str, dtype: torch.dtype, device: torch.device) -> bool:
    if mode not in GGUF_WEIGHTS:
        raise ModelLoadError(f"gguf weights mode must be one of {', '.join(GGUF_WEIGHTS)}, got {mode!r}")
    if mode != "keep" or dtype != torch.bfloat16 or device.type != "cpu":
        return False  # float32 (the parity tests' dtype) and CUDA keep the dequantized path
    return load_quant_kernels() is not None  # without the kernels, dense bf16 is faster


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
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index}: invalid safetensors index ({e!r})") from e
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
