"""GGUF tensors kept quantized: Q8_0, Q4_0 and Q4_1 linear weights become Int8Linear / Int4Linear
layers straight from their blocks (a byte shuffle into the kernels' layout, no re-quantization: the
layer's weight equals the float32 dequantization of the GGUF tensor exactly).

A fused layer (q/k/v, gate/up) is kept only when its parts share a code width (Q4_0 and Q4_1 mix;
Q8_0 does not mix with them); other layers, and all other types (Q4_K, Q6_K, ...), are dequantized as
before. With tied embeddings the token table stays dense for the lookup and the LM head is a kept
layer over the same blocks.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

from tokenloom.models.config import ModelConfig
from tokenloom.models.gguf import ROPE_PERMUTED, unpermute_rope_rows
from tokenloom.models.gguf_file import GGUFFile
from tokenloom.quant.linear import Int4Linear, Int8Linear, QuantLinear

Q = GGMLQuantizationType
KEPT_TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1)
_BLOCK = 32

# module path in tokenloom's model -> the GGUF tensors fused into it (per layer; {i} = layer index)
_FUSED = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


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


def _codes(f: GGUFFile, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    t = f.tensors[name]
    rows, k = t.shape
    b = torch.from_numpy(np.asarray(f.raw(name))).view(rows * k // _BLOCK, -1)
    return blocks_to_codes(b, t.qtype, rows, k)


def _layer(f: GGUFFile, parts: list[str], heads: dict[str, int], bias: torch.Tensor | None) -> QuantLinear:
    qs, ds, ms = [], [], []
    for name in parts:
        q, d, m = _codes(f, name)
        n_heads = next((n for part, n in heads.items() if part in name), None)
        if n_heads is not None:  # undo llama.cpp's q/k row permutation: rows move, values do not
            q, d = unpermute_rope_rows(q, n_heads), unpermute_rope_rows(d, n_heads)
            m = None if m is None else unpermute_rope_rows(m, n_heads)
        qs.append(q)
        ds.append(d)
        ms.append(m)
    q, d = torch.cat(qs), torch.cat(ds)
    if ms[0] is None:
        return Int8Linear.from_codes(q, d, bias)
    return Int4Linear.from_codes(q, d, torch.cat([m for m in ms if m is not None]), bias)


def _width(qtype: GGMLQuantizationType) -> int:
    return 8 if qtype == Q.Q8_0 else 4


def kept_layers(f: GGUFFile, config: ModelConfig) -> tuple[dict[str, QuantLinear], set[str]]:
    """Quantized layers by module path ("layers.3.mlp.down_proj", "lm_head") and the GGUF tensors they
    consumed (the caller must not dequantize those)."""
    arch = str(f.metadata["general.architecture"])
    heads = ({".attn_q.": config.num_attention_heads, ".attn_k.": config.num_key_value_heads}
             if arch in ROPE_PERMUTED else {})
    plan: dict[str, tuple[list[str], list[str]]] = {}  # path -> (weight names, bias names)
    for i in range(config.num_hidden_layers):
        for path, parts in _FUSED.items():
            plan[f"layers.{i}.{path}"] = ([f"blk.{i}.{p}.weight" for p in parts], [f"blk.{i}.{p}.bias" for p in parts])
    plan["lm_head"] = (["output.weight" if "output.weight" in f.tensors else "token_embd.weight"], [])
    layers: dict[str, QuantLinear] = {}
    consumed: set[str] = set()
    for path, (weights, biases) in plan.items():
        infos = [f.tensors.get(w) for w in weights]
        if any(t is None or t.qtype not in KEPT_TYPES or len(t.shape) != 2 for t in infos):
            continue
        if len({_width(t.qtype) for t in infos if t is not None}) != 1:
            continue
        present = [b for b in biases if b in f.tensors]
        bias = torch.cat([f.tensor(b) for b in present]).bfloat16() if present else None
        layers[path] = _layer(f, weights, heads, bias)
        consumed.update(w for w in weights if w != "token_embd.weight")  # the table is still needed
        consumed.update(present)
    return layers, consumed
