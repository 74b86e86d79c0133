"""A sequence's output constraint as the engine runs it: the grammar matcher plus the thinking phase.

The grammar engine (tokenloom/structured/) masks tokens and advances on each one. What this adds is when the
mask applies: a reasoning model thinks first, unconstrained, and the grammar starts after the end tag
(`StructuredOutput.think_end`). Phases:

  maybe_thinking -- first token only: the grammar's tokens, or the opening tag (`think_start`, one token)
  thinking       -- no mask; ends once the output ends with `think_end`
  active         -- the grammar's mask; every token advances the matcher
  done           -- the grammar is complete (the engine finishes the sequence)

Each sequence has its own (n > 1: one per completion). Requests with a constraint decode without drafts
(spec/verify.py `can_speculate`): a draft run would need a mask per position and a matcher rollback.
"""

from __future__ import annotations

from typing import Literal

import torch

from tokenloom.sampling_params import StructuredOutput
from tokenloom.structured import CompiledGrammar, GrammarState
from tokenloom.structured.bitmask import int32_bit

Phase = Literal["maybe_thinking", "thinking", "active", "done"]


class ConstraintViolation(RuntimeError):
    """A token the grammar does not allow was appended (the mask was not applied to it)."""


class SequenceConstraint:
    def __init__(self, spec: StructuredOutput, compiled: CompiledGrammar, stop_token_ids: list[int]) -> None:
        """`stop_token_ids`: the sequence's (EOS unless ignore_eos, and its stop_token_ids): the tokens the
        grammar allows once complete. Without any, the engine ends the sequence when the grammar is complete."""
        self.spec = spec
        self.state = GrammarState.new(compiled, stop_token_ids or None)
        self.phase: Phase = "active"
        if spec.think_end:
            self.phase = "thinking" if spec.starts_thinking else "maybe_thinking"
            if self.phase == "maybe_thinking" and len(spec.think_start) != 1:
                self.phase = "active"  # an opening tag of several tokens cannot be offered as one choice
        self._recent: list[int] = []  # the last len(think_end) output tokens, while thinking

    @property
    def masks(self) -> bool:
        """Whether this step's logits row gets a mask."""
        return self.phase in ("active", "maybe_thinking")

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write this step's allowed tokens into `bitmask[row]` ((rows, ceil(vocab / 32)) int32)."""
        self.state.fill_bitmask(bitmask, row)
        if self.phase == "maybe_thinking":  # the model may open its thinking instead
            tok = self.spec.think_start[0]
            bitmask[row, tok // 32] |= int32_bit(tok % 32)

    def append(self, token: int) -> bool:
        """Advance on a sampled token; True once the grammar is complete (the sequence should stop)."""
        if self.phase == "maybe_thinking":
            if token == self.spec.think_start[0]:
                self.phase = "thinking"
                return False
            self.phase = "active"
        if self.phase == "thinking":
            end = self.spec.think_end
            self._recent = (self._recent + [token])[-len(end):]
            if tuple(self._recent) == end:
                self.phase = "active"
            return False
        if self.phase == "done":
            return True
        if not self.state.accept(token):
            raise ConstraintViolation(f"token {token} is not allowed by the {self.spec.kind} constraint")
        if self.state.is_terminated:
            self.phase = "done"
            return True
        return False
