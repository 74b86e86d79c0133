"""The kernels' code layout (see kernels/csrc/quant_gemm.cpp): each row's K inputs, zero-padded to a
multiple of 64, in chunks of 64 whose position p holds input CHUNK_ORDERS[LAYOUT_VERSION][p], so that
the four bytes a vpdpbusd lane sums never mix two 32-input blocks. int8: one byte per position; int4: byte i (0..31) of
a chunk holds positions i (low nibble) and 32 + i (high nibble).

LAYOUT_VERSION names the order; quantized checkpoints record it, and those written with an older
order (version 1, the vdpbf16ps lane pairs of tokenloom before 2026-12-03) are re-laid out on load."""

from __future__ import annotations

import torch

CHUNK = 64
LAYOUT_VERSION = 2
# e(p) = 32 ((p >> 2) & 1) + 4 (p >> 3) + (p & 3), as chunk_input() in C++: lane j = positions 4j..4j+3
# holds four consecutive inputs of block j % 2.
CHUNK_ORDERS = {
    1: torch.tensor([32 * ((p >> 1) & 1) + 16 * (p >> 5) + 2 * ((p & 31) >> 2) + (p & 1) for p in range(CHUNK)]),
    2: torch.tensor([32 * ((p >> 2) & 1) + 4 * (p >> 3) + (p & 3) for p in range(CHUNK)]),
}


def padded(k: int) -> int:
    return -(-k // CHUNK) * CHUNK


def _to_positions(q: torch.Tensor, version: int = LAYOUT_VERSION) -> torch.Tensor:
    """(N, K) -> (N, Kp/64, 64) in kernel order, zero-padded."""
    n, k = q.shape
    kp = padded(k)
    if kp != k:
        q = torch.cat([q, q.new_zeros(n, kp - k)], dim=1)
    return q.reshape(n, kp // CHUNK, CHUNK)[..., CHUNK_ORDERS[version]]


def _from_positions(pos: torch.Tensor, k: int, version: int = LAYOUT_VERSION) -> torch.Tensor:
    """(N, Kp/64, 64) kernel order -> (N, K)."""
    n = pos.shape[0]
    return pos[..., torch.argsort(CHUNK_ORDERS[version])].reshape(n, -1)[:, :k]


def int8_to_kernel(q: torch.Tensor, version: int = LAYOUT_VERSION) -> torch.Tensor:
    """(N, K) int8 -> (N, Kp) int8."""
    return _to_positions(q, version).reshape(q.shape[0], -1).contiguous()


def int8_from_kernel(codes: torch.Tensor, k: int, version: int = LAYOUT_VERSION) -> torch.Tensor:
    return _from_positions(codes.reshape(codes.shape[0], -1, CHUNK), k, version)


def int4_to_kernel(q: torch.Tensor, version: int = LAYOUT_VERSION) -> torch.Tensor:
    """(N, K) codes in [0, 15] -> (N, Kp/2) uint8."""
    pos = _to_positions(q.to(torch.uint8), version)
    return (pos[..., :32] | (pos[..., 32:] << 4)).reshape(q.shape[0], -1).contiguous()


def int4_from_kernel(codes: torch.Tensor, k: int, version: int = LAYOUT_VERSION) -> torch.Tensor:
    """(N, Kp/2) uint8 -> (N, K) uint8 codes in [0, 15]."""
    b = codes.reshape(codes.shape[0], -1, CHUNK // 2)
    return _from_positions(torch.cat([b & 0x0F, b >> 4], dim=-1), k, version)


def relayout(codes: torch.Tensor, k: int, version: int) -> torch.Tensor:
    """Codes stored in layout `version` -> the current layout (int8 or int4 by dtype)."""
    if version == LAYOUT_VERSION:
        return codes
    if codes.dtype == torch.int8:
        return int8_to_kernel(int8_from_kernel(codes, k, version))
    return int4_to_kernel(int4_from_kernel(codes, k, version))
