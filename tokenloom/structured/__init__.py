"""Structured outputs: grammars (JSON schema, regex, choice, EBNF) enforced on the logits via xgrammar.

GrammarBackend compiles a request's StructuredOutput once (cached, off the engine thread); GrammarState
follows one sequence through the grammar; `bitmask` turns the allowed tokens into -inf logits.
"""

from __future__ import annotations

from tokenloom.structured.backend import MAX_WHITESPACE, CompiledGrammar, GrammarBackend, GrammarStats
from tokenloom.structured.bitmask import allocate, apply, apply_reference
from tokenloom.structured.matcher import GrammarState
from tokenloom.structured.vocab import tokenizer_info

__all__ = [
    "MAX_WHITESPACE",
    "CompiledGrammar",
    "GrammarBackend",
    "GrammarState",
    "GrammarStats",
    "allocate",
    "apply",
    "apply_reference",
    "tokenizer_info",
]
