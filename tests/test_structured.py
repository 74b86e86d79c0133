"""tokenloom.structured: compiling each kind, the cache, masked decoding that must produce valid output,
the bitmask kernels against a plain-torch oracle, and the per-sequence matcher (reject, rollback, EOS)."""

from __future__ import annotations

import json
import re
import threading

import pytest
import torch
import xgrammar as xgr
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from conftest import build_tokenizer
from tokenloom.errors import InvalidRequest, ModelLoadError
from tokenloom.sampling_params import StructuredOutput
from tokenloom.structured import GrammarBackend, GrammarState, allocate, apply, apply_reference, tokenizer_info
from tokenloom.structured.bitmask import apply_xgrammar
from tokenloom.tokenizer import Tokenizer

try:
    import jsonschema_rs
except ImportError:  # optional second opinion on schema validity; the hand checks below always run
    jsonschema_rs = None

PAD = 21  # the model's logits are wider than the tokenizer's vocabulary (lm_head padding)
SEEDS = range(24)
MAX_STEPS = 400

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "active"],
}
REGEXES = [r"\(\d{3}\) \d{3}-\d{4}", r"[a-z]{3,8}@(foo|bar)\.(com|org)", r"-?(0|[1-9]\d{0,5})(\.\d{1,3})?"]
CHOICES = ("yes", "no", "maybe later", 'say "hi"\n')
EBNF = 'root ::= "(" num ("," num)* ")"\nnum ::= [0-9]+'
EBNF_AS_REGEX = r"\(\d+(,\d+)*\)"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("structured-tok")
    build_tokenizer(folder)
    return Tokenizer.from_hf_folder(folder)


@pytest.fixture(scope="module")
def backend(tok: Tokenizer) -> GrammarBackend:
    return GrammarBackend(tok, tok.vocab_size + PAD, tok.stop_token_ids)


def fresh(tok: Tokenizer, **kw: int) -> GrammarBackend:
    return GrammarBackend(tok, tok.vocab_size + PAD, tok.stop_token_ids, **kw)


def closer_bias(tok: Tokenizer, vocab_size: int) -> torch.Tensor:
    """(vocab,) 1.0 on tokens that end something (quote, bracket, EOS): scaled up step by step so random
    sampling finishes unbounded strings and repetitions instead of running to MAX_STEPS."""
    bias = torch.zeros(vocab_size)
    for token, idx in tok.backend.get_vocab(with_added_tokens=True).items():
        if any(c in token for c in "\"}])"):
            bias[idx] = 1.0
    bias[list(tok.stop_token_ids)] = 1.0
    return bias


def generate(backend: GrammarBackend, tok: Tokenizer, structured: StructuredOutput, seed: int,
             greedy: bool = False) -> str:
    """Masked random decoding: every sampled token must be accepted, and the grammar must finish."""
    state = GrammarState.new(backend.compile(structured))
    mask = allocate(1, backend.vocab_size)  # (1, ceil(vocab/32)) int32
    bias = closer_bias(tok, backend.vocab_size)
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for step in range(MAX_STEPS):
        state.fill_bitmask(mask, 0)
        logits = torch.randn(1, backend.vocab_size, generator=gen) * 2 + bias * step * 0.05  # (1, vocab)
        apply(logits, mask)
        if greedy:
            token = int(logits.argmax())
        else:
            token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        assert token < tok.vocab_size, "a padding column survived the mask"
        assert state.accept(token), f"the mask allowed token {token} but the matcher refused it"
        ids.append(token)
        if state.is_terminated:
            break
    else:
        pytest.fail(f"seed {seed}: the grammar did not finish in {MAX_STEPS} tokens: {tok.decode(ids)!r}")
    return tok.decode([i for i in ids if i not in tok.stop_token_ids], skip_special_tokens=False)


def check_person(value: object) -> None:
    assert isinstance(value, dict) and set(value) == set(PERSON["required"]), value
    # xgrammar 0.2.9 takes a UTF-8-encoded surrogate (ED A0..BF xx) as one character; Python decodes its
    # 3 bytes to 3 U+FFFD. Random logits do hit that; count each such triple as the one char xgrammar saw.
    name = value["name"]
    assert isinstance(name, str) and len(name) - 2 * (name.count("\ufffd") // 3) <= 8, name
    assert type(value["age"]) is int and 0 <= value["age"] <= 120
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3
    assert all(t in ("red", "green", "blue") for t in value["tags"])
    assert isinstance(value["active"], bool)
    if jsonschema_rs is not None and "\ufffd" not in name:
        assert jsonschema_rs.is_valid(PERSON, value)


# --- compiling ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("structured", [
    StructuredOutput("json_object"),
    StructuredOutput("json_schema", json.dumps(PERSON)),
    StructuredOutput("json_schema", "true"),
    StructuredOutput("regex", REGEXES[0]),
    StructuredOutput("choice", choices=CHOICES),
    StructuredOutput("grammar", EBNF),
], ids=lambda s: s.kind)
def test_every_kind_compiles(backend: GrammarBackend, structured: StructuredOutput) -> None:
    assert isinstance(backend.compile(structured), xgr.CompiledGrammar)


@pytest.mark.parametrize("kind, spec, why", [
    ("json_schema", '{"type": ', "not valid JSON"),
    ("json_schema", "[1, 2]", "must be an object or a boolean"),
    ("json_schema", '{"type": "foo"}', "Unsupported type"),
    ("json_schema", '{"$ref": "#/nowhere"}', "nowhere"),
    ("json_schema", '{"type": "string", "pattern": "a(b"}', "parenthesis"),
    ("regex", "a(b", "parenthesis"),
    ("regex", "a(?=b)", "Lookahead"),
    ("grammar", "root ::= foo", "not defined"),
    ("grammar", 'start ::= "a"', "root"),
])
def test_bad_specs_are_invalid_requests(tok: Tokenizer, kind: str, spec: str, why: str) -> None:
    backend = fresh(tok)
    structured = StructuredOutput(kind, spec, field="response_format")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest) as sync:
        backend.compile(structured)
    assert sync.value.field == "response_format" and str(sync.value).startswith("response_format: ")
    assert why in str(sync.value) and "/project/cpp" not in str(sync.value)
    with pytest.raises(InvalidRequest) as async_:
        backend.compile_async(StructuredOutput(kind, spec, field="guided_regex")).result(30)  # type: ignore[arg-type]
    assert async_.value.field == "guided_regex" and str(async_.value).startswith("guided_regex: ")
    stats = backend.stats
    assert (stats.misses, stats.errors, stats.hits) == (2, 2, 0)  # failures are not cached


def test_cache_compiles_each_key_once(tok: Tokenizer) -> None:
    backend = fresh(tok)
    schema = StructuredOutput("json_schema", json.dumps(PERSON))
    first = backend.compile(schema)
    assert backend.compile(StructuredOutput("json_schema", json.dumps(PERSON), field="other")) is first
    assert backend.compile_async(schema).result(30) is first
    stats = backend.stats
    assert (stats.misses, stats.hits, stats.errors) == (1, 2, 0) and stats.compile_seconds > 0


def test_concurrent_compile_async_compiles_once(tok: Tokenizer) -> None:
    backend = fresh(tok, max_threads=4)
    structured = StructuredOutput("regex", r"[a-z]{2,40}\d{1,30}")
    barrier, futures, lock = threading.Barrier(8), [], threading.Lock()

    def go() -> None:
        barrier.wait()
        future = backend.compile_async(structured)
        with lock:
            futures.append(future)

    threads = [threading.Thread(target=go) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results = [f.result(30) for f in futures]
    assert all(r is results[0] for r in results)
    assert (backend.stats.misses, backend.stats.hits) == (1, 7)


def test_cache_evicts_least_recently_used(tok: Tokenizer) -> None:
    backend = fresh(tok, cache_size=2)
    a, b, c = (StructuredOutput("regex", p) for p in ("a+", "b+", "c+"))
    backend.compile(a)
    backend.compile(b)
    backend.compile(a)  # a is now the most recent: c evicts b
    backend.compile(c)
    backend.compile(a)
    assert (backend.stats.misses, backend.stats.hits) == (3, 2)
    backend.compile(b)
    assert backend.stats.misses == 4


def test_shutdown_fails_pending_compiles(tok: Tokenizer) -> None:
    backend = fresh(tok, max_threads=1)
    futures = [backend.compile_async(StructuredOutput("regex", f"[a-z]{{1,{n}}}x")) for n in range(60, 70)]
    backend.shutdown()
    for f in futures:  # each either compiled or failed with a typed error: none hangs
        try:
            f.result(30)
        except Exception as e:
            assert type(e).__name__ == "EngineDead"


# --- masked decoding produces valid output ---------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_json_object_decoding(backend: GrammarBackend, tok: Tokenizer, seed: int) -> None:
    text = generate(backend, tok, StructuredOutput("json_object"), seed)
    assert isinstance(json.loads(text), dict), text
    assert not re.search(r"\s{21}", text), "whitespace runs are bounded"


@pytest.mark.parametrize("seed", SEEDS)
def test_json_schema_decoding(backend: GrammarBackend, tok: Tokenizer, seed: int) -> None:
    text = generate(backend, tok, StructuredOutput("json_schema", json.dumps(PERSON)), seed, greedy=seed % 4 == 0)
    check_person(json.loads(text))


@pytest.mark.parametrize("seed", SEEDS)
def test_regex_decoding(backend: GrammarBackend, tok: Tokenizer, seed: int) -> None:
    pattern = REGEXES[seed % len(REGEXES)]
    text = generate(backend, tok, StructuredOutput("regex", pattern), seed)
    assert re.fullmatch(pattern, text), (pattern, text)


@pytest.mark.parametrize("seed", SEEDS)
def test_choice_decoding(backend: GrammarBackend, tok: Tokenizer, seed: int) -> None:
    assert generate(backend, tok, StructuredOutput("choice", choices=CHOICES), seed) in CHOICES


@pytest.mark.parametrize("seed", SEEDS)
def test_ebnf_decoding(backend: GrammarBackend, tok: Tokenizer, seed: int) -> None:
    text = generate(backend, tok, StructuredOutput("grammar", EBNF), seed)
    assert re.fullmatch(EBNF_AS_REGEX, text), text


def test_choices_all_reachable(backend: GrammarBackend, tok: Tokenizer) -> None:
    seen = {generate(backend, tok, StructuredOutput("choice", choices=CHOICES), s) for s in range(60)}
    assert seen == set(CHOICES)


# --- bitmask kernels ------------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["auto", "xgrammar"])  # auto: tokenloom's kernel where it is built
@pytest.mark.parametrize("vocab, words", [(421, 14), (421, 12), (421, 16), (64, 2), (5, 1), (49152, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_apply_matches_reference(vocab: int, words: int, dtype: torch.dtype, route: str) -> None:
    gen = torch.Generator().manual_seed(vocab * words)
    bitmask = torch.randint(-(2**31), 2**31, (6, words), dtype=torch.int64, generator=gen).to(torch.int32)
    bitmask[1, : words // 2] = -1  # runs of allowed tokens: the kernel's skip of all-allowed groups
    logits = torch.randn(6, vocab, generator=gen).to(dtype)
    if route == "xgrammar" and dtype == torch.float64:
        pytest.skip("xgrammar's kernel takes float32/16 and bfloat16 only")
    fast_apply = apply if route == "auto" else apply_xgrammar
    for rows in ([0, 2, 5], [1], None, []):
        fast, slow = logits.clone(), logits.clone()
        fast_apply(fast, bitmask, rows)
        apply_reference(slow, bitmask, rows)
        assert torch.equal(fast, slow)
        listed = list(range(6)) if rows is None else rows
        others = [r for r in range(6) if r not in listed]
        assert torch.equal(fast[others], logits[others])  # unlisted rows untouched
        if words * 32 < vocab and listed:
            assert torch.isneginf(fast[listed, words * 32:]).all()  # past the bitmask: masked


def test_apply_reference_reads_bits() -> None:
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = -(2**31) | 1  # tokens 0 and 31
    bitmask[0, 1] = 1 << 3  # token 35
    logits = torch.zeros(1, 40)
    apply_reference(logits, bitmask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 31, 35]


def test_apply_rejects_bad_rows() -> None:
    with pytest.raises(ValueError):
        apply(torch.zeros(2, 10), allocate(2, 10), [2])
    with pytest.raises(ValueError):
        apply(torch.zeros(2, 10), allocate(2, 10).to(torch.int64), None)


# --- the matcher ----------------------------------------------------------------------------------------


def token_id(tok: Tokenizer, text: str) -> int:
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def allowed(state: GrammarState, vocab_size: int) -> list[int]:
    mask = allocate(1, vocab_size)
    state.fill_bitmask(mask, 0)
    logits = torch.zeros(1, vocab_size)
    apply(logits, mask)
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


def test_padding_and_specials_never_allowed(backend: GrammarBackend, tok: Tokenizer) -> None:
    state = GrammarState.new(backend.compile(StructuredOutput("json_object")))
    ids = allowed(state, backend.vocab_size)
    assert ids and max(ids) < tok.vocab_size
    assert not set(ids) & set(tok.stop_token_ids)  # no EOS before the grammar is complete


def test_accept_rejects_and_rollback_restores(backend: GrammarBackend, tok: Tokenizer) -> None:
    state = GrammarState.new(backend.compile(StructuredOutput("regex", r"\d+-\d+")))
    start = allowed(state, backend.vocab_size)
    assert not state.accept(token_id(tok, "x")) and not state.accept(backend.vocab_size + 5)
    assert allowed(state, backend.vocab_size) == start  # a refused token changes nothing
    digits = [token_id(tok, c) for c in "12"]
    assert state.accept_many([*digits, token_id(tok, "x"), digits[0]]) == 2
    after_digits = allowed(state, backend.vocab_size)
    assert after_digits != start and token_id(tok, "-") in after_digits
    assert state.accept(token_id(tok, "-"))
    state.rollback(1)
    assert allowed(state, backend.vocab_size) == after_digits
    state.rollback(2)
    assert allowed(state, backend.vocab_size) == start
    with pytest.raises(ValueError):
        state.rollback(1)


def test_eos_only_at_the_end(backend: GrammarBackend, tok: Tokenizer) -> None:
    eos = tok.stop_token_ids[0]
    state = GrammarState.new(backend.compile(StructuredOutput("choice", choices=("12", "123"))))
    assert not state.accept(eos)
    assert state.accept_many([token_id(tok, "1"), token_id(tok, "2")]) == 2
    assert state.is_completed and not state.is_terminated  # "12" may end or go on to "123"
    assert set(allowed(state, backend.vocab_size)) == {eos, token_id(tok, "3")}
    assert state.accept(token_id(tok, "3"))
    assert state.is_terminated  # nothing can follow "123": finish without sampling EOS
    assert allowed(state, backend.vocab_size) == [eos]
    assert state.accept(eos) and state.is_terminated
    assert allowed(state, backend.vocab_size) == [eos]  # after the stop token: still only stop tokens
    assert not state.accept(token_id(tok, "1")) and state.accept(eos)
    state.rollback(3)
    assert not state.is_terminated and set(allowed(state, backend.vocab_size)) == {eos, token_id(tok, "3")}


def test_new_and_fork_are_independent(backend: GrammarBackend, tok: Tokenizer) -> None:
    compiled = backend.compile(StructuredOutput("regex", r"(ab|cd)\d"))
    a, b = GrammarState.new(compiled), GrammarState.new(compiled)
    assert a.accept(token_id(tok, "a"))
    fork = a.fork()
    assert fork.accept(token_id(tok, "b"))
    assert allowed(a, backend.vocab_size) == [token_id(tok, "b")]
    assert allowed(b, backend.vocab_size) != allowed(a, backend.vocab_size)
    assert not b.accept(token_id(tok, "b")) and b.accept(token_id(tok, "c"))
    fork.rollback(2)
    assert allowed(fork, backend.vocab_size) == allowed(GrammarState.new(compiled), backend.vocab_size)


def test_override_stop_tokens(backend: GrammarBackend, tok: Tokenizer) -> None:
    stop = token_id(tok, "!")
    state = GrammarState.new(backend.compile(StructuredOutput("regex", "a+")), stop_token_ids=[stop])
    assert state.accept(token_id(tok, "a"))
    assert stop in allowed(state, backend.vocab_size) and tok.stop_token_ids[0] not in allowed(state, backend.vocab_size)


# --- vocabulary detection -------------------------------------------------------------------------------


def word_level(decoder: decoders.Decoder | None) -> HFTokenizer:
    vocab = {"<unk>": 0, "</s>": 1, "▁a": 2, "▁b": 3, "<0x0A>": 4}
    t = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    if decoder is not None:
        t.decoder = decoder
    return t


def test_vocab_type_detection(tok: Tokenizer) -> None:
    info = tokenizer_info(tok, tok.vocab_size + PAD, tok.stop_token_ids)
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL and not info.add_prefix_space
    assert info.vocab_size == tok.vocab_size + PAD and info.stop_token_ids == list(tok.stop_token_ids)
    sp = tokenizer_info(word_level(decoders.Metaspace()), 5, [1])
    assert sp.vocab_type == xgr.VocabType.BYTE_FALLBACK and sp.add_prefix_space
    assert sp.decoded_vocab[2] == b" a" and sp.decoded_vocab[4] == b"\n"
    raw = HFTokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    assert tokenizer_info(raw, 3, [0]).vocab_type == xgr.VocabType.RAW


def test_bad_eos_ids_are_config_errors(tok: Tokenizer) -> None:
    from tokenloom.errors import ConfigError

    with pytest.raises(ConfigError):
        GrammarBackend(tok, tok.vocab_size, [])
    with pytest.raises(ConfigError):
        GrammarBackend(tok, tok.vocab_size, [tok.vocab_size])


# --- the real SmolLM2 tokenizer (49152 tokens, byte-level) -------------------------------------------------


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    from tokenloom.models.default import default_model_path
    from tokenloom.models.gguf_file import read_gguf
    from tokenloom.models.gguf_tokenizer import tokenizer_from_gguf

    try:
        return tokenizer_from_gguf(read_gguf(default_model_path()))
    except ModelLoadError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("seed", range(4))
def test_smollm2_json_schema(smol: Tokenizer, seed: int) -> None:
    backend = GrammarBackend(smol, smol.vocab_size, smol.stop_token_ids)
    check_person(json.loads(generate(backend, smol, StructuredOutput("json_schema", json.dumps(PERSON)), seed)))


def test_the_kernel_route_is_taken_where_built() -> None:
    """On a machine that builds tokenloom's kernels, `apply` uses its own (the fast route); it must then
    be the one the test above compares with the reference."""
    from tokenloom.kernels import load_cpu_kernels
    from tokenloom.structured import bitmask as bm

    if load_cpu_kernels() is None:
        pytest.skip("no C++ toolchain: apply uses xgrammar's kernel")
    assert bm._cpu_kernels() is not None
