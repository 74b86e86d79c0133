"""xgrammar's view of the vocabulary, built from the `tokenizers` object (no transformers tokenizer).

xgrammar matches grammars against the *decoded* bytes of every token, so it must know how the tokenizer
spells bytes: ByteLevel BPE (GPT-2 style, "Ġ" = space) -> BYTE_LEVEL; sentencepiece style (Metaspace "▁",
"<0x0A>" byte pieces) -> BYTE_FALLBACK; anything else -> RAW. This mirrors
`xgrammar.TokenizerInfo.from_huggingface` for a fast tokenizer, reading the serialized decoder ourselves.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import xgrammar as xgr
from tokenizers import Tokenizer as HFTokenizer

from tokenloom.errors import ConfigError
from tokenloom.tokenizer import Tokenizer


def tokenizer_info(tokenizer: Tokenizer | HFTokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> xgr.TokenizerInfo:
    """`vocab_size` is the model's logits width (it may pad past the tokenizer's vocabulary, or drop some
    added tokens): the mask covers exactly that many ids. `eos_token_ids` are the only tokens the grammar
    allows once it is complete."""
    backend = tokenizer.backend if isinstance(tokenizer, Tokenizer) else tokenizer
    stops = [int(i) for i in eos_token_ids]
    if vocab_size < 1:
        raise ConfigError(f"vocab_size must be >= 1, got {vocab_size}")
    if not stops or not all(0 <= i < vocab_size for i in stops):
        raise ConfigError(f"eos_token_ids must be non-empty ids in [0, {vocab_size}), got {stops}")
    vocab: dict[str, int] = backend.get_vocab(with_added_tokens=True)
    encoded = [""] * vocab_size  # ordered by id; ids the tokenizer lacks (lm_head padding) stay empty
    for token, idx in vocab.items():
        if idx < vocab_size:
            encoded[idx] = token
    kind = _vocab_type(json.loads(backend.to_str()).get("decoder"), vocab)
    return xgr.TokenizerInfo(
        encoded, kind, vocab_size=vocab_size, stop_token_ids=stops,
        add_prefix_space=_adds_prefix_space(backend, kind),
    )


def _vocab_type(decoder: dict[str, Any] | None, vocab: dict[str, int]) -> xgr.VocabType:
    names = _decoder_names(decoder)
    if "ByteLevel" in names:
        return xgr.VocabType.BYTE_LEVEL
    # A vocabulary holding the byte pieces "<0x00>".."<0xFF>" is byte-fallback whatever its decoder says
    # (xgrammar's own tie-break: the vocabulary is decisive evidence of its encoding).
    byte_pieces = sum(f"<0x{b:02X}>" in vocab for b in range(256))
    if "ByteFallback" in names or "Metaspace" in names or byte_pieces >= 128:
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


def _decoder_names(decoder: dict[str, Any] | None) -> set[str]:
    """Every decoder type in a (possibly nested) `Sequence` decoder."""
    if not decoder:
        return set()
    names = {str(decoder.get("type"))}
    for child in decoder.get("decoders") or ():
        names |= _decoder_names(child)
    return names


def _adds_prefix_space(backend: HFTokenizer, kind: xgr.VocabType) -> bool:
    """Whether encoding prepends a space ("a" -> "▁a"): observed, not read from the config, since that
    runtime behavior is what grammar matching must agree with (as xgrammar detects it)."""
    if kind == xgr.VocabType.RAW:
        return False
    tokens = backend.encode("a", add_special_tokens=False).tokens
    prefix = "▁" if kind == xgr.VocabType.BYTE_FALLBACK else "Ġ"
    return bool(tokens) and tokens[0].startswith(prefix)
