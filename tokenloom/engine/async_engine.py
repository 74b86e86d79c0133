"""AsyncLLMEngine: the engine loop in its own thread, streams handed to asyncio callers.

HTTP handlers (or any asyncio code) call `generate(...)` and iterate delta outputs. The loop thread owns
the LLMEngine: it applies queued adds/aborts between steps, runs `step()`, and posts each output to the
caller's asyncio queue. HTTP work therefore never starves the engine, and the engine never blocks the
event loop. Leaving the iteration early (a client disconnect) aborts the request and frees its blocks.
A request whose processing fails inside a step (engine/scheduler.py `update`) ends alone, with
`RequestFailed`; the engine goes on. If a step itself raises (the model's forward: shared state), the engine
is marked dead: every stream ends with `EngineDead` and new requests fail.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from tokenloom.config import EngineConfig
from tokenloom.engine.engine import LLMEngine
from tokenloom.engine.sequence import Request
from tokenloom.engine.step_trace import StepTrace
from tokenloom.errors import EngineDead, InvalidRequest, Overloaded, RequestFailed
from tokenloom.models.config import ModelConfig
from tokenloom.outputs import RequestOutput
from tokenloom.sampling_params import SamplingParams
from tokenloom.tokenizer import Tokenizer

log = logging.getLogger("tokenloom.async_engine")


@dataclass
class _Add:
    request: Request  # validated on the caller's thread (LLMEngine.process_request)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    """Run `fn(engine)` between two steps, on the loop thread (the KV cache is the loop's alone)."""

    fn: Callable[[LLMEngine], Any]
    future: "concurrent.futures.Future[Any]"


@dataclass(frozen=True)
class ModelInfo:
    """What the HTTP layer reports about the loaded model (Ollama's /api/tags and /api/show), read once so
    that no handler reaches into the engine the loop thread owns."""

    name: str
    path: Path  # the model folder or .gguf file
    dtype: str  # "bfloat16", "float32", ...
    num_parameters: int

    @classmethod
    def of(cls, engine: LLMEngine) -> "ModelInfo":
        loaded = engine.loaded
        return cls(loaded.name, loaded.path, str(loaded.dtype).removeprefix("torch."),
                   sum(p.numel() for p in loaded.model.parameters()))


class _Stream(NamedTuple):
    """A caller's stream."""

    loop: asyncio.AbstractEventLoop
    queue: "asyncio.Queue[RequestOutput | BaseException]"
    n: int  # the sequences its request runs: what admission counts
    then: _Call | None  # run on the loop thread as soon as the request finishes (`run_then`)

T = TypeVar("T")
StepHook = Callable[[LLMEngine, list[RequestOutput]], None]  # runs on the engine thread after each step


def _deliver(batch: list[tuple["asyncio.Queue[Any]", Any]]) -> None:
    """On the caller's event loop: put each item on its stream's queue, in the engine's order."""
    for q, item in batch:
        q.put_nowait(item)


class AsyncLLMEngine:
    def __init__(
        self,
        engine: LLMEngine | Callable[[], LLMEngine],
        max_waiting: int | None = None,
        on_step: StepHook | None = None,
        max_n: int | None = None,
        step_trace: StepTrace | None = None,
    ) -> None:
        """`engine`: a built LLMEngine, or (better) a factory the loop thread calls to build it there.

        Build it on the loop thread where possible: torch's OpenMP pool belongs to the thread that first
        runs a parallel region, and a second pool (model loaded on one thread, stepped on another)
        oversubscribes the cores; libgomp then throttles its spin-waits and single-stream decode runs at
        about half speed on a 2-core machine (docs/performance-notes.md#openmp-thread-pools).
        `max_waiting`: how many sequences may wait beyond the `max_num_seqs` that run at once (a request
        counts its n sequences); more are refused with Overloaded (the HTTP layer's 429). `max_n`: the
        largest n one request may ask for (InvalidRequest beyond it). `on_step` sees every step's outputs
        (and the final output of each aborted request): the metrics hook. `step_trace`: where each step's
        timings go (engine/step_trace.py); closed by `shutdown`."""
        self.max_waiting = max_waiting
        self.step_trace = step_trace
        self._traced: tuple[list[tuple[int, int]], int, float, float, float] | None = None
        self.max_n = max_n
        self.on_step = on_step
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Call | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._num_seqs = 0  # sequences of the requests in _streams: what admission counts
        self._lock = threading.Lock()  # guards _streams, _num_seqs and _dead across the two threads
        self._dead: BaseException | None = None
        self._ids = itertools.count()
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        factory: Callable[[], LLMEngine] = (lambda: engine) if isinstance(engine, LLMEngine) else engine
        self._thread = threading.Thread(target=self._run, args=(factory,), name="tokenloom-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._init_error is not None:
            raise self._init_error

    @classmethod
    def from_config(
        cls, config: EngineConfig, max_waiting: int | None = None, on_step: StepHook | None = None,
        max_n: int | None = None, step_trace: StepTrace | None = None,
    ) -> "AsyncLLMEngine":
        """Load the model and run the engine on the loop thread."""
        return cls(lambda: LLMEngine(config), max_waiting, on_step, max_n, step_trace)

    # -- caller side (any thread with an asyncio loop) --------------------------------------------

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    @property
    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._streams)

    # Set when the engine was built and never reassigned: safe to read from any thread.
    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.model_config

    @cached_property
    def model_info(self) -> ModelInfo:
        return ModelInfo.of(self.engine)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        prompt: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield delta outputs until the request finishes. Validation errors raise before anything runs."""
        async for out in self._generate(prompt_token_ids, params, request_id, prompt, priority, None):
            yield out

    async def run_then(self, prompt_token_ids: list[int], params: SamplingParams,
                       fn: Callable[[LLMEngine], T]) -> tuple[RequestOutput, T]:
        """Run a request to its end, then `fn(engine)` on the loop thread right after the step that finished
        it, before the next step runs; returns (the final delta output, fn's result). The prefill worker
        exports a prompt's KV blocks this way (serve/kv_api.py): a `call` queued once the final output
        reached the caller would wait behind the whole next step (a batch of other prompts when prefills
        queue; docs/benchmarks.md, "The prefill worker's waits"), and that step might evict the blocks.
        An error or abort raises as in `generate`, and then `fn` does not run."""
        then = _Call(fn, concurrent.futures.Future())
        final: RequestOutput | None = None
        async for out in self._generate(prompt_token_ids, params, None, None, 0, then):
            final = out
        if final is None:  # generate always ends with a finished output or raises
            raise RuntimeError("the request ended without an output")
        # Done already: the loop thread ran it before it posted the final output.
        return final, await asyncio.wrap_future(then.future)

    async def _generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None,
                        prompt: str | None, priority: int, then: _Call | None) -> AsyncIterator[RequestOutput]:
        if not self.is_alive:
            raise EngineDead(f"the engine is not running ({self._dead!r})")
        if self.max_n is not None and params.n > self.max_n:
            raise InvalidRequest(f"n must be at most {self.max_n} on this server (--max-n), got {params.n}", "n")
        rid = request_id if request_id is not None else f"async-{next(self._ids)}"
        if params.structured is not None:  # compiled off the event loop and the engine thread (then cached)
            grammar = await asyncio.to_thread(lambda: self.engine.grammar)
            await asyncio.wrap_future(grammar.compile_async(params.structured))
        # Validated and copied here, once: process_request reads nothing a step changes.
        req = self.engine.process_request(prompt_token_ids, params, rid, prompt, priority)
        q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        with self._lock:
            if rid in self._streams:
                raise InvalidRequest(f"request id {rid!r} is already in use", "request_id")
            # Sequences, not requests, count: a request with n = 100 occupies what 100 requests would.
            limit = None if self.max_waiting is None else self.engine.config.max_num_seqs + self.max_waiting
            if limit is not None and self._num_seqs + params.n > limit:
                raise Overloaded(f"{self._num_seqs} sequences in flight; {params.n} more would overfill the "
                                 f"{self.engine.config.max_num_seqs} running and {self.max_waiting} waiting")
            self._streams[rid] = _Stream(asyncio.get_running_loop(), q, params.n, then)
            self._num_seqs += params.n
        self._inbox.put(_Add(req))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._drop(request_id)
        self._inbox.put(_Abort(request_id))

    def call_soon(self, fn: Callable[[LLMEngine], T]) -> "concurrent.futures.Future[T]":
        """Run `fn(engine)` on the loop thread between steps (any thread may call this); the future
        holds its result or exception. Used to read and write KV blocks without racing a step."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        if not self.is_alive:
            fut.set_exception(EngineDead(f"the engine is not running ({self._dead!r})"))
            return fut
        self._inbox.put(_Call(fn, fut))
        if not self.is_alive:  # died between the check and the put: the loop will never see it
            try:
                fut.set_exception(EngineDead(f"the engine is not running ({self._dead!r})"))
            except concurrent.futures.InvalidStateError:
                pass
        return fut

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        return await asyncio.wrap_future(self.call_soon(fn))

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the loop thread: in-flight requests are aborted and their streams end with EngineDead."""
        self._inbox.put(None)
        self._thread.join(timeout)
        if self.step_trace is not None and not self._thread.is_alive():
            self.step_trace.close()

    # -- engine thread ------------------------------------------------------------------------------

    def _run(self, factory: Callable[[], LLMEngine]) -> None:
        try:
            self.engine = factory()
        except BaseException as e:  # noqa: BLE001 - handed to the constructor's caller
            self._init_error = e
            self._dead = e
            return
        finally:
            self._ready.set()
        if self.step_trace is not None:
            self.engine.step_listener = self._on_traced_step
        self._loop()

    def _on_traced_step(self, rows: list[tuple[int, int]], streamed: int, t0: float, t1: float, t2: float) -> None:
        self._traced = (rows, streamed, t0, t1, t2)

    def _loop(self) -> None:
        try:
            while True:
                loop_start = time.monotonic()
                # Block for work only when the engine is idle; otherwise just drain what has arrived.
                block = idle = not self.engine.has_unfinished_requests()
                if idle and self.step_trace is not None:
                    self.step_trace.flush()
                while True:
                    try:
                        cmd = self._inbox.get(block=block)
                    except queue.Empty:
                        break
                    block = False
                    if cmd is None:
                        self._fail(EngineDead("the engine was shut down"))
                        return
                    self._apply(cmd)
                if idle:  # it waited for work: the iteration's host time starts when the work came
                    loop_start = time.monotonic()
                self._traced = None  # steps a queued call ran (warm-up) are not the loop's
                step_start = time.monotonic()
                outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
                # The hook first: posting wakes the callers' event loop, whose streaming then contends with
                # this thread for the GIL; the metrics are this thread's own work and go before it.
                self._hook(outputs)
                self._post_all([(out.request_id, RequestFailed(out.error) if out.error is not None else out)
                                for out in outputs])
                if self._traced is not None and self.step_trace is not None:
                    rows, streamed, t0, t1, t2 = self._traced
                    self.step_trace.write(loop_start, step_start, t0, t1, t2, time.monotonic(), rows, streamed)
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine; callers must hear of it
            log.exception("engine loop died")
            self._fail(EngineDead(f"the engine loop died: {e!r}"))

    def _hook(self, outputs: list[RequestOutput]) -> None:
        if self.on_step is not None:
            self.on_step(self.engine, outputs)

    def _apply(self, cmd: _Add | _Abort | _Call) -> None:
        if isinstance(cmd, _Call):
            if cmd.future.set_running_or_notify_cancel():
                try:
                    cmd.future.set_result(cmd.fn(self.engine))
                except Exception as e:  # the caller's failure, not the engine's
                    cmd.future.set_exception(e)
            return
        if isinstance(cmd, _Abort):
            final = self.engine.abort_request(cmd.request_id)
            if final is not None:
                self._hook([final])
            return
        rid = cmd.request.request_id
        with self._lock:
            wanted = rid in self._streams
        if not wanted:  # aborted before it was ever queued
            return
        try:
            self.engine.add(cmd.request)
        except Exception as e:  # a request the engine refuses fails alone
            self._post(rid, e)

    def _post(self, request_id: str, item: RequestOutput | BaseException) -> None:
        self._post_all([(request_id, item)])

    def _post_all(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand each item to its request's stream: one wake-up per event loop for the whole step, not one per
        request (each `call_soon_threadsafe` writes the loop's self-pipe and wakes its thread, which then
        contends for the GIL with this one: at 64 rows that was a millisecond-scale cost per step)."""
        if not items:
            return
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], Any]]] = {}
        thens: list[_Call] = []
        with self._lock:
            for request_id, item in items:
                stream = self._streams.get(request_id)
                if stream is None:
                    continue
                if isinstance(item, BaseException) or item.finished:
                    self._drop(request_id)
                    if stream.then is not None and not isinstance(item, BaseException):
                        thens.append(stream.then)
                batches.setdefault(stream.loop, []).append((stream.queue, item))
        for then in thens:  # before the final outputs go out: the caller finds each result ready
            self._apply(then)
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # the caller's event loop is closed: nobody is listening
                pass

    def _drop(self, request_id: str) -> None:
        """Forget a stream (call with the lock held)."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._num_seqs -= stream.n

    def _fail(self, err: BaseException) -> None:
        with self._lock:
            self._dead = err
            streams = list(self._streams.items())
            self._streams.clear()
            self._num_seqs = 0
        for rid, stream in streams:
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, err)
            except RuntimeError:
                pass
            self.engine.abort_request(rid)
        while True:  # calls queued behind the failure must not wait forever
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Call) and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(err)
