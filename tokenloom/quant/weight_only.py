"""Weight-only quantization of a model's linear layers at load time (`--quantization int8|int4`).

INT8 per output channel, INT4 per group of `group_size` inputs (the quantizers: quant/quantizers.py,
re-exported here); the layers themselves (and their kernels) are in quant/linear.py.
The LM head is quantized too (a decode step reads it whole); when it is tied to the embeddings, the
embedding table stays in the model dtype for the lookup and the head gets its own quantized copy. With
int4 the head is INT8, as llama.cpp's 4-bit mixes keep their output matrix at 6 bits or more: every
logit goes through it (docs/performance-notes.md#quantized-lm-head).
"""

from __future__ import annotations

from typing import get_args

import torch
from torch import nn

from tokenloom.config import Quantization
from tokenloom.errors import ConfigError
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
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
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
    return len(targets)


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
