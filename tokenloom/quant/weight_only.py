"""Weight-only quantization of a model's linear layers at load time (`--quantization int8|int4`).

- INT8: symmetric, one scale per output channel: w ~= d q, q in [-127, 127].
- INT4: asymmetric, one (scale, min) pair per group of `group_size` input channels: w ~= d q + m,
  q in [0, 15] (the form of GGUF Q4_1, so kept GGUF tensors and ours share one kernel).
Scales and mins are rounded to float16 before the codes are computed, so the codes fit the values
the kernel uses. The layers themselves (and their kernels) are in quant/linear.py.
The LM head is quantized too (a decode step reads it whole: 56 of SmolLM2's 270 MB); when it is tied
to the embeddings, the embedding table stays in the model dtype for the lookup and the head gets its
own quantized copy. With int4 the head is INT8, as llama.cpp's 4-bit mixes keep their output matrix at
6 bits or more: every logit goes through it, and on SmolLM2 a 4-bit head alone costs 5.5% perplexity
(int4 g32: +5.48% with a 4-bit head, -0.03% with an 8-bit one; benchmarks/quantization.py).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenloom.errors import ConfigError
from tokenloom.quant.linear import Int4Linear, Int8Linear, QuantLinear

__all__ = ["Int4Linear", "Int8Linear", "QuantLinear", "QUANTIZATIONS", "INT4_GROUP_SIZES", "quantize_int8",
           "quantize_int4", "int4_group_size", "quantize_model", "weight_bytes"]

# Smallest float16 step: a scale below it would round to 0 (all-equal groups).
_MIN_SCALE = 2.0**-24

QUANTIZATIONS = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (N, K) int8 codes and (N, 1) float16 scales (one per output channel)."""
    scale = (w.float().abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(_MIN_SCALE).half()
    q = torch.round(w.float() / scale.float()).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) float -> (N, K) uint8 codes in [0, 15], (N, K/g) float16 scales d and mins m, with
    w ~= d q + m: m is the group's minimum, d its range / 15."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group_size, group_size)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp_min(_MIN_SCALE).half()
    lo16 = lo.half()
    q = torch.round((wg - lo16.float()[..., None]) / scale.float()[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(n, k), scale, lo16


def int4_group_size(k: int, wanted: int) -> int:
    """`wanted` if it divides the layer's input size, else the largest supported size that does
    (SmolLM2's hidden size 576 is not a multiple of 128: its layers use 64)."""
    if k % wanted == 0:
        return wanted
    for g in sorted(INT4_GROUP_SIZES, reverse=True):
        if g < wanted and k % g == 0:
            return g
    raise ConfigError(f"no INT4 group size in {INT4_GROUP_SIZES} divides the input size {k}")


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
