"""The offline Python API: `LLM(model).generate(prompts, params)`, `.chat(messages)`, `.stream(prompt)`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import fields
from typing import Any, Union

from tokenloom.config import EngineConfig
from tokenloom.engine.engine import LLMEngine
from tokenloom.errors import InvalidRequest, RequestFailed
from tokenloom.outputs import CompletionOutput, RequestOutput, merge_delta
from tokenloom.sampling_params import SamplingParams
from tokenloom.tokenizer import Message, Tokenizer

PromptType = Union[str, list[int]]


class LLM:
    """Loads a model once and generates for many prompts with continuous batching.

    Keyword arguments are `EngineConfig` fields: dtype, block_size, kv_cache_memory, max_model_len,
    max_num_seqs, max_num_batched_tokens, attention_backend, fused_decode, prepack_weights, quantization, kv_cache_dtype,
    kv_cache_scales, enable_prefix_caching, speculative, seed, num_threads, device.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        known = {f.name for f in fields(EngineConfig)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown LLM option(s): {', '.join(sorted(unknown))}")
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def stats(self) -> dict[str, float]:
        """Engine counters: steps, tokens, preemptions, prefix-cache queries/hits (tokens), KV blocks."""
        return self.engine.get_stats()

    def reset_prefix_cache(self) -> int:
        """Forget the cached prefixes no running request uses; returns the number of blocks freed."""
        return self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order, each complete. A request
        whose processing failed inside the engine comes back with `error` set and finish_reason "error";
        the others are unaffected."""
        batch = self._normalise(prompts)
        params = self._params(sampling_params, len(batch))
        prios = list(priority) if priority is not None else [0] * len(batch)
        if len(prios) != len(batch):
            raise InvalidRequest(f"priority has {len(prios)} entries for {len(batch)} prompts", "priority")
        # Validate all before queueing any.
        reqs = [self.engine.process_request(self._encode(p), sp, prompt=p if isinstance(p, str) else None, priority=pr)
                for p, sp, pr in zip(batch, params, prios)]
        ids_order = [self.engine.add(r) for r in reqs]
        done: dict[str, RequestOutput] = {}
        acc: dict[str, RequestOutput] = {}
        try:
            while len(done) < len(ids_order):
                for out in self.engine.step():
                    merged = merge_delta(acc.get(out.request_id), out)
                    acc[out.request_id] = merged
                    if out.finished:
                        done[out.request_id] = merged
        finally:
            for rid in ids_order:  # an exception (e.g. KeyboardInterrupt) must not leave requests queued
                if rid not in done:
                    self.engine.abort_request(rid)
        return [done[rid] for rid in ids_order]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; each rendered with the model's chat template."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode_chat(c) for c in convs]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[CompletionOutput]:
        """Yield deltas (new text and token ids) of a single completion as they are produced."""
        params = sampling_params or SamplingParams()
        if params.n != 1:
            raise InvalidRequest("stream() serves one completion; use n=1", "n")
        rid = self.engine.add_request(self._encode(prompt), params, prompt=prompt if isinstance(prompt, str) else None)
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id == rid:
                        finished = out.finished
                        if out.error is not None:
                            raise RequestFailed(f"request {rid} failed: {out.error}")
                        yield from out.outputs
        finally:
            if not finished:
                self.engine.abort_request(rid)

    def stream_chat(self, messages: list[Message], sampling_params: SamplingParams | None = None) -> Iterator[CompletionOutput]:
        return self.stream(self.tokenizer.encode_chat(messages), sampling_params)

    # -- helpers ----------------------------------------------------------------------------

    @staticmethod
    def _normalise(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]  # a single prompt of token ids
        out = list(prompts)
        if not out:
            raise InvalidRequest("no prompts given", "prompts")
        return out  # type: ignore[return-value]

    @staticmethod
    def _params(sp: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams()] * n
        if isinstance(sp, SamplingParams):
            return [sp] * n
        if len(sp) != n:
            raise InvalidRequest(f"{len(sp)} sampling params for {n} prompts", "sampling_params")
        return list(sp)

    def _encode(self, prompt: PromptType) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list):
            return prompt
        raise InvalidRequest(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}", "prompt")
