"""Float weights -> quantized codes with float16 scales (and mins): the math of `--quantization int8|int4`.

- INT8: symmetric, one scale per output channel: w ~= d q, q in [-127, 127].
- INT4: asymmetric, one (scale, min) pair per group of `group_size` input channels: w ~= d q + m,
  q in [0, 15] (the form of GGUF Q4_1, so kept GGUF tensors and ours share one kernel).
Scales and mins are rounded to float16 before the codes are computed, so the codes fit the values
the kernel uses. The layers built from the codes are in quant/linear.py, the model-wide swap in
quant/weight_only.py; both import this module.
"""

from __future__ import annotations

import torch

from tokenloom.config import INT4_GROUP_SIZES
from tokenloom.errors import ConfigError

# Smallest float16 step: a scale below it would round to 0 (all-equal groups).
_MIN_SCALE = 2.0**-24


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
