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
from tokenloom.models.config import ModelConfig, RopeScaling, parse_rope_scaling, softcap
from tokenloom.models.gguf_file import GGUFFile, read_gguf
from tokenloom.models.gguf_tokenizer import tokenizer_from_gguf
from tokenloom.tokenizer import Tokenizer

# GGUF `general.architecture` -> HF class name. Mistral GGUFs say "llama", and so do Mixtral's (read as
# MixtralForCausalLM when they have experts: `{arch}.expert_count`).
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",  # Phi-3 and Phi-4-mini: fused attn_qkv, ffn_up holding gate then up rows
}
# Architectures whose converter permuted attn_q/attn_k rows for GGML's interleaved RoPE.
ROPE_PERMUTED = {"llama"}
# Gemma: llama.cpp's converter stores every RMSNorm weight as 1 + w (its norms multiply by the weight as is);
# the weights are read back as w, as transformers' Gemma2TensorProcessor does, for models/gemma.py's (1 + w).
GEMMA_ARCHITECTURES = {"gemma2", "gemma3"}

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
    if rope_dim != head_dim and arch != "phi3":  # Phi-4-mini turns the first 3/4 of each head (NEOX-style halves)
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
    moe = _moe_config(f, arch, int(key("block_count")))
    return ModelConfig(
        architecture="MixtralForCausalLM" if arch == "llama" and moe else GGUF_ARCHITECTURES[arch],
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
        rope_scaling=_rope_scaling(f, arch, theta, head_dim, rope_dim),
        tie_word_embeddings="output.weight" not in f.tensors,
        attention_bias="blk.0.attn_q.bias" in f.tensors,
        o_proj_bias="blk.0.attn_output.bias" in f.tensors,
        qk_norm=arch in ("qwen3", "qwen3moe", "gemma3"),
        partial_rotary_factor=rope_dim / head_dim,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos if i is not None)),
        **moe,
        **_gemma_config(f, arch, hidden // n_heads, head_dim),
        **_phi3_config(f, arch),
    )


def _moe_config(f: GGUFFile, arch: str, n_layers: int) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields from `{arch}.expert_*` metadata ({} for a dense model).

    The routing rule is llama.cpp's: softmax over all experts, the top k, renormalised except for Qwen2-MoE
    (Mixtral: the same as a softmax over the top-k logits). A layer is a MoE layer when it has a router
    (ffn_gate_inp); Qwen2-MoE's shared expert is sized by expert_shared_feed_forward_length."""
    md = f.metadata
    experts = int(md.get(f"{arch}.expert_count", 0) or 0)
    if not experts:
        return {}
    k = int(md.get(f"{arch}.expert_used_count", 0) or 0)
    if not 0 < k <= experts:
        raise ModelLoadError(f"{f.path}: {arch}.expert_used_count {k} must be in 1..expert_count ({experts})")
    inter = md.get(f"{arch}.expert_feed_forward_length", md.get(f"{arch}.feed_forward_length"))
    if inter is None:
        raise ModelLoadError(f"{f.path}: GGUF metadata {arch}.expert_feed_forward_length is missing")
    return dict(num_experts=experts, num_experts_per_tok=k, moe_intermediate_size=int(inter),
                norm_topk_prob=bool(md.get(f"{arch}.expert_weights_norm", arch != "qwen2moe")),
                router="topk_softmax" if arch == "llama" else "softmax_topk",
                moe_layers=tuple(f"blk.{i}.ffn_gate_inp.weight" in f.tensors for i in range(n_layers)),
                shared_expert_intermediate_size=int(md.get(f"{arch}.expert_shared_feed_forward_length", 0) or 0))


def _gemma_config(f: GGUFFile, arch: str, hidden_per_head: int, head_dim: int) -> dict[str, Any]:
    """ModelConfig's Gemma 2/3 fields, as llama.cpp reads the file ({} for other architectures).

    The file states the window but not which layers have it: llama.cpp (and transformers' defaults) make
    every 6th layer global in Gemma 3 and every 2nd in Gemma 2. Gemma 3's local layers' RoPE base is
    `{arch}.rope.freq_base_swa` where present, else 10000 (llama.cpp's default; transformers always uses
    10000); Gemma 2 has one base for both kinds. The attention scale is 1/sqrt(head_dim), except for the
    27B models (Gemma 3: 62 layers, Gemma 2: 46), whose query_pre_attn_scalar is hidden/heads; llama.cpp
    has the same rule. Gemma 2's window and soft-capping values default to llama.cpp's (and
    transformers' Gemma2Config's) where the file omits them: 4096, attention 50, final logits 30."""
    if arch not in GEMMA_ARCHITECTURES:
        return {}
    md = f.metadata
    n_layers = int(md[f"{arch}.block_count"])
    gemma2 = arch == "gemma2"
    window = md.get(f"{arch}.attention.sliding_window", 4096 if gemma2 else None)
    pattern = 2 if gemma2 else 6
    big = n_layers == (46 if gemma2 else 62)
    return dict(
        sliding_window=None if window is None else int(window),
        layer_types=tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)),
        rope_local_theta=None if gemma2 else float(md.get(f"{arch}.rope.freq_base_swa", 10000.0)),
        query_pre_attn_scalar=float(hidden_per_head if big else head_dim),
        final_logit_softcapping=softcap(md.get(f"{arch}.final_logit_softcapping", 30.0 if gemma2 else None),
                                        f"{f.path}: {arch}.final_logit_softcapping"),
        attn_logit_softcapping=softcap(md.get(f"{arch}.attn_logit_softcapping", 50.0 if gemma2 else None),
                                       f"{f.path}: {arch}.attn_logit_softcapping"),
        hidden_act="gelu_pytorch_tanh",
    )


def _phi3_config(f: GGUFFile, arch: str) -> dict[str, Any]:
    """Phi-3's window: llama.cpp's converter writes the config's sliding_window, 0 for none (Phi-4-mini)."""
    if arch != "phi3":
        return {}
    window = int(f.metadata.get(f"{arch}.attention.sliding_window", 0) or 0)
    return dict(sliding_window=window or None)


def _uniform(value: Any, name: str) -> int:
    """A per-layer array must hold one value (tokenloom has no per-layer head counts)."""
    values = {int(v) for v in np.atleast_1d(value)}
    if len(values) != 1:
        raise UnsupportedArchitecture(f"{name} differs between layers ({sorted(values)})")
    return values.pop()


def _rope_scaling(f: GGUFFile, arch: str, theta: float, head_dim: int, rope_dim: int) -> RopeScaling:
    md = f.metadata
    if arch == "phi3" and "rope_factors_long.weight" in f.tensors:
        return _phi3_longrope(f, arch, rope_dim)
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


def _phi3_longrope(f: GGUFFile, arch: str, rope_dim: int) -> RopeScaling:
    """LongRoPE from what llama.cpp's Phi-3 converter writes: the long and short factors as tensors (rope_dim/2
    each), the original context length, and the attention factor (it computes transformers' value,
    sqrt(1 + ln s / ln original) for s = context / original > 1; read when present, else computed)."""
    md = f.metadata
    orig = md.get(f"{arch}.rope.scaling.original_context_length")
    if orig is None or "rope_factors_short.weight" not in f.tensors:
        raise ModelLoadError(f"{f.path}: phi3 rope_factors_long needs rope_factors_short and "
                             f"{arch}.rope.scaling.original_context_length")
    short, long = (f.tensor(f"rope_factors_{k}.weight").flatten().tolist() for k in ("short", "long"))
    attention = md.get(f"{arch}.rope.scaling.attn_factor")
    d = {"short_factor": short, "long_factor": long}
    if attention is not None:
        d["attention_factor"] = float(attention)
    try:
        return parse_rope_scaling(d | {"rope_type": "longrope"}, int(md[f"{arch}.context_length"]), int(orig), rope_dim)
    except UnsupportedArchitecture as e:
        raise ModelLoadError(f"{f.path}: {e}") from e


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
    # mixture of experts (Mixtral, Qwen2/3-MoE): the router, and the experts stacked (E, I, H) / (E, H, I)
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",  # Qwen2-MoE's shared expert and its gate
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
# Gemma: ffn_norm is the norm before the MLP; the norms after attention and after the MLP have tensors of their own.
_GEMMA_LAYER_TENSORS = {**_LAYER_TENSORS, "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                        "post_attention_norm.weight": "post_attention_layernorm.weight",
                        "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
# Phi-3: q/k/v in one tensor, and ffn_up holding gate's rows then up's (transformers' gate_up_proj).
_PHI3_LAYER_TENSORS = {**_LAYER_TENSORS, "attn_qkv.weight": "self_attn.qkv_proj.weight",
                       "ffn_up.weight": "mlp.gate_up_proj.weight"}
_PHI3_GLOBAL = {"rope_factors_long.weight", "rope_factors_short.weight"}  # read into the config (LongRoPE)
_DENSE_FFN = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
_MOE_FFN = ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
_SHARED_FFN = ("ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")
_CONSUMED = {"rope_freqs.weight"}  # read into the config, not a weight
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def _layer_table(arch: str) -> dict[str, str]:
    return _GEMMA_LAYER_TENSORS if arch in GEMMA_ARCHITECTURES else _PHI3_LAYER_TENSORS if arch == "phi3" \
        else _LAYER_TENSORS


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """llama.cpp tensor name -> HF name (None for names the llama/qwen2/qwen3 families do not have)."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    table = _layer_table(arch)
    if m and m.group(2) in table:
        return f"model.layers.{m.group(1)}.{table[m.group(2)]}"
    return None


def state_dict_from_gguf(f: GGUFFile, config: ModelConfig, dtype: torch.dtype,
                         skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """HF-named dequantized tensors; `skip`: GGUF tensors kept quantized elsewhere (gguf_kept.py)."""
    arch = str(f.metadata["general.architecture"])
    heads = {".attn_q.": config.num_attention_heads, ".attn_k.": config.num_key_value_heads}
    jobs: list[tuple[str, int | None]] = []  # (GGUF name, heads whose RoPE rows to un-permute)
    names: list[str] = []
    for name in f.tensors:
        if name in _CONSUMED or name in skip or (arch == "phi3" and name in _PHI3_GLOBAL):
            continue
        hf_name = hf_tensor_name(name, arch)
        if hf_name is None:
            raise UnsupportedArchitecture(f"{arch} GGUF has tensor {name!r}, which tokenloom's {arch} model lacks")
        permute = next((n for part, n in heads.items() if part in name), None) if arch in ROPE_PERMUTED else None
        jobs.append((name, permute))
        names.append(hf_name)

    def load(job: tuple[str, int | None]) -> torch.Tensor:
        name, permute = job
        if arch in GEMMA_ARCHITECTURES and name.endswith("norm.weight"):  # stored as 1 + w (float32)
            return (f.tensor(name, torch.float32) - 1).to(dtype)
        w = f.tensor(name, dtype)
        return w if permute is None else unpermute_rope_rows(w, permute)

    out = dict(zip(names, _map_single_threaded(load, jobs)))
    _check_complete(out, config, f.path, {n for s in skip if (n := hf_tensor_name(s, arch)) is not None}, arch)
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


def _check_complete(sd: dict[str, torch.Tensor], config: ModelConfig, path: Path, elsewhere: set[str],
                    arch: str) -> None:
    needed = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        needed.append("lm_head.weight")
    optional = {"attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias", "attn_q_norm.weight",
                "attn_k_norm.weight", *_DENSE_FFN, *_MOE_FFN, *_SHARED_FFN}  # the FFN's: per layer below
    table = _layer_table(arch)
    fused = arch == "phi3"  # attn_qkv for attn_q/k/v; ffn_up for ffn_gate + ffn_up
    optional |= {"attn_qkv.weight"} | ({"attn_q.weight", "attn_k.weight", "attn_v.weight"} if fused else set())
    wanted = [k for k in table if k not in optional] + (["attn_qkv.weight"] if fused else [])
    if config.attention_bias:
        wanted += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
    if config.o_proj_bias:
        wanted.append("attn_output.bias")
    if config.qk_norm:
        wanted += ["attn_q_norm.weight", "attn_k_norm.weight"]
    per_layer = [table[k] for k in wanted]
    needed += [f"model.layers.{i}.{n}" for i in range(config.num_hidden_layers) for n in per_layer]
    moe_ffn = _MOE_FFN + (_SHARED_FFN if config.shared_expert_intermediate_size else ())
    dense_ffn = ("ffn_up.weight", "ffn_down.weight") if fused else _DENSE_FFN
    needed += [f"model.layers.{i}.{table[k]}" for i in range(config.num_hidden_layers)
               for k in (moe_ffn if config.layer_is_moe(i) else dense_ffn)]
    missing = [n for n in needed if n not in sd and n not in elsewhere]
    if missing:
        raise ModelLoadError(f"{path}: GGUF lacks {len(missing)} tensors, e.g. {missing[:3]}")
