"""The kernels' code layout (see kernels/csrc/quant_gemm.cpp). Each row's K inputs are zero-padded to
Kp, a multiple of 64.

- int8 codes (N, Kp): per row, chunks of 64 whose position p holds input CHUNK_ORDERS[version][p], so
  that the four bytes a vpdpbusd lane sums never mix two 32-input blocks (version 2 onwards).
- int4 codes (N, Kp / 2), version 3: output channels in blocks of 16 (the last block may hold fewer,
  r), a block's bytes together. Within a block, step s (inputs 8s..8s+7) takes 4r bytes, byte 4j + c
  holding q[j][8s + c] | q[j][8s + 4 + c] << 4 for channel j of the block: one 64-byte load gives the
  16 channels' codes for 8 inputs, and vpdpbusd's int32 lane j is channel j. Their scales and mins
  (N, G) are blocked the same way: group t of a block is r consecutive values, one per channel.
  Versions 1 and 2 kept int4 rows apart (byte i of a row's chunk: positions i and 32 + i) with plain
  (N, G) scales.

LAYOUT_VERSION names the layout; quantized checkpoints record it, and those written with an older one
(1: the vdpbf16ps lane pairs of tokenloom before 2026-12-03; 2: int4 rows apart, through 2026-12-03)
are re-laid out on load."""

from __future__ import annotations

import torch

from tokenloom.kernels.limits import INT4_BLOCK, QUANT_CHUNK

CHUNK = QUANT_CHUNK  # inputs per chunk; rows are padded to whole chunks
BLOCK = INT4_BLOCK  # int4 output channels per block (version 3)
LAYOUT_VERSION = 3
# e(p) = 32 ((p >> 2) & 1) + 4 (p >> 3) + (p & 3), as chunk_input() in C++: lane j = positions 4j..4j+3
# holds four consecutive inputs of block j % 2.
_V2_ORDER = torch.tensor([32 * ((p >> 2) & 1) + 4 * (p >> 3) + (p & 3) for p in range(CHUNK)])
CHUNK_ORDERS = {
    1: torch.tensor([32 * ((p >> 1) & 1) + 16 * (p >> 5) + 2 * ((p & 31) >> 2) + (p & 1) for p in range(CHUNK)]),
    2: _V2_ORDER,
    3: _V2_ORDER,  # int8 as in version 2; version 3 changed int4 only
}
LAYOUT_VERSIONS = tuple(sorted(CHUNK_ORDERS))


def padded(k: int) -> int:
    return -(-k // CHUNK) * CHUNK


def _pad(q: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    kp = padded(k)
    return q if kp == k else torch.cat([q, q.new_zeros(n, kp - k)], dim=1)


def _to_positions(q: torch.Tensor, version: int) -> torch.Tensor:
    """(N, K) -> (N, Kp/64, 64) in chunk order, zero-padded."""
    qp = _pad(q)
    return qp.reshape(q.shape[0], -1, CHUNK)[..., CHUNK_ORDERS[version]]


def _from_positions(pos: torch.Tensor, k: int, version: int) -> torch.Tensor:
    """(N, Kp/64, 64) chunk order -> (N, K)."""
    n = pos.shape[0]
    return pos[..., torch.argsort(CHUNK_ORDERS[version])].reshape(n, -1)[:, :k]


def _blocks(n: int) -> list[tuple[int, int]]:
    """Spans (first channel, channels) of int4 blocks: all full blocks as one, then a partial one if any."""
    full = n // BLOCK * BLOCK
    return [(b, r) for b, r in ((0, full), (full, n - full)) if r]


def int8_to_kernel(q: torch.Tensor, version: int = LAYOUT_VERSION) -> torch.Tensor:
    """(N, K) int8 -> (N, Kp) int8."""
    return _to_positions(q, version).reshape(q.shape[0], -1).contiguous()


def int8_from_kernel(codes: torch.Tensor, k: int, version: int = LAYOUT_VERSION) -> torch.Tensor:
    return _from_positions(codes.reshape(codes.shape[0], -1, CHUNK), k, version)


def int4_to_kernel(q: torch.Tensor, version: int = LAYOUT_VERSION) -> torch.Tensor:
    """(N, K) codes in [0, 15] -> (N, Kp/2) uint8."""
    q = q.to(torch.uint8)
    n = q.shape[0]
    if version < 3:
        pos = _to_positions(q, version)
        return (pos[..., :32] | (pos[..., 32:] << 4)).reshape(n, -1).contiguous()
    qp = _pad(q)
    kp = qp.shape[1]
    out = []
    for b, rows in _blocks(n):
        r = min(rows, BLOCK)
        t = qp[b:b + rows].reshape(rows // r, r, kp // 8, 2, 4)  # (block, channel, step, low/high nibble, c)
        out.append((t[:, :, :, 0] | (t[:, :, :, 1] << 4)).permute(0, 2, 1, 3).reshape(-1))  # (block, step, channel, c)
    return torch.cat(out).reshape(n, kp // 2) if out else q.new_zeros(0, kp // 2)


def int4_from_kernel(codes: torch.Tensor, k: int, version: int = LAYOUT_VERSION) -> torch.Tensor:
    """(N, Kp/2) uint8 -> (N, K) uint8 codes in [0, 15]."""
    n = codes.shape[0]
    if version < 3:
        b = codes.reshape(n, -1, CHUNK // 2)
        return _from_positions(torch.cat([b & 0x0F, b >> 4], dim=-1), k, version)
    kp = codes.shape[1] * 2
    flat = codes.reshape(-1)
    out = []
    for b, rows in _blocks(n):
        r = min(rows, BLOCK)
        t = flat[b * kp // 2:(b + rows) * kp // 2].reshape(rows // r, kp // 8, r, 4).permute(0, 2, 1, 3)
        out.append(torch.stack([t & 0x0F, t >> 4], dim=3).reshape(rows, kp))  # (block, channel, step, nibble, c)
    return (torch.cat(out) if out else codes.new_zeros(0, kp))[:, :k]


def int4_scales_to_kernel(s: torch.Tensor) -> torch.Tensor:
    """(N, G) per-group scales or mins -> (N, G) in version 3's blocked order."""
    n, g = s.shape
    parts = [s[b:b + rows].reshape(-1, min(rows, BLOCK), g).transpose(1, 2).reshape(-1) for b, rows in _blocks(n)]
    return (torch.cat(parts) if parts else s.reshape(-1)).reshape(n, g).contiguous()


def int4_scales_from_kernel(s: torch.Tensor) -> torch.Tensor:
    """Inverse of int4_scales_to_kernel."""
    n, g = s.shape
    flat = s.reshape(-1)
    parts = [flat[b * g:(b + rows) * g].reshape(-1, g, min(rows, BLOCK)).transpose(1, 2).reshape(rows, g)
             for b, rows in _blocks(n)]
    return (torch.cat(parts) if parts else s).contiguous()


def relayout(codes: torch.Tensor, k: int, version: int) -> torch.Tensor:
    """Codes stored in layout `version` -> the current layout (int8 or int4 by dtype)."""
    if version == LAYOUT_VERSION:
        return codes
    if codes.dtype == torch.int8:
        return int8_to_kernel(int8_from_kernel(codes, k, version))
    return int4_to_kernel(int4_from_kernel(codes, k, version))


def relayout_int4_scales(s: torch.Tensor, version: int) -> torch.Tensor:
    """int4 scales or mins stored in layout `version` -> the current layout."""
    return s if version >= 3 else int4_scales_to_kernel(s)
