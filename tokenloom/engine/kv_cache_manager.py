"""Maps sequences to KV blocks: grows a sequence's block table as its tokens are scheduled, frees it at
the end, and (with prefix caching) shares full blocks between requests with the same prefix.

A full block is named by a chained hash, hash(parent block's hash, the block's token ids), so equal
hashes mean equal prefixes up to and including that block (the pool confirms every hit against the
stored tokens). A new sequence starts computing at its first uncached token; at least its last token is
always computed, because its logits are needed to sample.

KV groups (engine/kv_cache.py): a model whose windowed layers release blocks has one block table per group
and sequence, all drawn from the one pool. A windowed group's query at position p reads keys p - window + 1
.. p, and the next step's first query sits at num_computed_tokens, so after each step every block wholly
before num_computed_tokens - window + 1 leaves the group's table (`release`): back to the pool, cached
(evictable) where the prefix cache indexed it, its table entry NULL_BLOCK. Draft rows of a speculative
verification and the tokens of a prefill chunk all sit at or after num_computed_tokens, so none reaches
a released block. Prefix caching stays conservative: a hit is as long as the prefix whose blocks every
group still has cached, so it holds every group's K/V for the tokens that follow; the windowed groups
take only the hit's blocks inside their window.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass

from tokenloom.engine.block_pool import NO_PARENT, BlockPool
from tokenloom.engine.sequence import Sequence

HashFn = Callable[[int | None, tuple[int, ...]], int]

NULL_BLOCK = -1  # a released table entry: attention never reads it unmasked (build_step points it at block 0)


_ROOT = 0x746F6B656E6C6F6F  # the first block's "parent": an int, never None (see below)


def hash_block(parent_hash: int | None, tokens: tuple[int, ...]) -> int:
    # Python's hash of a tuple of ints is deterministic (no per-process salt), 64 bits, so two worker
    # processes agree on it (disaggregated prefill/decode sends blocks under these hashes). hash(None)
    # is not: before Python 3.12 it derives from None's address, hence the integer root. Hits are
    # verified against the tokens anyway, so a collision costs a recomputation, not correctness.
    return hash((_ROOT if parent_hash is None else parent_hash, tokens))


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up at admission
    hits: int = 0  # of those, tokens whose K/V came from the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(frozen=True)
class PrefixHit:
    """A cached prefix found at admission: its blocks in each KV group, the same count in every group."""

    blocks: list[list[int]]  # (groups, num_blocks)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks[0])


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_fn: HashFn = hash_block, windows: Seq[int | None] = (None,)) -> None:
        """`windows`: each KV group's window (None: full attention, the group keeps every block)."""
        if not windows:
            raise ValueError("a KV cache manager needs at least one KV group")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.windows = tuple(windows)
        self.stats = PrefixCacheStats()
        self.num_released = 0  # blocks windowed groups gave back since start

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra blocks `seq` needs (over all groups) to hold K/V for `num_new_tokens` more tokens."""
        want = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return sum(max(0, want - len(t)) for t in self._tables(seq))

    # -- admission ----------------------------------------------------------------------------

    def find_cached_prefix(self, seq: Sequence) -> PrefixHit:
        """Blocks holding the longest cached prefix of `seq`'s tokens in every group (full blocks only,
        leaving at least one token to compute). Changes nothing; pass the result to `allocate_slots`."""
        hits: list[list[int]] = [[] for _ in self.windows]
        if not self.enable_prefix_caching or any(self._tables(seq)):
            return PrefixHit(hits)
        limit = (seq.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(seq, limit)
        for i in range(limit):
            tokens = self._tokens(seq, i)
            found = [self.pool.lookup(hashes[i], tokens, h[-1] if h else NO_PARENT, g) for g, h in enumerate(hits)]
            if any(b is None for b in found):
                break
            for h, b in zip(hits, found):
                h.append(b)  # type: ignore[arg-type]  # none is None here
        return PrefixHit(hits)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached: PrefixHit | None = None) -> bool:
        """Grow `seq`'s block tables for `num_new_tokens`; False (nothing changed) if the pool is short.

        `cached` (admission only, from `find_cached_prefix`): blocks the sequence takes instead of
        computing; it then starts at cached.num_blocks * block_size and `num_new_tokens` count from there."""
        tables = self._tables(seq)
        if cached is None:
            need = self.blocks_needed(seq, num_new_tokens)
            if need > self.pool.num_free:
                return False
            want = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
            for t in tables:
                if want > len(t):
                    t.extend(self.pool.allocate(want - len(t)))
            return True
        if any(tables) or seq.num_computed_tokens:
            raise ValueError(f"{seq.seq_id}: cached blocks can only be taken by a sequence that holds none")
        hit = cached.num_blocks
        start = hit * self.block_size
        need = (-(-(start + num_new_tokens) // self.block_size) - hit) * self.num_groups
        # A windowed group takes only the hit's blocks its next queries reach; the others stay cached.
        gone = [self._releasable(g, start, hit) for g in range(self.num_groups)]
        take = [blocks[r:] for blocks, r in zip(cached.blocks, gone)]
        # Taking a cached block that nobody references removes it from what `allocate` may evict.
        reclaimed = sum(1 for blocks in take for b in blocks if self.pool.is_evictable(b))
        if need > self.pool.num_free - reclaimed:
            return False
        for g, blocks in enumerate(take):
            self.pool.incref(blocks)
            tables[g][:] = [NULL_BLOCK] * gone[g] + blocks + self.pool.allocate(need // self.num_groups)
            seq.num_released[g] = gone[g]
        seq.num_computed_tokens = start
        seq.num_cached_blocks = hit
        if seq.num_cached_tokens is None:  # the first admission; a preempted one's return is not a query
            seq.num_cached_tokens = start
            if self.enable_prefix_caching:
                self.stats.queries += seq.num_tokens
                self.stats.hits += start
        return True

    # -- after a step -------------------------------------------------------------------------

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Index the blocks `seq` has filled since the last call (their K/V is now written). A block
        whose content is already cached elsewhere is swapped for that one and returned to the pool."""
        if not self.enable_prefix_caching:
            return
        tables = self._tables(seq)
        full = min(seq.num_computed_tokens // self.block_size, min(len(t) for t in tables))
        if full <= seq.num_cached_blocks:
            return
        hashes = self._block_hashes(seq, full)
        for g, table in enumerate(tables):
            for i in range(seq.num_cached_blocks, full):
                parent = table[i - 1] if i else NO_PARENT
                mine = table[i]
                if mine == NULL_BLOCK or (i and parent == NULL_BLOCK):
                    continue  # released before it was indexed (`_releasable` keeps the parent: not reached)
                canonical = self.pool.cache(mine, hashes[i], self._tokens(seq, i), parent, g)
                if canonical != mine:  # same K/V already cached: share it, free our copy
                    self.pool.incref([canonical])
                    self.pool.free([mine])
                    table[i] = canonical
        seq.num_cached_blocks = full

    def release(self, seq: Sequence) -> None:
        """Give back the windowed groups' blocks that no query of `seq` reaches any more (call after a
        step's `cache_full_blocks`, so a released block stays findable in the prefix cache)."""
        tables = self._tables(seq)
        for g, table in enumerate(tables):
            r = self._releasable(g, seq.num_computed_tokens, seq.num_cached_blocks)
            done = seq.num_released[g]
            if r <= done:
                continue
            self.pool.free(table[done:r])  # oldest first: evicted first
            table[done:r] = [NULL_BLOCK] * (r - done)
            seq.num_released[g] = r
            self.num_released += r - done

    def _releasable(self, g: int, num_computed: int, num_cached_blocks: int) -> int:
        """How many of group g's first blocks lie wholly before num_computed - window + 1 (0 for a full
        group). With prefix caching, the last indexed block stays: it is the parent the next block is
        cached under (this binds only for a window shorter than a block)."""
        w = self.windows[g]
        if w is None:
            return 0
        r = max(0, num_computed - w + 1) // self.block_size
        if self.enable_prefix_caching:
            r = min(r, max(0, num_cached_blocks - 1))
        return r

    def trim(self, seq: Sequence) -> None:
        """Return blocks past the ones `seq`'s tokens need (slots of rejected draft tokens). They lie
        beyond its computed tokens, so they are its own and were never indexed in the cache."""
        keep = -(-seq.num_tokens // self.block_size)
        for table in self._tables(seq):
            if len(table) > keep:
                self.pool.free(list(reversed(table[keep:])))
                del table[keep:]

    def free(self, seq: Sequence) -> None:
        # Free in reverse so a sequence's tail blocks are evicted first: its head is the part most
        # likely to be shared by a later request.
        for table in self._tables(seq):
            self.pool.free([b for b in reversed(table) if b != NULL_BLOCK])
        seq.block_tables = [[] for _ in self.windows]
        seq.num_released = [0] * self.num_groups
        seq.num_cached_blocks = 0

    def held_blocks(self, seq: Sequence) -> list[int]:
        """The blocks `seq` references now, per group (released entries left out)."""
        return [sum(1 for b in t if b != NULL_BLOCK) for t in self._tables(seq)]

    def reset_prefix_cache(self) -> int:
        return self.pool.clear_cache()

    @property
    def usage(self) -> float:
        return self.pool.usage

    def _tables(self, seq: Sequence) -> list[list[int]]:
        """`seq`'s block tables, one per group (a new sequence starts with one empty table)."""
        if len(seq.block_tables) != self.num_groups:
            if any(seq.block_tables):
                raise ValueError(f"{seq.seq_id} holds {len(seq.block_tables)} block tables, not {self.num_groups}")
            seq.block_tables = [[] for _ in self.windows]
            seq.num_released = [0] * self.num_groups
        return seq.block_tables

    # -- hashing ------------------------------------------------------------------------------

    def _tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])

    def _block_hashes(self, seq: Sequence, n: int) -> list[int]:
        """The chained hashes of `seq`'s first `n` full blocks, memoized on the sequence (its tokens
        only ever grow; a rollback trims `seq.block_hashes` itself)."""
        hashes = seq.block_hashes
        while len(hashes) < n:
            i = len(hashes)
            hashes.append(self.hash_fn(hashes[i - 1] if i else None, self._tokens(seq, i)))
        return hashes
