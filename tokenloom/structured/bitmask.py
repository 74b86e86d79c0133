"""Token bitmasks: one int32 row per constrained sequence, bit j of the row set = token j allowed.

Bit j of a row lives in word j // 32 at bit j % 32 (xgrammar's layout). `apply` sets every disallowed
logit of the chosen rows to -inf in one batched call; columns of the logits that the bitmask does not
cover (a model whose lm_head is wider than the mask) count as disallowed.
"""

from __future__ import annotations

from types import ModuleType

import torch
import xgrammar as xgr

_CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what xgrammar's CPU kernel takes


def int32_bit(position: int) -> int:
    """1 << position as an int32 value (bit 31 is the sign bit), to set or clear one token's bit in a word."""
    value = 1 << position
    return value - (1 << 32) if value >= 1 << 31 else value


def allocate(rows: int, vocab_size: int) -> torch.Tensor:
    """A bitmask that allows everything: (rows, ceil(vocab_size/32)) int32 on CPU (where matchers fill it)."""
    if rows < 0 or vocab_size < 1:
        raise ValueError(f"a bitmask needs rows >= 0 and vocab_size >= 1, got {rows}, {vocab_size}")
    return xgr.allocate_token_bitmask(rows, vocab_size)


def apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """Set logits[r, j] = -inf wherever bit j of bitmask[r] is 0, for r in `rows` (default: all rows).

    logits: (batch, V) float; bitmask: (>= max(rows)+1, W) int32. Bits past V are ignored; logits
    past W*32 are masked. Unlisted rows (unconstrained requests in the batch) are left alone."""
    rows = _check(logits, bitmask, rows)
    if not rows:
        return
    covered = min(logits.shape[1], bitmask.shape[1] * 32)
    kernels = _cpu_kernels()
    if (kernels is not None and logits.device.type == "cpu" and logits.dtype == torch.float32
            and logits.stride(1) == 1 and bitmask.device.type == "cpu" and bitmask.is_contiguous()
            and bitmask.shape[0] == logits.shape[0]):
        # tokenloom's kernel (csrc/elementwise.cpp): an AVX-512 masked store per 16 logits, rows in parallel;
        # several times faster than xgrammar's scalar loop on a 49k vocabulary.
        kernels.apply_token_bitmask(logits, bitmask, torch.tensor(rows, dtype=torch.long))
        return
    if logits.device.type == "cpu" and logits.dtype in _CPU_DTYPES and bitmask.device.type == "cpu":
        # xgrammar's C++ kernel: one pass over the listed rows, bitmask row r masks logits row r.
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=covered, indices=rows)
    else:
        # GPU logits (the mask is filled on CPU, one small copy) or an odd dtype: the torch version.
        apply_reference(logits, bitmask.to(logits.device, non_blocking=True), rows)
        return
    if covered < logits.shape[1]:
        logits[rows, covered:] = float("-inf")


def _cpu_kernels() -> ModuleType | None:
    from tokenloom.kernels import load_cpu_kernels

    mod = load_cpu_kernels()
    return mod if mod is not None and hasattr(mod, "apply_token_bitmask") else None


def apply_xgrammar(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """`apply` through xgrammar's own CPU kernel (the route when tokenloom's kernels are not built)."""
    rows = _check(logits, bitmask, rows)
    if not rows:
        return
    covered = min(logits.shape[1], bitmask.shape[1] * 32)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=covered, indices=rows)
    if covered < logits.shape[1]:
        logits[rows, covered:] = float("-inf")


def apply_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """The same as `apply` in plain torch ops (any device): unpack the bits with shifts, masked_fill."""
    rows = _check(logits, bitmask, rows)
    if not rows:
        return
    vocab = logits.shape[1]
    index = torch.tensor(rows, device=logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    words = bitmask[index.to(bitmask.device)]  # (r, W) int32
    bits = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()  # (r, W*32): arithmetic shift, & 1 keeps one bit
    allowed = torch.zeros(len(rows), vocab, dtype=torch.bool, device=logits.device)  # uncovered columns: masked
    width = min(vocab, bits.shape[1])
    allowed[:, :width] = bits[:, :width].to(logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None) -> list[int]:
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError(f"logits and bitmask must be 2-D, got {tuple(logits.shape)} and {tuple(bitmask.shape)}")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"the bitmask must be int32, got {bitmask.dtype}")
    rows = list(range(logits.shape[0])) if rows is None else list(rows)
    limit = min(logits.shape[0], bitmask.shape[0])
    bad = [r for r in rows if not 0 <= r < limit]
    if bad:
        raise ValueError(f"rows {bad} out of range for logits {tuple(logits.shape)} and bitmask {tuple(bitmask.shape)}")
    if len(set(rows)) != len(rows):
        raise ValueError(f"rows must be unique, got {rows}")
    return rows
