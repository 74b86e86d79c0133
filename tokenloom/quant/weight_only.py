"""Weight-only quantization of a model's linear layers at load time (`--quantization int8|int4`).

INT8 per output channel, INT4 per group of `group_size` inputs (the quantizers: quant/quantizers.py,
re-exported here); the layers themselves (and their kernels) are in quant/linear.py.
The LM head is quantized too (a decode step reads it whole); when it is tied to the embeddings, the
embedding table stays in the model dtype for the lookup and the head gets its own quantized copy. With
int4 the head is INT8, as llama.cpp's 4-bit mixes keep their output matrix at 6 bits or more: every
logit goes through it (docs/performance-notes.md#quantized-lm-head).
A mixture-of-experts block's expert stacks become per-expert quantized layers (models/moe.py's QuantExperts);
its router (and Qwen2-MoE's shared-expert gate) stays in the model dtype: a few kilobytes that pick the experts,
as llama.cpp's quantized files keep ffn_gate_inp unquantized.
"""

from __future__ import annotations

from typing import get_args

import torch
from torch import nn

from tokenloom.config import Quantization
from tokenloom.errors import ConfigError
from tokenloom.models.moe import QuantExperts, SparseMoE
from tokenloom.quant.linear import Int4Linear, Int8Linear, QuantLinear
from tokenloom.quant.quantizers import INT4_GROUP_SIZES, int4_group_size, quantize_int4, quantize_int8

__all__ = ["Int4Linear", "Int8Linear", "QuantLinear", "QUANTIZATIONS", "INT4_GROUP_SIZES", "quantize_int8",
           "quantize_int4", "int4_group_size", "quantize_model", "weight_bytes"]

QUANTIZATIONS = get_args(Quantization)


def quantize_model(model: nn.Module, method: str, group_size: int = 128) -> int:
    """Swap every Linear of the decoder layers and the LM head for its quantized twin; returns how many.
    Layers that are already quantized (kept GGUF tensors) are left as they are."""
    if method not in QUANTIZATIONS:
        raise ConfigError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {method!r}")
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ConfigError("quantization needs a model with decoder `layers`")
    targets = [(parent, name, child) for layer in layers for parent in layer.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)
               and not (isinstance(parent, SparseMoE) and name in ("gate", "shared_expert_gate"))]
    blocks = [m for layer in layers for m in layer.modules() if isinstance(m, SparseMoE) and m.experts is None]
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear):
        targets.append((model, "lm_head", head))  # last: int8 whatever the method (see the module docstring)
    for parent, name, child in targets:
        if child.weight.device.type != "cpu":
            raise ConfigError("weight-only quantization kernels are CPU-only in tokenloom for now")
        if child.weight.dtype != torch.bfloat16:
            raise ConfigError(f"--quantization {method} needs --dtype bfloat16, not {child.weight.dtype}")
        # int4 needs a group size dividing K; a layer without one is quantized to int8 instead.
        int4 = (method == "int4" and child is not head
                and any(child.in_features % g == 0 for g in INT4_GROUP_SIZES))
        new = Int4Linear.from_linear(child, group_size) if int4 else Int8Linear.from_linear(child)
        setattr(parent, name, new)
    for block in blocks:
        _quantize_experts(block, method, group_size)
    return len(targets) + sum(2 * b.num_experts for b in blocks)


def _quantize_experts(block: SparseMoE, method: str, group_size: int) -> None:
    """The block's (E, 2I, H) / (E, H, I) stacks -> one quantized gate_up and down layer per expert."""
    stacks = (block.experts_gate_up, block.experts_down)
    if any(w.device.type != "cpu" or w.dtype != torch.bfloat16 for w in stacks):
        raise ConfigError(f"--quantization {method} needs --dtype bfloat16 on CPU, not {stacks[0].dtype} "
                          f"on {stacks[0].device.type}")

    def layer(w: torch.Tensor) -> QuantLinear:  # (N, K) -> its quantized twin, int8 where int4 has no group
        if method == "int4" and any(w.shape[1] % g == 0 for g in INT4_GROUP_SIZES):
            return Int4Linear.from_codes(*quantize_int4(w, int4_group_size(w.shape[1], group_size)))
        return Int8Linear.from_codes(*quantize_int8(w))

    block.set_experts(QuantExperts([layer(w) for w in stacks[0]], [layer(w) for w in stacks[1]]))


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights: its state dict (parameters and the quantized layers' buffers, not
    the RoPE cos/sin cache), tied tensors counted once."""
    seen: set[int] = set()
    total = 0
    for t in model.state_dict().values():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total
