"""Maps sequences to KV blocks: grows a sequence's block table as its tokens are scheduled, frees it at the end."""

from __future__ import annotations

from tokenloom.engine.block_pool import BlockPool
from tokenloom.engine.sequence import Sequence


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra blocks `seq` needs to hold K/V for `num_new_tokens` more tokens."""
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_ids))

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow `seq`'s block table for `num_new_tokens`; False (nothing changed) if the pool is short."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > self.pool.num_free:
            return False
        if need:
            seq.block_ids.extend(self.pool.allocate(need))
        return True

    def free(self, seq: Sequence) -> None:
        # Free in reverse so a sequence's tail blocks are reused first (its head may be shared later).
        self.pool.free(list(reversed(seq.block_ids)))
        seq.block_ids = []

    @property
    def usage(self) -> float:
        return self.pool.usage
