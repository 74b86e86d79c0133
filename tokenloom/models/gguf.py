"""Load a GGUF file (llama.cpp's format): model config, Hugging Face-named weights, and tokenizer.

    config, state_dict, tokenizer = load_gguf(path, torch.bfloat16)

The result is what `transformers` builds from the same file (`from_pretrained(dir, gguf_file=...)`):
the same config values, the same dequantized weights under the same names (with llama.cpp's RoPE
row permutation of q/k undone), and a tokenizer that gives the same ids.

Sections: the config, the weights. The file container (header, metadata, tensor data) is read by
gguf_file.py; the tokenizer is rebuilt by gguf_tokenizer.py.
"""

from __future__ import annotations

import math
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, TypeVar

import numpy as np
import torch

from tokenloom.errors import ConfigError, ModelLoadError, UnsupportedArchitecture
from tokenloom.models.config import ModelConfig, RopeScaling
from tokenloom.models.gguf_file import GGUFFile, read_gguf
from tokenloom.models.gguf_tokenizer import tokenizer_from_gguf
from tokenloom.tokenizer import Tokenizer

# GGUF `general.architecture` -> HF class name. Mistral GGUFs say "llama".
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# Architectures whose converter permuted attn_q/attn_k rows for GGML's interleaved RoPE.
ROPE_PERMUTED = {"llama"}

LOADABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_T = TypeVar("_T")


def load_gguf(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Read `path` and return (config, HF-named state dict in `dtype`, tokenizer)."""
    if dtype not in LOADABLE_DTYPES:
        raise ConfigError(f"dtype {dtype} is not supported for GGUF weights; use float32 or bfloat16")
    f = read_gguf(path)
    config = config_from_gguf(f)
    return config, state_dict_from_gguf(f, config, dtype), tokenizer_from_gguf(f)


# --- the config --------------------------------------------------------------------------------------


def config_from_gguf(f: GGUFFile) -> ModelConfig:
    """ModelConfig from `{arch}.*` metadata; raises UnsupportedArchitecture for other model families."""
    md = f.metadata
    arch = str(md.get("general.architecture", "<missing general.architecture>"))
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"unsupported GGUF architecture {arch!r}; tokenloom reads {', '.join(sorted(GGUF_ARCHITECTURES))}"
        )

    def key(name: str, default: Any = None) -> Any:
        value = md.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{f.path}: GGUF metadata {arch}.{name} is missing")
        return value

    hidden = int(key("embedding_length"))
    n_heads = int(key("attention.head_count"))
    n_kv = _uniform(key("attention.head_count_kv", n_heads), f"{arch}.attention.head_count_kv")
    head_dim = int(md.get(f"{arch}.attention.key_length", hidden // n_heads))
    rope_dim = int(md.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise UnsupportedArchitecture(f"{arch}: partial rotary embedding (rope dim {rope_dim} of head dim {head_dim})")
    theta = float(md.get(f"{arch}.rope.freq_base", 10000.0))
    context = int(key("context_length"))

    embed = f.tensors.get("token_embd.weight")
    tokens = md.get("tokenizer.ggml.tokens")
    vocab = embed.shape[0] if embed is not None else len(tokens or ())
    if not vocab:
        raise ModelLoadError(f"{f.path}: no token_embd.weight tensor and no token list")
    eos = [md.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    bos = md.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        max_position_embeddings=context,
        rms_norm_eps=float(md.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=theta,
        rope_scaling=_rope_scaling(f, arch, theta, head_dim),
        tie_word_embeddings="output.weight" not in f.tensors,
        attention_bias="blk.0.attn_q.bias" in f.tensors,
        o_proj_bias="blk.0.attn_output.bias" in f.tensors,
        qk_norm=arch == "qwen3",
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos if i is not None)),
    )


def _uniform(value: Any, name: str) -> int:
    """A per-layer array must hold one value (tokenloom has no per-layer head counts)."""
    values = {int(v) for v in np.atleast_1d(value)}
    if len(values) != 1:
        raise UnsupportedArchitecture(f"{name} differs between layers ({sorted(values)})")
    return values.pop()


def _rope_scaling(f: GGUFFile, arch: str, theta: float, head_dim: int) -> RopeScaling:
    md = f.metadata
    kind = str(md.get(f"{arch}.rope.scaling.type", "none"))
    factor = float(md.get(f"{arch}.rope.scaling.factor", 1.0))
    orig = md.get(f"{arch}.rope.scaling.original_context_length")
    if "rope_freqs.weight" in f.tensors:  # Llama 3.1+: the per-frequency divisors as a tensor
        if kind not in ("none", "linear") or factor != 1.0:
            raise UnsupportedArchitecture(f"{arch}: rope_freqs tensor together with rope scaling {kind!r}")
        return _llama3_scaling(f.tensor("rope_freqs.weight"), theta, head_dim)
    if kind == "none" or (kind == "linear" and factor == 1.0):
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(kind="linear", factor=factor)
    if kind == "yarn":
        return RopeScaling(
            kind="yarn",
            factor=factor,
            original_max_position_embeddings=int(orig) if orig else None,
            beta_fast=float(md.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(md.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
        )
    raise UnsupportedArchitecture(f"{arch}: unsupported rope scaling type {kind!r}")


def _llama3_scaling(freq_factors: torch.Tensor, theta: float, head_dim: int) -> RopeScaling:
    """Recover Llama 3.1's `rope_scaling` from the divisors llama.cpp's converter wrote.

    The converter computes them from (factor, low_freq_factor, high_freq_factor, original context);
    only `factor` can be read back directly (the largest divisor), so the others are taken as the
    values every Llama 3.x release uses, and the whole curve is checked against the file.
    """
    factor, low, high, orig = float(freq_factors.max()), 1.0, 4.0, 8192
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    wavelen = 2 * math.pi / inv_freq
    smooth = (orig / wavelen - low) / (high - low)
    expected = torch.where(
        wavelen < orig / high,
        torch.ones_like(wavelen),
        torch.where(wavelen > orig / low, torch.full_like(wavelen, factor), 1 / ((1 - smooth) / factor + smooth)),
    )
    if freq_factors.shape != expected.shape or not torch.allclose(freq_factors.double(), expected, rtol=1e-4):
        raise UnsupportedArchitecture("rope_freqs tensor does not match Llama 3 rope scaling")
    return RopeScaling(
        kind="llama3", factor=factor, original_max_position_embeddings=orig, low_freq_factor=low, high_freq_factor=high
    )


# --- the weights -------------------------------------------------------------------------------------

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_CONSUMED = {"rope_freqs.weight"}  # read into the config, not a weight
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def hf_tensor_name(gguf_name: str) -> str | None:
    """llama.cpp tensor name -> HF name (None for names the llama/qwen2/qwen3 families do not have)."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}"
    return None


def state_dict_from_gguf(f: GGUFFile, config: ModelConfig, dtype: torch.dtype,
                         skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """HF-named dequantized tensors; `skip`: GGUF tensors kept quantized elsewhere (gguf_kept.py)."""
    arch = str(f.metadata["general.architecture"])
    heads = {".attn_q.": config.num_attention_heads, ".attn_k.": config.num_key_value_heads}
    jobs: list[tuple[str, int | None]] = []  # (GGUF name, heads whose RoPE rows to un-permute)
    names: list[str] = []
    for name in f.tensors:
        if name in _CONSUMED or name in skip:
            continue
        hf_name = hf_tensor_name(name)
        if hf_name is None:
            raise UnsupportedArchitecture(f"{arch} GGUF has tensor {name!r}, which tokenloom's {arch} model lacks")
        permute = next((n for part, n in heads.items() if part in name), None) if arch in ROPE_PERMUTED else None
        jobs.append((name, permute))
        names.append(hf_name)

    def load(job: tuple[str, int | None]) -> torch.Tensor:
        name, permute = job
        w = f.tensor(name, dtype)
        return w if permute is None else unpermute_rope_rows(w, permute)

    out = dict(zip(names, _map_single_threaded(load, jobs)))
    _check_complete(out, config, f.path, {n for s in skip if (n := hf_tensor_name(s)) is not None})
    return out


def _map_single_threaded(fn: Callable[[_T], torch.Tensor], items: list[_T]) -> list[torch.Tensor]:
    """`map(fn, items)` on `torch.get_num_threads()` worker threads, each limited to one intra-op thread.

    Dequantizing is hundreds of small memory-bound ops. Under torch's own (OpenMP) parallelism every
    op ends in a thread barrier, and when another process competes for the cores each barrier can
    wait out a scheduler slice (docs/performance-notes.md#gguf-loading). Whole tensors on independent
    single-threaded workers need no barriers, and torch releases the GIL inside its ops.
    """
    workers = torch.get_num_threads()
    if workers <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    try:
        with ThreadPoolExecutor(workers, initializer=torch.set_num_threads, initargs=(1,)) as pool:
            return list(pool.map(fn, items))
    finally:
        # set_num_threads also stores a process-wide default that threads started later pick up;
        # put it back so only the workers ever ran single-threaded.
        torch.set_num_threads(workers)


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (as transformers' `_reverse_permute_weights` does).

    HF rotates the two halves of each head (row i pairs with i + d/2); GGML's RoPE rotates adjacent
    rows (2i, 2i+1), so the converter interleaved the halves. Rows: (heads, 2, d/2) <- (heads, d/2, 2).
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _check_complete(sd: dict[str, torch.Tensor], config: ModelConfig, path: Path, elsewhere: set[str]) -> None:
    needed = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        needed.append("lm_head.weight")
    optional = {"attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias", "attn_q_norm.weight",
                "attn_k_norm.weight"}
    wanted = [k for k in _LAYER_TENSORS if k not in optional]
    if config.attention_bias:
        wanted += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
    if config.o_proj_bias:
        wanted.append("attn_output.bias")
    if config.qk_norm:
        wanted += ["attn_q_norm.weight", "attn_k_norm.weight"]
    per_layer = [_LAYER_TENSORS[k] for k in wanted]
    needed += [f"model.layers.{i}.{n}" for i in range(config.num_hidden_layers) for n in per_layer]
    missing = [n for n in needed if n not in sd and n not in elsewhere]
    if missing:
        raise ModelLoadError(f"{path}: GGUF lacks {len(missing)} tensors, e.g. {missing[:3]}")
