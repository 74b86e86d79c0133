"""Vectorized torch dequantizers for the GGUF (ggml) tensor types that real checkpoints use.

Each ggml type stores a tensor as a flat run of fixed-size *blocks*; a block holds `block_size`
consecutive elements of a row (32 for the legacy types, 256 for the k-quants) as small integers
plus one or more float16 scales. The functions below take `(n_blocks, type_size)` uint8 views and
return `(n_blocks, block_size)` float32, doing the same float32 arithmetic in the same order as
`gguf.quants` (numpy, the reference), so results are bit-identical to it.

Types without a torch version here fall back to `gguf.quants.dequantize` (slow, numpy).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from tokenloom.errors import ModelLoadError

Q = GGMLQuantizationType
BlockFn = Callable[[torch.Tensor], torch.Tensor]

# Elements dequantized per step, whatever the tensor size: the float32 temporaries (~4 MB) stay in cache
# (docs/performance-notes.md#gguf-loading).
_CHUNK_ELEMENTS = 1 << 20

_NIBBLE_SHIFTS = torch.tensor([0, 4], dtype=torch.uint8)
_CRUMB_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)  # four 2-bit fields per byte
_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(n, 2) uint8 little-endian float16 bytes -> (n, 1) float32."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, k) bytes -> (n, 2, k): low nibbles first, then high nibbles (ggml's order in a block)."""
    return (qs.unsqueeze(-2) >> _NIBBLE_SHIFTS.view(2, 1)) & 0x0F


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """(n, k) bytes -> (n, k * 8) bits, bit j of byte i at index i * 8 + j (a little-endian bitfield)."""
    return ((qh.unsqueeze(-1) >> _BIT_SHIFTS) & 1).flatten(-2)


# --- legacy types: 32 elements per block ---------------------------------------------------------


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    # 34 bytes: d f16 | qs int8[32];  y = q * d
    return b[:, 2:].view(torch.int8).float() * _f16(b[:, :2])


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    # 18 bytes: d f16 | qs[16], element j in the low nibble of qs[j], element j+16 in the high one;
    # y = d * (q - 8)
    q = _nibbles(b[:, 2:]).flatten(-2).to(torch.int8) - 8
    return _f16(b[:, :2]) * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    # 20 bytes: d f16 | m f16 | qs[16] (nibbles as Q4_0);  y = d * q + m
    q = _nibbles(b[:, 4:]).flatten(-2).float()
    return _f16(b[:, :2]) * q + _f16(b[:, 2:4])


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    # 22 bytes: d f16 | qh u32 (bit j = 5th bit of element j) | qs[16] (low 4 bits as Q4_0);
    # y = d * (q - 16)
    q = _nibbles(b[:, 6:]).flatten(-2) | (_bits(b[:, 2:6]) << 4)
    return _f16(b[:, :2]) * (q.to(torch.int8) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    # 24 bytes: d f16 | m f16 | qh u32 | qs[16];  y = d * q + m
    q = _nibbles(b[:, 8:]).flatten(-2) | (_bits(b[:, 4:8]) << 4)
    return _f16(b[:, :2]) * q.float() + _f16(b[:, 2:4])


# --- k-quants: 256 elements per block, in sub-blocks with their own 4- to 8-bit scales ------------


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    # 84 bytes: scales[16] (low nibble scale, high nibble min, one per 16 elements) | qs[64] (2-bit)
    #           | d f16 | dmin f16;  y = d * sc * q - dmin * m
    n = b.shape[0]
    scales = b[:, :16]
    dl = (_f16(b[:, 80:82]) * (scales & 0x0F).float()).view(n, 16, 1)
    ml = (_f16(b[:, 82:84]) * (scales >> 4).float()).view(n, 16, 1)
    # qs: two 32-byte groups, each byte carrying four 2-bit elements 32 apart -> (n, 2, 4, 32)
    q = (b[:, 16:80].reshape(n, 2, 1, 32) >> _CRUMB_SHIFTS.view(4, 1)) & 3
    return (dl * q.reshape(n, 16, 16).float() - ml).reshape(n, 256)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    # 110 bytes: hmask[32] (3rd bit, inverted) | qs[64] (low 2 bits) | scales[12] (16 x 6-bit) | d f16
    # y = d * (sc - 32) * (q_low - 4 * !hbit)
    n = b.shape[0]
    hmask, qs, scales = b[:, :32], b[:, 32:96], b[:, 96:108]
    d = _f16(b[:, 108:110])
    # Scale j: low 4 bits from nibble (j % 8 byte, j // 8 half) of bytes 0-7, high 2 bits from
    # 2-bit field j // 4 of byte 8 + j % 4.
    low = (scales[:, :8].reshape(n, 1, 8) >> _NIBBLE_SHIFTS.view(2, 1)).reshape(n, 16)
    high = (scales[:, 8:].reshape(n, 1, 4) >> _CRUMB_SHIFTS.view(4, 1)).reshape(n, 16)
    sc = ((low & 0x0F) | ((high & 0x03) << 4)).to(torch.int8) - 32
    dl = (d * sc.float()).view(n, 16, 1)
    ql = ((qs.reshape(n, 2, 1, 32) >> _CRUMB_SHIFTS.view(4, 1)) & 3).reshape(n, 16, 16)
    qh = ((hmask.reshape(n, 1, 1, 32) >> _BIT_SHIFTS.view(8, 1)) & 1).reshape(n, 16, 16) ^ 1
    q = ql.to(torch.int8) - (qh << 2).to(torch.int8)
    return (dl * q.float()).reshape(n, 256)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins, each (n, 8) uint8.

    Bytes 0-3: scales 0-3 (low 6 bits) + high 2 bits of scales 4-7; bytes 4-7: the same for mins;
    bytes 8-11: low nibble = low 4 bits of scale 4+i, high nibble = low 4 bits of min 4+i.
    """
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    # 144 bytes: d f16 | dmin f16 | scales[12] | qs[128]; 8 sub-blocks of 32, each 32-byte run of qs
    # holds sub-block 2i in its low nibbles and 2i+1 in its high ones;  y = d * sc * q - dmin * m
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (_f16(b[:, 0:2]) * sc.float()).view(n, 8, 1)
    dm = (_f16(b[:, 2:4]) * mn.float()).view(n, 8, 1)
    q = _nibbles(b[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32).float()
    return (d * q - dm).reshape(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    # 176 bytes: d f16 | dmin f16 | scales[12] | qh[32] (bit i of qh[j] = 5th bit of sub-block i,
    # element j) | qs[128] (as Q4_K);  y = d * sc * q - dmin * m
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (_f16(b[:, 0:2]) * sc.float()).view(n, 8, 1)
    dm = (_f16(b[:, 2:4]) * mn.float()).view(n, 8, 1)
    ql = _nibbles(b[:, 48:].reshape(n, 4, 32)).reshape(n, 8, 32)
    qh = (b[:, 16:48].reshape(n, 1, 32) >> _BIT_SHIFTS.view(8, 1)) & 1
    q = (ql | (qh << 4)).float()
    return (d * q - dm).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    # 210 bytes: ql[128] (low 4 bits) | qh[64] (high 2 bits) | scales int8[16] | d f16;
    # y = d * sc * (q - 32), one scale per 16 elements
    n = b.shape[0]
    d = (_f16(b[:, 208:210]) * b[:, 192:208].view(torch.int8).float()).view(n, 16, 1)
    # Two halves of 128 elements; in each, ql's 64 bytes give elements 0-63 (low nibbles) and
    # 64-127 (high nibbles), and qh's 32 bytes give 2 bits to each 32-element quarter.
    ql = _nibbles(b[:, :128].reshape(n, 2, 64)).reshape(n, 8, 32)
    qh = ((b[:, 128:192].reshape(n, 2, 1, 32) >> _CRUMB_SHIFTS.view(4, 1)) & 3).reshape(n, 8, 32)
    q = (ql | (qh << 4)).to(torch.int8) - 32
    return (d * q.reshape(n, 16, 16).float()).reshape(n, 256)


# --- plain floats: one element per "block" --------------------------------------------------------


def _f32(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32)


def _f16_block(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def _bf16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.bfloat16).float()


_TORCH_DEQUANT: dict[GGMLQuantizationType, BlockFn] = {
    Q.F32: _f32,
    Q.F16: _f16_block,
    Q.BF16: _bf16,
    Q.Q8_0: _q8_0,
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
    Q.Q2_K: _q2_k,
    Q.Q3_K: _q3_k,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
}


def has_torch_dequantizer(qtype: GGMLQuantizationType) -> bool:
    return qtype in _TORCH_DEQUANT


def dequantize(
    raw: np.ndarray | torch.Tensor,
    qtype: GGMLQuantizationType,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """GGUF tensor bytes -> a new `dtype` tensor of `shape` (torch order: GGUF dims reversed).

    `raw` is the tensor's bytes (any numpy dtype/shape is reinterpreted as bytes, e.g. what
    `GGUFReader` gives). Values are computed in float32 and then cast, chunk by chunk, so a
    bfloat16 load never holds the whole tensor in float32.
    """
    try:
        qtype = GGMLQuantizationType(qtype)
    except ValueError as e:
        raise ModelLoadError(f"unknown GGUF tensor type id {qtype!r}") from e
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_elements = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if n_elements % block_size:
        raise ModelLoadError(f"{qtype.name} tensor of shape {shape}: size is not a multiple of {block_size}")
    n_blocks = n_elements // block_size
    u8 = _as_bytes(raw)
    if u8.numel() != n_blocks * type_size:
        raise ModelLoadError(
            f"{qtype.name} tensor of shape {shape} needs {n_blocks * type_size} bytes, got {u8.numel()}"
        )
    fn = _TORCH_DEQUANT.get(qtype)
    if fn is None:
        return _numpy_fallback(u8, qtype, shape).to(dtype)
    blocks = u8.view(n_blocks, type_size)
    out = torch.empty(n_blocks, block_size, dtype=dtype)
    step = max(1, _CHUNK_ELEMENTS // block_size)
    for start in range(0, n_blocks, step):
        out[start : start + step] = fn(blocks[start : start + step]).view(-1, block_size)
    return out.view(shape)


def _as_bytes(raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over `raw`'s bytes, without a copy when `raw` is contiguous and writable."""
    if isinstance(raw, torch.Tensor):
        return raw.contiguous().view(-1).view(torch.uint8)
    arr = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if not arr.flags.writeable:
        # torch.from_numpy warns on read-only arrays (GGUFReader's memmap); we never write to it.
        arr = arr.copy()
    return torch.from_numpy(arr)


def _numpy_fallback(u8: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    try:
        values = gguf_quants.dequantize(u8.numpy(), qtype)
    except NotImplementedError as e:
        raise ModelLoadError(f"GGUF tensor type {qtype.name} cannot be dequantized (no implementation)") from e
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(shape)
