"""Grammar compilation: a StructuredOutput becomes an xgrammar CompiledGrammar, once per distinct spec.

One GrammarBackend per engine. Compiling a JSON schema can take tens of milliseconds, so the async engine
awaits `compile_async` (a small thread pool) before queueing a request; `compile` is the same, in the caller's thread.
Both share one LRU keyed by `StructuredOutput.key` that also holds in-flight futures, so concurrent requests
with one schema compile it once. Whatever goes wrong while compiling is an InvalidRequest naming the field.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, replace

import xgrammar as xgr
from tokenizers import Tokenizer as HFTokenizer

from tokenloom.errors import EngineDead, InvalidRequest
from tokenloom.sampling_params import StructuredOutput
from tokenloom.structured.vocab import tokenizer_info
from tokenloom.tokenizer import Tokenizer

CompiledGrammar = xgr.CompiledGrammar
Key = tuple[str, str, tuple[str, ...]]

# Whitespace between JSON elements: any kind (so a model may pretty-print as it was trained to), but at
# most this many characters per gap. Unbounded whitespace lets a small model loop on spaces until
# max_tokens; none at all forces tokenizations the model rarely saw. 20 fits "\n" plus a deep indent
# (llama.cpp's JSON grammars use the same bound).
MAX_WHITESPACE = 20

_ANY_OBJECT = '{"type": "object"}'  # json_object: any object (xgrammar's builtin JSON grammar also allows arrays)
# xgrammar 0.2.9 spells a character of a length-bounded string (minLength/maxLength) as any char but
# quote, backslash, CR, LF: raw control characters would pass and json.loads rejects them. We swap in
# the character class its unbounded strings use.
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'
_XGR_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")  # "[03:21:41] file.cc:94: "


@dataclass
class GrammarStats:
    hits: int = 0  # compile requests answered by the cache (finished or in flight)
    misses: int = 0  # compiles started
    errors: int = 0  # compiles that failed (not cached)
    compile_seconds: float = 0.0  # summed over misses


class _CompileFailed(Exception):
    """A failed compile in the shared future; each caller turns it into an InvalidRequest for its own field."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class GrammarBackend:
    def __init__(self, tokenizer: Tokenizer | HFTokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 max_threads: int = 2, cache_size: int = 256) -> None:
        self.vocab_size = vocab_size  # the logits width: bitmasks are (rows, ceil(vocab_size/32))
        self.info = tokenizer_info(tokenizer, vocab_size, eos_token_ids)
        # xgrammar's own cache is off: ours bounds the entry count and shares in-flight compiles.
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="grammar")
        self._cache: OrderedDict[Key, Future[CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._stats = GrammarStats()

    @property
    def stats(self) -> GrammarStats:
        with self._lock:
            return replace(self._stats)

    def compile(self, structured: StructuredOutput) -> CompiledGrammar:
        """Compile now, in this thread (a cached or in-flight result is reused). Not for the engine thread."""
        shared, owner = self._claim(structured.key)
        if owner:
            self._run(structured, shared)
        return _for_field(shared, structured.field).result()

    def compile_async(self, structured: StructuredOutput) -> Future[CompiledGrammar]:
        """A future of the compiled grammar, compiled on the pool; it fails with InvalidRequest."""
        shared, owner = self._claim(structured.key)
        if owner:
            self._pool.submit(self._run, structured, shared)
        return _for_field(shared, structured.field)

    def shutdown(self) -> None:
        """Stop the pool; compiles that had not started fail with EngineDead instead of hanging."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            pending = [f for f in self._cache.values() if not f.done()]
            self._cache.clear()
        for future in pending:
            _settle(future, error=EngineDead("the grammar backend was shut down"))

    def _claim(self, key: Key) -> tuple[Future[CompiledGrammar], bool]:
        """The cache entry for `key`, and whether the caller must compile it (it was missing)."""
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self._stats.hits += 1
                return future, False
            future = Future()
            self._cache[key] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)  # an evicted in-flight future still completes for its waiters
            self._stats.misses += 1
            return future, True

    def _run(self, structured: StructuredOutput, shared: Future[CompiledGrammar]) -> None:
        start = time.perf_counter()
        try:
            compiled = self._compile_kind(structured)
        except Exception as e:  # xgrammar raises RuntimeError/ValueError/TypeError with its parser's message
            why = _XGR_NOISE.sub("", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
            with self._lock:
                self._stats.errors += 1
                self._stats.compile_seconds += time.perf_counter() - start
                if self._cache.get(structured.key) is shared:
                    del self._cache[structured.key]  # a bad spec is not kept: the cache is for grammars
            _settle(shared, error=_CompileFailed(why))
            return
        with self._lock:
            self._stats.compile_seconds += time.perf_counter() - start
        _settle(shared, result=compiled)

    def _compile_kind(self, s: StructuredOutput) -> CompiledGrammar:
        if s.kind == "json_object":
            return self._json_schema(_ANY_OBJECT, strict=False)  # extra keys of any type are the point
        if s.kind == "json_schema":
            try:
                schema = json.loads(s.spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"the schema is not valid JSON: {e}") from e
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"a JSON schema must be an object or a boolean, got {type(schema).__name__}")
            return self._json_schema(s.spec, strict=True)
        if s.kind == "regex":
            return self._compiler.compile_regex(s.spec)
        if s.kind == "grammar":
            return self._compiler.compile_grammar(s.spec)  # GBNF-style EBNF with a `root` rule
        # choice: an alternation of string literals (JSON escapes are valid EBNF string escapes).
        return self._compiler.compile_grammar(
            "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in s.choices)
        )

    def _json_schema(self, schema: str, strict: bool) -> CompiledGrammar:
        # strict_mode: no properties/items beyond the schema's, so a model cannot wander into extra keys.
        grammar = xgr.Grammar.from_json_schema(
            schema, any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE, strict_mode=strict
        )
        ebnf = str(grammar)
        if _LOOSE_STRING_CHAR not in ebnf:
            return self._compiler.compile_grammar(grammar)
        return self._compiler.compile_grammar(ebnf.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))


def _for_field(shared: Future[CompiledGrammar], field: str) -> Future[CompiledGrammar]:
    """A caller's own future mirroring `shared`; a failure names the caller's field (same key, other field)."""
    mine: Future[CompiledGrammar] = Future()

    def copy(done: Future[CompiledGrammar]) -> None:
        error = done.exception()
        if isinstance(error, _CompileFailed):
            error = InvalidRequest(f"{field}: {error.why}", field)
        _settle(mine, None if error is not None else done.result(), error)

    shared.add_done_callback(copy)
    return mine


def _settle(future: Future[CompiledGrammar], result: CompiledGrammar | None = None,
            error: BaseException | None = None) -> None:
    """Complete `future` unless it already is (cancelled by its caller, or failed by shutdown)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
