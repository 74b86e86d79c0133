"""Prompt lookup (n-gram) drafts: find the sequence's last n tokens earlier in its prompt or output and
propose the k tokens that followed them there. No model runs; it pays off when the output repeats its
context (quoting, editing, code, extraction)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tokenloom.engine.sequence import Sequence


class NgramProposer:
    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        self.max_n, self.min_n = max_n, min_n

    def propose(self, seqs: list[Sequence], ks: list[int]) -> None:
        """Up to ks[i] draft tokens for seqs[i] (fewer, or none, when no earlier match exists)."""
        for seq, k in zip(seqs, ks):
            seq.spec.token_ids = lookup(seq.token_ids, k, self.max_n, self.min_n)
            seq.spec.draft_probs = None


def lookup(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The tokens after the most recent earlier occurrence of the longest suffix n-gram
    (max_n down to min_n) of `tokens`."""
    if k <= 0 or len(tokens) < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, len(arr) - 1), min_n - 1, -1):
        suffix = arr[-n:]
        windows = sliding_window_view(arr[:-1], n)  # (len - n, n): every n-gram that has a successor
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the most recent earlier occurrence
            return arr[start : start + k].tolist()
    return []
