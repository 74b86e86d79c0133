"""Per-request sampling parameters, validated on construction (names as in vLLM / the OpenAI API)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from tokenloom.errors import InvalidRequest

MAX_LOGPROBS = 20  # the OpenAI API's top_logprobs ceiling
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seeds and token ids must fit torch's int64
LOGIT_BIAS_MAX = 100.0  # the OpenAI API's logit_bias range is [-100, 100]


StructuredKind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on what a request may generate, enforced token by token by the grammar engine
    (tokenloom/structured/). `spec` per kind: json_object: "" (any JSON object); json_schema: the schema as
    JSON text; regex: the pattern; grammar: an EBNF/GBNF grammar; choice: unused ("") with `choices` set.
    `field` is the request field it came from ("response_format", "guided_regex", "format", ...): a spec
    that does not compile is a 400 naming it."""

    kind: StructuredKind
    spec: str = ""
    choices: tuple[str, ...] = ()
    field: str = "structured_outputs"
    # Reasoning models think first, unconstrained; the constraint starts after `think_end` (token ids) has
    # been generated. `starts_thinking`: the output begins inside the thinking (the prompt opened it); else,
    # with `think_start`, the model may open it as its first token(s). Empty `think_end`: no thinking.
    think_start: tuple[int, ...] = ()
    think_end: tuple[int, ...] = ()
    starts_thinking: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("json_object", "json_schema", "regex", "choice", "grammar"):
            raise InvalidRequest(f"{self.field}: unknown structured output kind {self.kind!r}", self.field)
        if self.kind == "choice" and not (self.choices and all(isinstance(c, str) and c for c in self.choices)):
            raise InvalidRequest(f"{self.field}: a choice needs a non-empty list of non-empty strings", self.field)
        if self.kind in ("json_schema", "regex", "grammar") and not (isinstance(self.spec, str) and self.spec):
            raise InvalidRequest(f"{self.field}: a {self.kind} constraint needs a non-empty spec", self.field)

    @property
    def key(self) -> tuple[str, str, tuple[str, ...]]:
        """What the compiled grammar depends on (the compile cache's key)."""
        return (self.kind, self.spec, self.choices)


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF/CTRL style, >1 discourages tokens of prompt and output
    presence_penalty: float = 0.0  # OpenAI style, output tokens only
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per sampled token (0: only the sampled token's)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured: StructuredOutput | None = None  # a grammar the output must follow (tokenloom/structured/)
    # Logits processing, applied by the sampler in this order before penalties (engine/sampler.py):
    # token id -> bias added to its logit (OpenAI). A dict is accepted and frozen into (id, bias) pairs sorted
    # by id; ids past the model's vocabulary are the engine's to reject.
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled (vLLM); None: any token
    # Token-id sequences never to generate (vLLM's bad_words, tokenized): a one-token word is banned always,
    # a longer one's last token whenever the output so far ends with its other tokens.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    typical_p: float = 1.0  # locally typical sampling (HF TypicalLogitsWarper); 1: off
    # The repetition penalty (only it) counts the last N tokens of prompt + output (Ollama's repeat_last_n);
    # None: all of them; 0: the penalty is off.
    repetition_window: int | None = None

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen into tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        object.__setattr__(self, "logit_bias", _frozen_logit_bias(self.logit_bias))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", _frozen("allowed_token_ids", self.allowed_token_ids))
        words = _frozen("bad_words_token_ids", self.bad_words_token_ids)
        object.__setattr__(self, "bad_words_token_ids", tuple(_frozen("bad_words_token_ids", w) for w in words))
        self._validate()

    def _validate(self) -> None:
        def bad(field_name: str, why: str) -> InvalidRequest:
            value = getattr(self, field_name)
            return InvalidRequest(f"{field_name} {why}, got {value!r}", field_name)

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not _is_num(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a number >= 0")
        if not _is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be -1, 0 (disabled) or a positive integer")
        if not _is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not _is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -2.0 <= v <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "must be an integer")
        if self.seed is not None and not (INT64_MIN <= self.seed and self.seed + self.n - 1 <= INT64_MAX):
            # The i-th of n completions is seeded with seed + i: each must fit a 64-bit generator seed.
            raise bad("seed", f"must be in [{INT64_MIN}, {INT64_MAX} - (n - 1)] (seed + i seeds the i-th of n)")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})", "min_tokens"
            )
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if not all(_is_int(t) and 0 <= t <= INT64_MAX for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative 64-bit integers")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise bad("structured", "must be a StructuredOutput")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        for t, b in self.logit_bias:
            if not _is_token_id(t):
                raise InvalidRequest(f"logit_bias: token id {t!r} must be a non-negative 64-bit integer", "logit_bias")
            if not _is_num(b) or not -LOGIT_BIAS_MAX <= b <= LOGIT_BIAS_MAX:
                raise InvalidRequest(
                    f"logit_bias: the bias of token {t} must be a number in [-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}], "
                    f"got {b!r}", "logit_bias",
                )
        if self.allowed_token_ids is not None and not (
            self.allowed_token_ids and all(_is_token_id(t) for t in self.allowed_token_ids)
        ):
            raise bad("allowed_token_ids", "must be a non-empty list of non-negative 64-bit integers")
        if not all(w and all(_is_token_id(t) for t in w) for w in self.bad_words_token_ids):
            raise bad("bad_words_token_ids", "must be non-empty lists of non-negative 64-bit integers")
        if not _is_num(self.typical_p) or not 0.0 < self.typical_p <= 1.0:
            raise bad("typical_p", "must be in (0, 1]")
        if self.repetition_window is not None and (not _is_int(self.repetition_window) or self.repetition_window < 0):
            raise bad("repetition_window", "must be an integer >= 0 (0: no repetition penalty) or None (all tokens)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @cached_property
    def needs_logits_processing(self) -> bool:
        """Whether the sampler must process this request's logits before sampling, whatever its position:
        logit_bias, allowed_token_ids, bad words or a penalty. The sampler adds the per-sequence condition (a
        pending min_tokens) and skips all processing for a batch where no row needs it. Cached: the
        sampler asks every step (cached_property writes the instance __dict__, which a frozen dataclass allows)."""
        return bool(
            self.logit_bias
            or self.allowed_token_ids is not None
            or self.bad_words_token_ids
            or (self.repetition_penalty != 1.0 and self.repetition_window != 0)
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def stop_buffer_chars(self) -> int:
        """Characters held back from streaming: they may be the start of a stop string."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1


def _frozen(field_name: str, value: object) -> tuple[object, ...]:
    """A list (or other iterable, not a string or mapping) as a tuple; anything else is a 400 naming the field."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise InvalidRequest(f"{field_name} must be a list, got {value!r}", field_name)
    return tuple(value)


def _frozen_logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """A {token id: bias} mapping or (id, bias) pairs as pairs sorted by id; values are checked by _validate."""
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidRequest(f"logit_bias must map token ids to biases, got {value!r}", "logit_bias")
    else:
        pairs = list(value)
        if not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in pairs):
            raise InvalidRequest(f"logit_bias must map token ids to biases, got {value!r}", "logit_bias")
    if not all(_is_int(t) for t, _ in pairs):  # before sorting: ids of mixed types do not compare
        bad = next(t for t, _ in pairs if not _is_int(t))
        raise InvalidRequest(f"logit_bias: token id {bad!r} must be a non-negative 64-bit integer", "logit_bias")
    frozen = tuple(sorted(((t, b) for t, b in pairs), key=lambda pair: pair[0]))
    if len({t for t, _ in frozen}) != len(frozen):
        raise InvalidRequest("logit_bias: a token id appears more than once", "logit_bias")
    return frozen  # type: ignore[return-value]  # ids checked above, biases by _validate


def _is_token_id(v: object) -> bool:
    return _is_int(v) and 0 <= v <= INT64_MAX  # type: ignore[operator]  # _is_int: v is an int


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # rejects NaN
