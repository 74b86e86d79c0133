"""The engine loop thread behind asyncio streams: concurrency, cancellation, overload, death."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from conftest import PROMPTS
from tokenloom import LLM, EngineDead, Overloaded, SamplingParams
from tokenloom.config import EngineConfig
from tokenloom.engine.async_engine import AsyncLLMEngine
from tokenloom.outputs import RequestOutput

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def make(tiny_llama: Path, **kw: object) -> AsyncLLMEngine:
    cfg = dict(model=str(tiny_llama), dtype="float32", kv_cache_memory="16MiB", max_model_len=256)
    cfg.update(kw)  # type: ignore[arg-type]
    max_waiting = cfg.pop("max_waiting", None)
    return AsyncLLMEngine.from_config(EngineConfig(**cfg), max_waiting=max_waiting)  # type: ignore[arg-type]


async def collect(eng: AsyncLLMEngine, ids: list[int], params: SamplingParams) -> list[int]:
    tokens: list[int] = []
    async for out in eng.generate(ids, params):
        tokens.extend(out.outputs[0].token_ids if out.outputs else [])
    return tokens


def wait_idle(eng: AsyncLLMEngine, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while eng.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_32_concurrent_streams_match_offline(tiny_llama: Path) -> None:
    offline = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB", max_model_len=256)
    prompts = [offline.tokenizer.encode(PROMPTS[i % len(PROMPTS)] + f" {i}") for i in range(32)]
    want = [o.outputs[0].token_ids for o in offline.generate(prompts, GREEDY)]
    eng = make(tiny_llama)

    async def main() -> list[list[int]]:
        return await asyncio.gather(*(collect(eng, p, GREEDY) for p in prompts))

    try:
        assert asyncio.run(main()) == want
    finally:
        eng.shutdown()


def test_cancelled_streams_free_everything(tiny_llama: Path) -> None:
    eng = make(tiny_llama)
    ids = eng.engine.tokenizer.encode(PROMPTS[1])
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def cancel_after_first(i: int) -> None:
        async for _ in eng.generate(ids, long):
            break  # the client goes away mid-stream

    async def main() -> None:
        await asyncio.gather(*(cancel_after_first(i) for i in range(50)))

    try:
        asyncio.run(main())
        wait_idle(eng)
        assert not eng.engine.has_unfinished_requests() and eng.num_unfinished == 0
        pool = eng.engine.kv.pool
        assert pool.num_free == pool.num_blocks
        assert len(asyncio.run(collect(eng, ids, GREEDY))) == 16  # the next request completes
    finally:
        eng.shutdown()


def test_overload_is_refused(tiny_llama: Path) -> None:
    eng = make(tiny_llama, max_num_seqs=1, max_num_batched_tokens=64, max_waiting=1)
    ids = eng.engine.tokenizer.encode(PROMPTS[0])
    slow = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    real_step = eng.engine.step

    def slow_step() -> list[RequestOutput]:  # 200 tokens take >= 2 s: the first request cannot finish early
        time.sleep(0.01)
        return real_step()

    eng.engine.step = slow_step  # type: ignore[method-assign]

    async def main() -> None:
        running = eng.generate(ids, slow)
        assert isinstance(await running.__anext__(), RequestOutput)  # runs in the only sequence slot
        waiting = eng.generate(ids, slow)
        waiter = asyncio.create_task(waiting.__anext__())  # queued behind it: the one allowed waiter
        await asyncio.sleep(0.05)
        assert not waiter.done()
        with pytest.raises(Overloaded):
            await eng.generate(ids, slow).__anext__()
        waiter.cancel()
        await running.aclose()

    try:
        asyncio.run(main())
    finally:
        eng.shutdown()


def test_engine_death_reaches_every_stream(tiny_llama: Path) -> None:
    eng = make(tiny_llama)
    ids = eng.engine.tokenizer.encode(PROMPTS[0])
    real_step = eng.engine.step
    calls = {"n": 0}

    def failing_step() -> list[RequestOutput]:
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("simulated kernel failure")
        return real_step()

    eng.engine.step = failing_step  # type: ignore[method-assign]

    async def main() -> None:
        results = await asyncio.gather(
            *(collect(eng, ids, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)) for _ in range(4)),
            return_exceptions=True,
        )
        assert all(isinstance(r, EngineDead) for r in results)
        with pytest.raises(EngineDead):
            await eng.generate(ids, GREEDY).__anext__()

    asyncio.run(main())
    assert not eng.is_alive


def test_shutdown_ends_streams(tiny_llama: Path) -> None:
    eng = make(tiny_llama)
    ids = eng.engine.tokenizer.encode(PROMPTS[0])

    async def main() -> None:
        stream = eng.generate(ids, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        await stream.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, eng.shutdown)
        with pytest.raises(EngineDead):
            async for _ in stream:
                pass

    asyncio.run(main())
    assert not eng.is_alive


def test_run_then_calls_right_after_the_finishing_step(tiny_llama: Path) -> None:
    """run_then's fn runs after the step that finished the request and before the next one, even while
    another stream keeps the engine stepping (the prefill worker's KV export relies on it)."""
    eng = make(tiny_llama)
    ids = eng.engine.tokenizer.encode(PROMPTS[0])
    real_step = eng.engine.step
    steps = {"n": 0}

    def counting_step() -> list[RequestOutput]:
        out = real_step()
        steps["n"] += 1
        return out

    eng.engine.step = counting_step  # type: ignore[method-assign]
    finished_at: dict[str, int] = {}
    real_post = eng._post_all

    def post(items: list[tuple[str, object]]) -> None:
        for rid, item in items:
            if isinstance(item, RequestOutput) and item.finished:
                finished_at[rid] = steps["n"]
        real_post(items)  # type: ignore[arg-type]

    eng._post_all = post  # type: ignore[method-assign]

    def read(e: object) -> tuple[int, int]:
        return steps["n"], e.kv.pool.num_cached  # type: ignore[attr-defined]

    async def main() -> None:
        other = asyncio.create_task(collect(eng, PROMPTS_IDS, SamplingParams(temperature=0, max_tokens=120,
                                                                            ignore_eos=True)))
        await asyncio.sleep(0.05)  # the other stream is running
        final, (at, cached) = await eng.run_then(ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                                                 read)
        assert final.finished and len(final.outputs[0].token_ids) == 1
        assert at == finished_at[final.request_id]  # no step in between
        assert cached >= len(ids) // eng.engine.kv.block_size  # the prompt's full blocks are still cached
        with pytest.raises(ZeroDivisionError):  # fn's failure is the caller's; the engine goes on
            await eng.run_then(ids, SamplingParams(temperature=0, max_tokens=1), lambda e: 1 // 0)
        assert len(await other) == 120
        assert eng.is_alive

    PROMPTS_IDS = eng.engine.tokenizer.encode(PROMPTS[1])
    try:
        asyncio.run(main())
    finally:
        eng.shutdown()
