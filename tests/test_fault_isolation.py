"""Issue 24 (reliability): one request's fault fails that request alone; n counts against admission."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from conftest import PROMPTS
from tokenloom.engine import logits_processors
from tokenloom import LLM, SamplingParams
from tokenloom.config import EngineConfig
from tokenloom.engine.async_engine import AsyncLLMEngine
from tokenloom.engine.scheduler import Scheduler, SchedulerConfig
from tokenloom.engine.kv_cache_manager import KVCacheManager
from tokenloom.engine.sequence import Sequence, SequenceStatus
from tokenloom.errors import InvalidRequest, Overloaded, RequestFailed

KW = dict(dtype="float32", kv_cache_memory="16MiB", max_model_len=256)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), **KW)


def test_stop_token_ids_outside_the_vocabulary_are_refused(llm: LLM) -> None:
    """Defect 1: stop_token_ids [100000] with min_tokens indexed past the logits and ended the engine loop."""
    vocab = llm.engine.model_config.vocab_size
    for bad in (vocab, 100000):
        with pytest.raises(InvalidRequest) as e:
            llm.generate("Hello", SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[bad]))
        assert e.value.field == "stop_token_ids"
    assert llm.generate("Hello", GREEDY)[0].outputs[0].finish_reason == "length"  # the engine is fine


def test_a_sampling_fault_fails_its_request_alone(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault while sampling one sequence (here: its stop-token mask raises) fails that request with an
    error; the batch's other requests get exactly the tokens they get alone."""
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], GREEDY)]
    eng = llm.engine
    poisoned = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=4, stop_token_ids=[1])
    original = logits_processors.mask_stop_tokens

    def mask(logits, rows):  # type: ignore[no-untyped-def]
        if any(r.params is poisoned for r in rows):
            raise IndexError("a bad row")
        original(logits, rows)

    monkeypatch.setattr(logits_processors, "mask_stop_tokens", mask)
    outs = llm.generate(PROMPTS[:3] + [PROMPTS[0]], [GREEDY] * 3 + [poisoned])
    assert [o.outputs[0].token_ids for o in outs[:3]] == want
    assert all(o.error is None for o in outs[:3])
    bad = outs[3]
    assert bad.error is not None and "IndexError" in bad.error and bad.outputs[0].finish_reason == "error"
    assert eng.kv.pool.num_used == 0 and not eng.scheduler.has_unfinished()
    with pytest.raises(RequestFailed):
        list(llm.stream(PROMPTS[0], poisoned))
    assert eng.get_stats()["kv_blocks_used"] == 0


def test_a_detokenizing_fault_fails_its_request_alone(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], GREEDY)]
    out = llm.engine.output
    poisoned = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=["never"])
    original = out.append

    def append(seq, token, logprob):  # type: ignore[no-untyped-def]
        if seq.params is poisoned and seq.num_output_tokens >= 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")
        return original(seq, token, logprob)

    monkeypatch.setattr(out, "append", append)
    outs = llm.generate(PROMPTS[:2] + [PROMPTS[2]], [GREEDY, GREEDY, poisoned])
    assert [o.outputs[0].token_ids for o in outs[:2]] == want
    assert outs[2].error is not None and len(outs[2].outputs[0].token_ids) == 2
    assert llm.engine.kv.pool.num_used == 0


def test_async_engine_survives_a_failed_request(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's engine loop: the failed request's stream raises RequestFailed, the engine stays alive."""
    engine = AsyncLLMEngine.from_config(EngineConfig(model=str(tiny_llama), **KW), max_n=4)
    try:
        poisoned = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=4, stop_token_ids=[1])
        original = logits_processors.mask_stop_tokens

        def mask(logits, rows):  # type: ignore[no-untyped-def]
            if any(r.params is poisoned for r in rows):
                raise IndexError("a bad row")
            original(logits, rows)

        monkeypatch.setattr(logits_processors, "mask_stop_tokens", mask)
        ids = engine.tokenizer.encode(PROMPTS[0])

        async def run(params: SamplingParams) -> list[int]:
            got: list[int] = []
            async for out in engine.generate(ids, params):
                got += out.outputs[0].token_ids if out.outputs else []
            return got

        async def both() -> tuple[object, object]:
            return tuple(await asyncio.gather(run(poisoned), run(GREEDY), return_exceptions=True))  # type: ignore[return-value]

        bad, good = asyncio.run(both())
        assert isinstance(bad, RequestFailed) and isinstance(good, list) and len(good) == 8
        assert engine.is_alive and asyncio.run(run(GREEDY)) == good
        with pytest.raises(InvalidRequest) as e:  # defect 3: n beyond --max-n is a 400 naming n
            asyncio.run(run(SamplingParams(n=5, max_tokens=2)))
        assert e.value.field == "n"
    finally:
        engine.shutdown()


def test_admission_counts_sequences_not_requests(tiny_llama: Path) -> None:
    """Defect 3: --max-waiting counted requests, so one request with a huge n filled the engine."""
    engine = AsyncLLMEngine.from_config(EngineConfig(model=str(tiny_llama), max_num_seqs=2, **KW), max_waiting=3)
    try:
        ids = engine.tokenizer.encode(PROMPTS[0])

        async def go() -> None:
            first = engine.generate(ids, SamplingParams(n=4, max_tokens=50, ignore_eos=True))
            await first.__anext__()  # 4 of the 5 sequences' room taken
            with pytest.raises(Overloaded):
                await engine.generate(ids, SamplingParams(n=2, max_tokens=2)).__anext__()
            one = [o async for o in engine.generate(ids, SamplingParams(max_tokens=2))]  # 1 more fits
            assert one[-1].finished
            await first.aclose()

        asyncio.run(go())
    finally:
        engine.shutdown()


def test_aborting_many_waiting_sequences_is_linear() -> None:
    """Defect 3: each abort rebuilt the waiting heap. Finished waiting entries are now dropped lazily;
    the counts and order stay exact."""
    kv = KVCacheManager(64, 4)
    sched = Scheduler(SchedulerConfig(4, 64, 64), kv)
    seqs = [Sequence(f"s{i}", f"s{i}", 0, [1, 2, 3], SamplingParams(max_tokens=4), 4, frozenset(), i)
            for i in range(2000)]
    for s in seqs:
        sched.add(s)
    for s in seqs[::2]:
        sched.finish(s, SequenceStatus.FINISHED_ABORTED)
    assert sched.num_waiting == 1000 and sched.waiting()[:3] == [seqs[1], seqs[3], seqs[5]]
    batch = sched.schedule()
    assert batch.seqs == [seqs[1], seqs[3], seqs[5], seqs[7]] and sched.num_waiting == 996


def test_a_failed_request_is_a_500_marked_as_its_own() -> None:
    """A request that failed inside the engine answers 500 with type request_failed and a header that tells
    the router the worker is fine (a generic 500 would take the worker out of rotation)."""
    import json

    from tokenloom.serve.errors import REQUEST_FAILED_HEADER, error_response

    resp = error_response(RequestFailed("IndexError: a bad row"))
    body = json.loads(resp.body)
    assert resp.status_code == 500 and resp.headers[REQUEST_FAILED_HEADER] == "1"
    assert body["error"]["type"] == "request_failed" and "a bad row" in body["error"]["message"]
    other = error_response(RuntimeError("boom"))
    assert other.status_code == 500 and REQUEST_FAILED_HEADER not in other.headers
    assert json.loads(other.body)["error"]["message"] == "internal error"  # internals are not shown
