"""The tokenizer of a GGUF file, rebuilt from its metadata with the `tokenizers` library.

Rebuilt the way transformers' GGUF converter does (integrations/gguf/gguf_tokenizer_mapping.py with
GPT2Tokenizer / LlamaTokenizer), so ids, decoding and special-token handling agree with it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gguf import TokenType
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from tokenloom.errors import ModelLoadError, UnsupportedArchitecture
from tokenloom.models.gguf_file import GGUFFile
from tokenloom.tokenizer import Tokenizer


# `tokenizer.ggml.pre` -> the split regex its merges were learned with. Other values (e.g. "smollm",
# "default", "gpt2") keep GPT-2's own ByteLevel regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: dict[str, str] = {
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano", "dbrx", "smaug-bpe"],
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"], _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GPT4O_SPLIT),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the alphabet byte-level BPE vocabularies are spelled in)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_CHARS = _bytes_to_unicode()
_BYTE_ALPHABET = frozenset(_BYTE_CHARS.values())


# Gemma's official chat template (google/gemma-3 tokenizer_config.json): the roles alternate user / model, a
# system prompt is folded into the first user turn. Used when a Gemma GGUF carries no tokenizer.chat_template.
GEMMA_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
# The end-of-turn token llama.cpp finds by its text (as EOT) in Gemma vocabularies, whose files name no eot id.
GEMMA_END_OF_TURN = "<end_of_turn>"


def tokenizer_from_gguf(f: GGUFFile) -> Tokenizer:
    md = f.metadata
    gemma = md.get("general.architecture") in GEMMA_ARCHITECTURES
    kind = md.get("tokenizer.ggml.model")
    tokens: list[str] | None = md.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"{f.path}: GGUF has no tokenizer (tokenizer.ggml.tokens)")
    merges = [_split_merge(m) for m in md.get("tokenizer.ggml.merges", ())]
    if kind == "gpt2":
        backend = _byte_level_bpe(tokens, merges, md.get("tokenizer.ggml.pre"))
    elif kind == "llama" and gemma:
        backend = _gemma_bpe(tokens, merges)
    elif kind == "llama":
        if not merges:  # llama.cpp writes scores, not merges, for sentencepiece vocabularies
            merges = _merges_from_scores(tokens, _scores(md, len(tokens)))
        backend = _sentencepiece_bpe(tokens, merges)
    else:
        raise UnsupportedArchitecture(f"unsupported GGUF tokenizer model {kind!r}; tokenloom reads gpt2, llama")

    def special(k: str) -> str | None:
        i = md.get(f"tokenizer.ggml.{k}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos = special("bos"), special("eos")
    _add_special_tokens(backend, tokens, md.get("tokenizer.ggml.token_type"), kind == "gpt2",
                        [t for t in (special("unknown"), bos, eos, special("padding")) if t is not None])
    # llama.cpp prepends BOS to a sentencepiece vocabulary unless the file says otherwise.
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", kind == "llama")) and bos is not None
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    backend.post_processor = _template(backend, bos if add_bos else None, eos if add_eos else None)
    eos_id = md.get("tokenizer.ggml.eos_token_id")
    extra = [md.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    if gemma:  # a model turn ends with <end_of_turn>, which llama.cpp stops on (its EOT)
        extra.append(backend.token_to_id(GEMMA_END_OF_TURN))
    template = md.get("tokenizer.chat_template") or (GEMMA_CHAT_TEMPLATE if gemma else None)
    return Tokenizer(
        backend=backend,
        bos_token=bos,
        eos_token=eos,
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in extra if i is not None and i != eos_id)),
        chat_template=template,
        add_bos_token=add_bos,
    )


def _split_merge(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


def _scores(md: dict[str, Any], n: int) -> list[float]:
    scores = md.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != n:
        raise ModelLoadError("sentencepiece GGUF vocabulary has neither merges nor one score per token")
    return [float(s) for s in scores]


def _byte_level_bpe(tokens: list[str], merges: list[tuple[str, str]], pre: str | None) -> HFTokenizer:
    """GPT-2 style BPE over bytes; tokens outside the byte alphabet (raw text in some files) are respelled."""
    vocab = {
        t if _BYTE_ALPHABET.issuperset(t) else "".join(_BYTE_CHARS[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    tok = HFTokenizer(
        models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                   end_of_word_suffix="", fuse_unk=False)
    )
    split = PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(tokens: list[str], merges: list[tuple[str, str]]) -> HFTokenizer:
    """SentencePiece BPE: `▁` for spaces (one prepended to the text), `<0xNN>` byte-fallback tokens."""
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tok


def _gemma_bpe(tokens: list[str], merges: list[tuple[str, str]]) -> HFTokenizer:
    """Gemma's SentencePiece BPE as transformers' GemmaTokenizer builds it: every space becomes `▁` (a
    normalizer; no `▁` is prepended: the files say add_space_prefix false), byte fallback, `<unk>`.

    As transformers' GGUF reader does (gemma_tokenizer): tokens of two or more spaces, which the file stores
    as real spaces, are respelled with `▁`; and the file's scores do not follow Gemma's merge order, the
    tokens' order does, so merges are rebuilt best-first by position (_merges_by_position)."""
    vocab_tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(vocab_tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges or _merges_by_position(vocab_tokens), fuse_unk=True,
                                 unk_token="<unk>" if "<unk>" in vocab else None, byte_fallback=True, dropout=None))
    tok.normalizer = normalizers.Replace(" ", "▁")
    # After the normalizer no " " is left to split on; kept because it is GemmaTokenizer's own pre-tokenizer.
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


def _merges_by_position(tokens: list[str]) -> list[tuple[str, str]]:
    """transformers' `generate_merges(vocab, {token: -position})` without its sort over all the pairs (515k
    for Gemma 3's 262k tokens): ranked by position, a token's splits all tie on the score and then go by the
    left piece's length, longest first; so tokens in order (by their last position, as the dict keeps it),
    each split from the longest left piece down, is that sorted list."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges: list[tuple[str, str]] = []
    for token in sorted(vocab, key=vocab.__getitem__):
        for k in range(len(token) - 1, 0, -1):
            left, right = token[:k], token[k:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a token into two vocabulary tokens is a merge, ranked by the token's score
    (best first), ties by the pieces' lengths -- transformers' `generate_merges`, step for step."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[str, str, float]] = []
    for token, score in dict(zip(tokens, scores)).items():
        local = [(token[:k], token[k:], score) for k in range(1, len(token))
                 if token[:k] in vocab and token[k:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        ranked.extend(local)
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def _add_special_tokens(
    tok: HFTokenizer, tokens: list[str], token_types: np.ndarray | None, byte_level: bool, named: list[str]
) -> None:
    """Match whole in text, never split: bos/eos/unk/pad and CONTROL tokens as special (dropped by
    `decode(skip_special_tokens=True)`), USER_DEFINED ones (e.g. `<think>`) as plain added tokens.

    A CONTROL token outside the byte alphabet in a byte-level vocabulary is a llama.cpp mislabel and
    is skipped, as transformers does.
    """
    types = np.asarray(token_types if token_types is not None else [], dtype=np.int64)
    control = [tokens[i] for i in np.flatnonzero(types == TokenType.CONTROL)]
    if byte_level:
        control = [t for t in control if _BYTE_ALPHABET.issuperset(t)]
    vocab = tok.get_vocab()
    specials = list(dict.fromkeys([t for t in named if t in vocab] + control))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    user = [tokens[i] for i in np.flatnonzero(types == TokenType.USER_DEFINED) if tokens[i] in vocab]
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _template(tok: HFTokenizer, bos: str | None, eos: str | None) -> processors.TemplateProcessing:
    """BOS/EOS around each sequence, as transformers' `update_post_processor` writes it."""
    pre = f"{bos}:0 " if bos else ""
    post = f" {eos}:0" if eos else ""
    single = f"{pre}$A:0{post}"
    pair = f"{single}{f' {bos}:1' if bos else ''} $B:1{f' {eos}:1' if eos else ''}"
    specials = [(t, tok.token_to_id(t)) for t in (bos, eos) if t]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
