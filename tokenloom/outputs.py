"""What the engine returns: per request, one CompletionOutput per sampled sequence (n of them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """A sampled token's log-probability under the model's raw distribution, with its rank and the top-N."""

    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    top: dict[int, float]  # top-N token id -> logprob


@dataclass
class RequestMetrics:
    """Seconds, measured on the engine's monotonic clock."""

    arrival_time: float
    queue_time: float | None = None  # arrival -> first scheduled
    time_to_first_token: float | None = None  # arrival -> first output token
    prefill_time: float = 0.0  # steps spent computing the prompt
    decode_time: float = 0.0  # steps spent producing the later tokens
    e2e_latency: float | None = None  # arrival -> finished
    num_preemptions: int = 0
    num_output_tokens: int = 0  # of the longest of the request's n completions


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """In streaming (delta) form `outputs` carries only what is new since the last one for each index."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    extra: dict[str, object] = field(default_factory=dict)
    error: str | None = None  # set on the final output of a request whose processing failed


def merge_delta(prev: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """Fold a delta into the accumulated output of the same request."""
    if prev is None:
        prev = RequestOutput(delta.request_id, delta.prompt, delta.prompt_token_ids, [], False)
    by_index = {o.index: o for o in prev.outputs}
    for d in delta.outputs:
        cur = by_index.get(d.index)
        if cur is None:
            cur = by_index[d.index] = CompletionOutput(d.index, "", [], logprobs=[] if d.logprobs is not None else None)
        cur.text += d.text
        cur.token_ids.extend(d.token_ids)
        if d.logprobs is not None and cur.logprobs is not None:
            cur.logprobs.extend(d.logprobs)
        cur.cumulative_logprob = d.cumulative_logprob
        cur.finish_reason, cur.stop_reason = d.finish_reason, d.stop_reason
    prev.outputs = [by_index[i] for i in sorted(by_index)]
    prev.finished = delta.finished
    prev.metrics = delta.metrics
    prev.num_cached_tokens = delta.num_cached_tokens
    prev.error = delta.error
    return prev
