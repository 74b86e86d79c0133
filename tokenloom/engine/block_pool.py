"""The pool of fixed-size KV blocks: a free list and per-block reference counts.

Invariant (checked by `check_invariants`): free + used == total, a block is free iff its count is 0.
Blocks are handed out in FIFO order of freeing, so recently freed blocks are reused last (this is the
eviction order prefix caching builds on).
"""

from __future__ import annotations

from collections import deque

from tokenloom.errors import TokenloomError


class NoFreeBlocks(TokenloomError):
    """Raised by `allocate` when the pool cannot satisfy a request; callers check `num_free` first."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocks(f"asked for {n} blocks, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        for b in ids:
            self.ref_counts[b] = 1
        return ids

    def incref(self, block_ids: list[int]) -> None:
        for b in block_ids:
            if self.ref_counts[b] == 0:
                raise ValueError(f"block {b} is free; it cannot be shared")
            self.ref_counts[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks nobody references return to the free list."""
        for b in block_ids:
            if self.ref_counts[b] <= 0:
                raise ValueError(f"block {b} freed twice")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)

    def check_invariants(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block appears twice in the free list")
        zero = {b for b, c in enumerate(self.ref_counts) if c == 0}
        if zero != free:
            raise AssertionError(f"free list {sorted(free)[:8]} != zero-ref blocks {sorted(zero)[:8]}")
        if any(c < 0 for c in self.ref_counts):
            raise AssertionError("negative reference count")
        if self.num_free + self.num_used != self.num_blocks:
            raise AssertionError("free + used != total")
