"""Per-sequence grammar state: which tokens may come next, advanced token by token.

One GrammarState per generated sequence (a request with n > 1 makes n of them with `GrammarState.new`,
or `fork`s one). The engine, each step: `fill_bitmask` -> bitmask.apply -> sample -> `accept`; a False
from accept fails the request. The grammar never allows a stop token before it is complete, and once it
is complete with nothing left to add, or a stop token was accepted, the mask allows only stop tokens and
`is_terminated` tells the engine to finish. `rollback` undoes accepted tokens (speculative decoding).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr

from tokenloom.structured.bitmask import int32_bit


class GrammarState:
    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._stops = tuple(stop_token_ids)
        self._steps = 0  # accepted tokens, the most `rollback` may undo
        self._after_end = 0  # stop tokens accepted after termination (xgrammar itself refuses them)
        self._terminated: bool | None = None  # is_terminated, cached until the state changes
        self._probe: torch.Tensor | None = None  # (1, ceil(vocab/32)) int32, for is_terminated

    @classmethod
    def new(cls, compiled: xgr.CompiledGrammar, stop_token_ids: Sequence[int] | None = None) -> GrammarState:
        """A fresh state at the grammar's start. Matchers are per sequence: make one for each of a request's
        n sequences. `stop_token_ids` replaces the engine's EOS ids as the tokens allowed at the end."""
        info = compiled.tokenizer_info
        stops = list(info.stop_token_ids if stop_token_ids is None else stop_token_ids)
        # No max_rollback_tokens: xgrammar 0.2.9 deprecated it, rollback is always unlimited.
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops)
        return cls(matcher, info.vocab_size, stops)

    def fork(self) -> GrammarState:
        """An independent copy of this state (same grammar, same tokens accepted so far)."""
        twin = GrammarState(self._matcher.fork(), self._vocab_size, self._stops)
        twin._steps, twin._after_end, twin._terminated = self._steps, self._after_end, self._terminated
        return twin

    @property
    def is_terminated(self) -> bool:
        """The output is finished: a stop token was accepted, or the grammar is complete and only a stop
        token may follow. The request should end now."""
        if self._terminated is None:
            self._terminated = self._matcher.is_terminated() or (
                self._matcher.is_completed() and self._only_stops_allowed()
            )
        return self._terminated

    @property
    def is_completed(self) -> bool:
        """The output so far is a complete match (a stop token is allowed now), though it may go on."""
        return self._matcher.is_terminated() or self._matcher.is_completed()

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar does not allow it."""
        if self._matcher.is_terminated():
            # The mask after termination allows stop tokens only; accept agrees with it.
            if token_id not in self._stops:
                return False
            self._after_end += 1
        elif not (0 <= token_id < self._vocab_size and self._matcher.accept_token(token_id)):
            return False  # out of range is checked here: xgrammar would log a warning for it
        self._steps += 1
        self._terminated = None
        return True

    def accept_many(self, token_ids: Sequence[int]) -> int:
        """Accept tokens in order up to the first one refused; returns how many were accepted."""
        for count, token_id in enumerate(token_ids):
            if not self.accept(token_id):
                return count
        return len(token_ids)

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens."""
        if not 0 <= n <= self._steps:
            raise ValueError(f"cannot roll back {n} tokens: {self._steps} were accepted")
        extra = min(n, self._after_end)
        self._after_end -= extra
        if n > extra:
            self._matcher.rollback(n - extra)
        self._steps -= n
        self._terminated = None

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] ((rows, ceil(vocab/32)) int32, on CPU)."""
        if self._matcher.is_terminated():
            _stops_only(bitmask, row, self._stops)  # xgrammar refuses to fill a mask after the stop token
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def _only_stops_allowed(self) -> bool:
        if self._probe is None:
            self._probe = xgr.allocate_token_bitmask(1, self._vocab_size)
        self._matcher.fill_next_token_bitmask(self._probe, 0)
        _clear_bits(self._probe, 0, self._stops)
        return not bool(self._probe.any())


def _stops_only(bitmask: torch.Tensor, row: int, stops: Sequence[int]) -> None:
    bitmask[row].zero_()
    for token_id in stops:
        if token_id < bitmask.shape[1] * 32:
            bitmask[row, token_id // 32] |= int32_bit(token_id % 32)


def _clear_bits(bitmask: torch.Tensor, row: int, token_ids: Sequence[int]) -> None:
    for token_id in token_ids:
        if token_id < bitmask.shape[1] * 32:
            bitmask[row, token_id // 32] &= ~int32_bit(token_id % 32)
