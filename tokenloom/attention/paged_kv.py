"""One layer's paged K/V storage, in the model dtype or in INT8 with a scale per head or per token and head.

Layout: k and v are (num_blocks, block_size, num_kv_heads, head_dim). Token t of a sequence lives in
block `block_table[t // block_size]` at offset `t % block_size`, i.e. at flat slot
`block * block_size + offset` of the cache viewed as (num_blocks * block_size, heads, dim).

Which of the three a cache holds is its `format` (config.KVCacheFormat, from --kv-cache-dtype and
--kv-cache-scales). INT8 (`--kv-cache-dtype int8`): k and v hold int8 codes, value ~= code * scale, with
symmetric float16 scales per head, because heads differ in range by an order of magnitude. k_scale /
v_scale are always (num_blocks, block_size, num_kv_heads) tensors, in one of two kinds (`--kv-cache-scales`):
- "head" (default; INT8_PER_HEAD): one fixed scale per layer and head, calibrated once when the engine
  starts (engine/kv_calibration.py). The tensors are views of an (Hkv,) vector with zero block and token
  strides, so a token of one head costs exactly head_dim bytes: twice the tokens of a 16-bit cache.
  Values beyond the calibrated range saturate at +-127 codes.
- "token" (INT8_PER_TOKEN): one scale per token and head, scale = max|x| / 127 over the head's
  dimensions, stored beside the codes (a block fills one token at a time, so a block-wide scale would
  have to change as later tokens arrive). Nothing saturates, and a token of one head costs head_dim + 2
  bytes: 1.94x the tokens for head_dim 64, 1.97x for 128. (engine/kv_cache.py `KVCacheSpec` counts the
  bytes of every format.)
Attention always reads what the cache holds: `write` returns the dequantized K/V of the new tokens,
so a prompt attends to the same values whether it is prefilled in one chunk or many.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloom.config import KVCacheFormat
from tokenloom.errors import ConfigError

SCALE_DTYPE = torch.float16
_MIN_SCALE = 2.0**-24  # float16's smallest subnormal: an all-zero head gets codes 0, not 0/0


def head_scales(amax: torch.Tensor) -> torch.Tensor:
    """Per-head |x| bounds (..., H) -> float16 scales mapping each bound to code 127."""
    return (amax.float() / 127.0).clamp(_MIN_SCALE, 65504.0).to(SCALE_DTYPE)


def quantize_kv(x: torch.Tensor, fixed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, H, D) float -> (T, H, D) int8 codes and (T, H) float16 scales: each row's own (max|x| / 127),
    or `fixed` (H,) float16 for every row. The codes are fitted to the float16 scale, so
    |x - code * scale| <= scale / 2 holds for the stored scale wherever |x| <= 127 scale (beyond,
    codes saturate at +-127)."""
    xf = x.float()
    scale = head_scales(xf.abs().amax(dim=-1)) if fixed is None else fixed.to(SCALE_DTYPE).expand(x.shape[:-1])
    codes = torch.round(xf / scale.float()[..., None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes (..., D) int8, scale (...) -> (..., D) in `dtype`."""
    return (codes.float() * scale.float()[..., None]).to(dtype)


@dataclass(frozen=True)
class LayerKVCache:
    k: torch.Tensor  # (num_blocks, block_size, Hkv, D): model dtype, or int8 codes
    v: torch.Tensor
    format: KVCacheFormat
    # INT8: (num_blocks, block_size, Hkv) float16, per token (contiguous) or per head (an (Hkv,) vector
    # seen with zero block and token strides); None for a model-dtype cache.
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    # The KV group (engine/kv_cache.py `KVGroup`) whose block table indexes this layer's blocks: layers of
    # different groups may share k/v tensors, each through its own group's blocks
    # (AttentionMetadata.for_group picks the table).
    group: int = 0

    def __post_init__(self) -> None:
        for s in (self.k_scale, self.v_scale):
            fixed = s is not None and s.stride(1) == 0  # an (Hkv,) vector seen per block and token
            if (s is not None) != self.format.quantized or fixed != self.format.per_head_scales:
                raise ConfigError(f"a KV cache of format {self.format.value!r} has scales that do not match it")

    @classmethod
    def allocate(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 format: KVCacheFormat, device: torch.device,
                 fixed_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> "LayerKVCache":
        """`fixed_scales`: the layer's calibrated (Hkv,) K and V scales, for (and only for) INT8_PER_HEAD."""
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        if (fixed_scales is not None) != format.per_head_scales:
            raise ConfigError(f"calibrated per-head KV scales go with per-head INT8 and nothing else, not with "
                              f"{format.value!r}")
        if not format.quantized:
            return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                       format)
        codes = [torch.zeros(shape, dtype=torch.int8, device=device) for _ in range(2)]
        if fixed_scales is None:
            scales = [torch.zeros(shape[:3], dtype=SCALE_DTYPE, device=device) for _ in range(2)]
        else:
            for s in fixed_scales:
                if s.shape != (num_kv_heads,):
                    raise ConfigError(f"per-head KV scales must be ({num_kv_heads},), got {tuple(s.shape)}")
            scales = [s.to(device=device, dtype=SCALE_DTYPE).expand(shape[:3]) for s in fixed_scales]
        return cls(codes[0], codes[1], format, scales[0], scales[1])

    @property
    def quantized(self) -> bool:
        return self.format.quantized

    @property
    def per_head_scales(self) -> bool:
        """INT8 with fixed per-head scales: nothing but codes is stored per token."""
        return self.format.per_head_scales

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor with a slice per block, in a fixed order (block copies and transfers walk these);
        fixed per-head scales belong to no block."""
        scales = [] if self.per_head_scales else [self.k_scale, self.v_scale]
        return [t for t in (self.k, self.v, *scales) if t is not None]

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scatter the new tokens' K/V (T, Hkv, D) into their slots; returns them as the cache now holds
        them (the INT8 round trip applied), in the input dtype."""
        n, bs, h, d = self.k.shape
        if not self.quantized:
            self.k.view(n * bs, h, d).index_copy_(0, slot_mapping, k.to(self.k.dtype))
            self.v.view(n * bs, h, d).index_copy_(0, slot_mapping, v.to(self.v.dtype))
            return k, v
        out = []
        fixed = self.per_head_scales
        for x, codes, scales in zip((k, v), (self.k, self.v), self._scales()):
            q, s = quantize_kv(x, scales[0, 0] if fixed else None)
            codes.view(n * bs, h, d).index_copy_(0, slot_mapping, q)
            if not fixed:
                scales.view(n * bs, h).index_copy_(0, slot_mapping, s)
            out.append(dequantize_kv(q, s, x.dtype))
        return out[0], out[1]

    def gather(self, block_ids: torch.Tensor, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` tokens of one sequence, K and V (length, Hkv, D), through its block ids."""
        k, v = self.gather_blocks(block_ids, dtype)
        return k.flatten(0, 1)[:length], v.flatten(0, 1)[:length]

    def gather_blocks(self, block_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given blocks: block_ids (...,) -> (..., block_size, Hkv, D) in `dtype`."""
        if not self.quantized:
            return self.k[block_ids].to(dtype), self.v[block_ids].to(dtype)
        ks, vs = self._scales()
        return (dequantize_kv(self.k[block_ids], ks[block_ids], dtype),
                dequantize_kv(self.v[block_ids], vs[block_ids], dtype))

    def _scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k_scale is None or self.v_scale is None:
            raise RuntimeError("a model-dtype KV cache has no scales")
        return self.k_scale, self.v_scale
