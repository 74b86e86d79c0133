"""GGUF tensors kept quantized: linear weights of type Q8_0, Q4_0, Q4_1 (Int8Linear / Int4Linear, a byte
shuffle into the kernels' layout) and Q5_0, Q4_K, Q5_K, Q6_K (KQuantLinear, the blocks as they are) become
quantized layers straight from their blocks, with no re-quantization: each layer's weight equals the float32
dequantization of its GGUF tensors exactly. A mixture-of-experts layer's stacks (ffn_{gate,up,down}_exps,
3-D) become a QuantExperts (models/moe.py): one gate/up and one down layer per expert, from its slice.

A fused layer (q/k/v, gate/up) whose parts share a kind (Q8_0; Q4_0 and Q4_1; one K-quant type) is one
layer over the concatenated rows; parts of different kinds (Gemma 3 Q4_K_M: q/k Q5_0, v Q8_0) become a
PartsLinear of one layer per run of a kind. The token table, when its type is kept, becomes a QuantEmbedding
over the same blocks as the tied LM head (one copy). Everything else (F16/BF16/F32 tensors, norms, other
quantized types) is dequantized by the caller; the types of the quantized ones are logged once.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from typing import NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from tokenloom.models.config import ModelConfig
from tokenloom.models.gguf import ROPE_PERMUTED, unpermute_rope_rows
from tokenloom.models.gguf_file import GGUFFile
from tokenloom.models.moe import QuantExperts
from tokenloom.quant.embedding import QuantEmbedding
from tokenloom.quant.kquant import KQUANT_TYPES, KQuantLinear
from tokenloom.quant.linear import Int4Linear, Int8Linear
from tokenloom.quant.parts import PartsLinear

log = logging.getLogger("tokenloom.models")

Q = GGMLQuantizationType
LEGACY_TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1)
KEPT_TYPES = (*LEGACY_TYPES, *KQUANT_TYPES)
_BLOCK = 32
_UNQUANTIZED = (Q.F32, Q.F16, Q.BF16, Q.F64)


class Part(NamedTuple):
    """One GGUF tensor's rows (or one expert's slice of a stack): (rows, row bytes) uint8 blocks."""

    blocks: torch.Tensor
    qtype: GGMLQuantizationType

# module path in tokenloom's model -> the GGUF tensors fused into it (per layer; {i} = layer index)
_FUSED = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
    # Qwen2-MoE's shared expert (its sigmoid gate, ffn_gate_inp_shexp, stays float as the router does)
    "mlp.shared_expert.gate_up_proj": ("ffn_gate_shexp", "ffn_up_shexp"),
    "mlp.shared_expert.down_proj": ("ffn_down_shexp",),
}
# Phi-3's file holds q/k/v and gate/up fused already (ffn_up: gate rows, then up rows)
_FUSED_PHI3 = {**_FUSED, "self_attn.qkv_proj": ("attn_qkv",), "mlp.gate_up_proj": ("ffn_up",)}


def blocks_to_codes(b: torch.Tensor, qtype: GGMLQuantizationType, rows: int, k: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(rows * K/32, type_size) uint8 blocks -> (rows, K) codes, (rows, K/32) float16 scales and (int4)
    mins, with w = d q (+ m) equal to the GGUF dequantization."""
    d = b[:, :2].contiguous().view(torch.float16).reshape(rows, k // _BLOCK)
    if qtype == Q.Q8_0:  # d f16 | int8[32]
        return b[:, 2:].contiguous().view(torch.int8).reshape(rows, k), d, None
    qs = b[:, 2:] if qtype == Q.Q4_0 else b[:, 4:]  # Q4_1: d f16 | m f16 | qs[16]
    # qs[j]: element j in the low nibble, j + 16 in the high one
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(rows, k)
    if qtype == Q.Q4_0:  # d (q - 8) = d q - 8 d, and -8 d is exact in float16
        return q, d, (d.float() * -8.0).half()
    return q, d, b[:, 2:4].contiguous().view(torch.float16).reshape(rows, k // _BLOCK)


def _kind(qtype: GGMLQuantizationType) -> str:
    """Parts of one kind fuse into one layer: int8 (Q8_0), int4 (Q4_0, Q4_1), or one K-quant type."""
    return "int8" if qtype == Q.Q8_0 else "int4" if qtype in (Q.Q4_0, Q.Q4_1) else qtype.name


def _rows(f: GGUFFile, name: str, heads: dict[str, int]) -> Part:
    """The tensor's blocks as (rows, row bytes) uint8, with llama.cpp's q/k row permutation undone; an (E, N, K)
    stack's rows are (E*N, row bytes)."""
    t = f.tensors[name]
    rows = torch.from_numpy(np.asarray(f.raw(name))).view(torch.uint8).reshape(math.prod(t.shape[:-1]), -1)
    n_heads = next((n for part, n in heads.items() if part in name), None)
    return Part(rows if n_heads is None else unpermute_rope_rows(rows, n_heads), t.qtype)


def _layer(parts: list[Part], k: int, bias: torch.Tensor | None) -> nn.Module:
    """One quantized layer over parts of one kind, rows concatenated (a copy: nothing stays on the mapping)."""
    qtype = parts[0].qtype
    if qtype in KQUANT_TYPES:
        return KQuantLinear(torch.cat([p.blocks for p in parts]), qtype, k, bias)
    # legacy: per part, as each part's type may differ within a kind (Q4_0 with Q4_1)
    codes = [blocks_to_codes(p.blocks.reshape(-1, GGML_QUANT_SIZES[p.qtype][1]), p.qtype, p.blocks.shape[0], k)
             for p in parts]
    q, d = torch.cat([c[0] for c in codes]), torch.cat([c[1] for c in codes])
    if codes[0][2] is None:
        return Int8Linear.from_codes(q, d, bias)
    return Int4Linear.from_codes(q, d, torch.cat([c[2] for c in codes if c[2] is not None]), bias)


def _fused(parts: list[Part], k: int, biases: list[torch.Tensor | None]) -> nn.Module:
    """The layer for a module path: one layer, or a PartsLinear of one per run of parts of one kind."""
    runs: list[tuple[list[Part], list[torch.Tensor | None]]] = []
    for part, b in zip(parts, biases):
        if runs and _kind(runs[-1][0][-1].qtype) == _kind(part.qtype):
            runs[-1][0].append(part)
            runs[-1][1].append(b)
        else:
            runs.append(([part], [b]))
    layers = []
    for ps, bs in runs:
        bias = None if all(b is None for b in bs) else torch.cat(
            [torch.zeros(p.blocks.shape[0]) if b is None else b for p, b in zip(ps, bs)]).bfloat16()
        layers.append(_layer(ps, k, bias))
    return layers[0] if len(layers) == 1 else PartsLinear(layers)


def _experts(f: GGUFFile, i: int) -> QuantExperts | None:
    """Layer i's experts as per-expert quantized layers, or None when its expert stacks are not all kept types.

    ffn_{gate,up}_exps: (E, I, H), ffn_down_exps: (E, H, I) in torch order; expert e's rows of a stack are
    rows e*N .. (e+1)*N of its (E*N, row bytes) blocks (a GGUF row never spans two experts)."""
    names = [f"blk.{i}.ffn_{p}_exps.weight" for p in ("gate", "up", "down")]
    infos = [t for n in names if (t := f.tensors.get(n)) is not None and t.qtype in KEPT_TYPES and len(t.shape) == 3]
    if len(infos) != 3:
        return None
    e_count, hidden, inter = infos[0].shape[0], infos[0].shape[2], infos[2].shape[2]
    stacks = [_rows(f, n, {}) for n in names]  # (E*N, row bytes) each
    gate_up: list[nn.Module] = []
    down: list[nn.Module] = []
    for e in range(e_count):
        gate, up, dn = (Part(s.blocks.reshape(e_count, -1, s.blocks.shape[1])[e], s.qtype) for s in stacks)
        gate_up.append(_fused([gate, up], hidden, [None, None]))  # (n, H) -> (n, 2I), gate rows first
        down.append(_fused([dn], inter, [None]))  # (n, I) -> (n, H)
    return QuantExperts(gate_up, down)


def kept_layers(f: GGUFFile, config: ModelConfig) -> tuple[dict[str, nn.Module], set[str]]:
    """Quantized layers by module path ("layers.3.mlp.down_proj", "lm_head", "embed_tokens") and the GGUF
    tensors they consumed (the caller must not dequantize those)."""
    arch = str(f.metadata["general.architecture"])
    heads = ({".attn_q.": config.num_attention_heads, ".attn_k.": config.num_key_value_heads}
             if arch in ROPE_PERMUTED else {})
    plan: dict[str, tuple[list[str], list[str]]] = {}  # path -> (weight names, bias names)
    for i in range(config.num_hidden_layers):
        for path, parts in (_FUSED_PHI3 if arch == "phi3" else _FUSED).items():
            plan[f"layers.{i}.{path}"] = ([f"blk.{i}.{p}.weight" for p in parts], [f"blk.{i}.{p}.bias" for p in parts])
    tied = "output.weight" not in f.tensors
    plan["lm_head"] = (["token_embd.weight" if tied else "output.weight"], [])
    layers: dict[str, nn.Module] = {}
    consumed: set[str] = set()
    for path, (weights, biases) in plan.items():
        infos = [f.tensors.get(w) for w in weights]
        if any(t is None or t.qtype not in KEPT_TYPES or len(t.shape) != 2 for t in infos):
            continue
        if len({t.shape[1] for t in infos if t is not None}) != 1:
            continue
        bias = [f.tensor(b).float() if b in f.tensors else None for b in biases] or [None] * len(weights)
        layers[path] = _fused([_rows(f, w, heads) for w in weights], f.tensors[weights[0]].shape[1], bias)
        consumed.update(weights)
        consumed.update(b for b in biases if b in f.tensors)
    for i in range(config.num_hidden_layers):
        experts = _experts(f, i) if config.layer_is_moe(i) else None
        if experts is not None:
            layers[f"layers.{i}.mlp.experts"] = experts
            consumed.update(f"blk.{i}.ffn_{p}_exps.weight" for p in ("gate", "up", "down"))
    table = f.tensors.get("token_embd.weight")
    if tied and "lm_head" in layers:
        layers["embed_tokens"] = QuantEmbedding(layers["lm_head"])  # the head's blocks, one copy
    elif table is not None and table.qtype in KEPT_TYPES and len(table.shape) == 2:
        layers["embed_tokens"] = QuantEmbedding(_layer([_rows(f, "token_embd.weight", {})], table.shape[1], None))
        consumed.add("token_embd.weight")
    _log_dequantized(f, consumed)
    return layers, consumed


def _log_dequantized(f: GGUFFile, consumed: set[str]) -> None:
    """One line naming the quantized GGUF tensors the caller will dequantize, by type."""
    left = {name: t.qtype for name, t in f.tensors.items() if name not in consumed and t.qtype not in _UNQUANTIZED}
    if not left:
        return
    by_type = Counter(q.name for q in left.values())
    log.info("GGUF tensors dequantized at load (not kept quantized): %s; e.g. %s",
             ", ".join(f"{n} x {name}" for name, n in sorted(by_type.items())), ", ".join(sorted(left)[:4]))
