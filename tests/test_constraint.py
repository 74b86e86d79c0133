"""engine/constraint.py: when a sequence's grammar masks tokens (the thinking phase of reasoning models),
and that it advances, refuses and completes as the engine needs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import build_tokenizer
from tokenloom.engine.constraint import ConstraintViolation, SequenceConstraint
from tokenloom.sampling_params import StructuredOutput
from tokenloom.structured import GrammarBackend, allocate
from tokenloom.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder: Path = tmp_path_factory.mktemp("constraint-tok")
    build_tokenizer(folder)
    return Tokenizer.from_hf_folder(folder)


@pytest.fixture(scope="module")
def backend(tok: Tokenizer) -> GrammarBackend:
    return GrammarBackend(tok, tok.vocab_size, tok.stop_token_ids)


def allowed(c: SequenceConstraint, vocab: int) -> set[int]:
    mask = allocate(1, vocab)
    c.fill(mask, 0)
    return {t for t in range(vocab) if (int(mask[0, t // 32]) >> (t % 32)) & 1}


def feed(c: SequenceConstraint, ids: list[int]) -> bool:
    done = False
    for t in ids:
        done = c.append(t)
    return done


def test_choice_masks_advances_and_completes(tok: Tokenizer, backend: GrammarBackend) -> None:
    spec = StructuredOutput("choice", choices=("yes", "no"))
    c = SequenceConstraint(spec, backend.compile(spec), list(tok.stop_token_ids))
    assert c.masks and c.phase == "active"
    first = allowed(c, tok.vocab_size)
    assert first and first < set(range(tok.vocab_size))  # a real mask: some tokens, not all
    ids = tok.encode("no", add_special_tokens=False)
    assert ids[0] in first
    assert feed(c, ids) and c.phase == "done"  # complete: the engine stops without sampling EOS


def test_a_token_outside_the_grammar_is_refused(tok: Tokenizer, backend: GrammarBackend) -> None:
    spec = StructuredOutput("regex", "[0-9]+")
    c = SequenceConstraint(spec, backend.compile(spec), list(tok.stop_token_ids))
    letter = tok.encode("a", add_special_tokens=False)[0]
    with pytest.raises(ConstraintViolation):
        c.append(letter)


def test_thinking_comes_first_then_the_grammar(tok: Tokenizer, backend: GrammarBackend) -> None:
    """A reasoning model that may open its thinking: the first step allows the opening tag beside the
    grammar's tokens; inside the thinking nothing is masked; after the closing tag the grammar applies."""
    start, end = (tok.encode("<|im_start|>", add_special_tokens=False), tok.encode(" over the lazy dog",
                                                                                 add_special_tokens=False))
    assert len(start) == 1 and len(end) > 1  # a one-token opener, a several-token closer
    spec = StructuredOutput("regex", "[0-9]+", think_start=tuple(start), think_end=tuple(end))
    c = SequenceConstraint(spec, backend.compile(spec), list(tok.stop_token_ids))
    assert c.phase == "maybe_thinking" and c.masks
    assert start[0] in allowed(c, tok.vocab_size)
    c.append(start[0])
    assert c.phase == "thinking" and not c.masks
    chatter = tok.encode("The quick brown fox jumps", add_special_tokens=False)
    assert not feed(c, chatter) and c.phase == "thinking"  # anything goes while thinking
    assert not feed(c, end) and c.phase == "active" and c.masks
    digit = tok.encode("1", add_special_tokens=False)
    assert not feed(c, digit)
    with pytest.raises(ConstraintViolation):
        c.append(chatter[0])


def test_output_that_does_not_think_is_constrained_from_its_first_token(tok: Tokenizer,
                                                                        backend: GrammarBackend) -> None:
    start = tok.encode("<|im_start|>", add_special_tokens=False)
    end = tok.encode(" dog", add_special_tokens=False)
    spec = StructuredOutput("regex", "[0-9]+", think_start=tuple(start), think_end=tuple(end))
    c = SequenceConstraint(spec, backend.compile(spec), list(tok.stop_token_ids))
    c.append(tok.encode("7", add_special_tokens=False)[0])  # no opening tag: the grammar took the token
    assert c.phase == "active"
    inside = SequenceConstraint(StructuredOutput("regex", "[0-9]+", think_end=tuple(end), starts_thinking=True),
                                backend.compile(spec), list(tok.stop_token_ids))
    assert inside.phase == "thinking" and not inside.masks  # the prompt opened the thinking


def test_n_sequences_have_their_own_matchers(tok: Tokenizer, backend: GrammarBackend) -> None:
    spec = StructuredOutput("choice", choices=("yes", "no"))
    compiled = backend.compile(spec)
    a = SequenceConstraint(spec, compiled, list(tok.stop_token_ids))
    b = SequenceConstraint(spec, compiled, list(tok.stop_token_ids))
    feed(a, tok.encode("yes", add_special_tokens=False))
    assert a.phase == "done" and b.phase == "active"
    assert torch.equal(torch.tensor(sorted(allowed(b, tok.vocab_size))),
                       torch.tensor(sorted(allowed(SequenceConstraint(spec, compiled, []), tok.vocab_size))))
