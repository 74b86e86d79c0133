"""The kernels' code layout (see kernels/csrc/quant_gemm.cpp): each row's K inputs, zero-padded to a
multiple of 64, in chunks of 64 whose position p holds input CHUNK_ORDER[p], so that a vdpbf16ps lane
pair never mixes two 32-input blocks. int8: one byte per position; int4: byte i (0..31) of a chunk
holds positions i (low nibble) and 32 + i (high nibble)."""

from __future__ import annotations

import torch

CHUNK = 64
# e(p) = 32 ((p >> 1) & 1) + 16 (p >> 5) + 2 ((p & 31) >> 2) + (p & 1), as chunk_input() in C++.
CHUNK_ORDER = torch.tensor([32 * ((p >> 1) & 1) + 16 * (p >> 5) + 2 * ((p & 31) >> 2) + (p & 1) for p in range(CHUNK)])
_INVERSE = torch.argsort(CHUNK_ORDER)


def padded(k: int) -> int:
    return -(-k // CHUNK) * CHUNK


def _to_positions(q: torch.Tensor) -> torch.Tensor:
    """(N, K) -> (N, Kp/64, 64) in kernel order, zero-padded."""
    n, k = q.shape
    kp = padded(k)
    if kp != k:
        q = torch.cat([q, q.new_zeros(n, kp - k)], dim=1)
    return q.reshape(n, kp // CHUNK, CHUNK)[..., CHUNK_ORDER]


def _from_positions(pos: torch.Tensor, k: int) -> torch.Tensor:
    """(N, Kp/64, 64) kernel order -> (N, K)."""
    n = pos.shape[0]
    return pos[..., _INVERSE].reshape(n, -1)[:, :k]


def int8_to_kernel(q: torch.Tensor) -> torch.Tensor:
    """(N, K) int8 -> (N, Kp) int8."""
    return _to_positions(q).reshape(q.shape[0], -1).contiguous()


def int8_from_kernel(codes: torch.Tensor, k: int) -> torch.Tensor:
    return _from_positions(codes.reshape(codes.shape[0], -1, CHUNK), k)


def int4_to_kernel(q: torch.Tensor) -> torch.Tensor:
    """(N, K) codes in [0, 15] -> (N, Kp/2) uint8."""
    pos = _to_positions(q.to(torch.uint8))
    return (pos[..., :32] | (pos[..., 32:] << 4)).reshape(q.shape[0], -1).contiguous()


def int4_from_kernel(codes: torch.Tensor, k: int) -> torch.Tensor:
    """(N, Kp/2) uint8 -> (N, K) uint8 codes in [0, 15]."""
    b = codes.reshape(codes.shape[0], -1, CHUNK // 2)
    return _from_positions(torch.cat([b & 0x0F, b >> 4], dim=-1), k)
