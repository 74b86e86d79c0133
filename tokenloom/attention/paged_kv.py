"""One layer's paged K/V storage, in the model dtype or in INT8 with a scale per token and head.

Layout: k and v are (num_blocks, block_size, num_kv_heads, head_dim). Token t of a sequence lives in
block `block_table[t // block_size]` at offset `t % block_size`, i.e. at flat slot
`block * block_size + offset` of the cache viewed as (num_blocks * block_size, heads, dim).

INT8 (`--kv-cache-dtype int8`): k and v hold int8 codes and k_scale / v_scale (num_blocks, block_size,
num_kv_heads) float16 hold one symmetric scale per token and head, value ~= code * scale with
scale = max|x| / 127 over the head's dimensions. Scales are per token because a block fills one token
at a time (a block-wide scale would have to change as later tokens arrive), and per head because
heads differ in range by an order of magnitude. A token of one head costs head_dim + 2 bytes instead
of 2 * head_dim: 1.94x the tokens for head_dim 64, 1.97x for 128.
Attention always reads what the cache holds: `write` returns the dequantized K/V of the new tokens,
so a prompt attends to the same values whether it is prefilled in one chunk or many.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = ("auto", "int8")  # auto: the model's dtype
SCALE_DTYPE = torch.float16
_MIN_SCALE = 2.0**-24  # float16's smallest subnormal: an all-zero head gets codes 0, not 0/0


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, H, D) float -> (T, H, D) int8 codes and (T, H) float16 scales. The codes are fitted to the
    float16-rounded scale, so |x - code * scale| <= scale / 2 holds for the stored scale."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / 127.0).clamp(_MIN_SCALE, 65504.0).to(SCALE_DTYPE)
    codes = torch.round(xf / scale.float()[..., None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes (..., D) int8, scale (...) -> (..., D) in `dtype`."""
    return (codes.float() * scale.float()[..., None]).to(dtype)


@dataclass(frozen=True)
class LayerKVCache:
    k: torch.Tensor  # (num_blocks, block_size, Hkv, D): model dtype, or int8 codes
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # (num_blocks, block_size, Hkv) float16 when int8, else None
    v_scale: torch.Tensor | None = None

    @classmethod
    def allocate(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 quantized: bool, device: torch.device) -> "LayerKVCache":
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        if not quantized:
            return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        codes = [torch.zeros(shape, dtype=torch.int8, device=device) for _ in range(2)]
        scales = [torch.zeros(shape[:3], dtype=SCALE_DTYPE, device=device) for _ in range(2)]
        return cls(codes[0], codes[1], scales[0], scales[1])

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the layer, in a fixed order (block copies and transfers walk these)."""
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scatter the new tokens' K/V (T, Hkv, D) into their slots; returns them as the cache now holds
        them (the INT8 round trip applied), in the input dtype."""
        n, bs, h, d = self.k.shape
        if not self.quantized:
            self.k.view(n * bs, h, d).index_copy_(0, slot_mapping, k.to(self.k.dtype))
            self.v.view(n * bs, h, d).index_copy_(0, slot_mapping, v.to(self.v.dtype))
            return k, v
        out = []
        for x, codes, scales in zip((k, v), (self.k, self.v), self._scales()):
            q, s = quantize_kv(x)
            codes.view(n * bs, h, d).index_copy_(0, slot_mapping, q)
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
