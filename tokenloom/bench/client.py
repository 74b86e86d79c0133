"""Streaming HTTP clients for the load generator: one coroutine per request, one RequestRecord out.

A token's arrival is a streamed chunk that carries one (text or not: a chunk may hold the first bytes
of a character split across tokens), as in vLLM's benchmark; TTFT is the first such arrival.

Backends: `openai` (/v1/completions), `openai-chat` (/v1/chat/completions), `ollama` (/api/generate,
raw). Token counts come from the server where it reports them (OpenAI usage via
stream_options.include_usage, Ollama's eval_count), else from the number of text-bearing chunks.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx

from tokenloom.bench.stats import RequestRecord
from tokenloom.errors import ConfigError

BACKENDS = ("openai", "openai-chat", "ollama")


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    input_tokens: int  # by the benchmark's tokenizer (the server's count replaces it when reported)
    output_tokens: int
    messages: tuple[dict[str, str], ...] = ()  # openai-chat: the whole conversation (else one user turn)


async def send(client: httpx.AsyncClient, backend: str, model: str, req: BenchRequest,
               ignore_eos: bool = True, extra_body: dict[str, object] | None = None) -> RequestRecord:
    """One streamed request. `extra_body`: fields merged into the request body last (tools, response_format,
    ...; they override the benchmark's own, e.g. {"ignore_eos": false, "min_tokens": 0})."""
    rec = RequestRecord(start=time.perf_counter(), input_tokens=req.input_tokens)
    try:
        if backend == "ollama":
            await _ollama(client, model, req, rec, extra_body or {})
        else:
            await _openai(client, backend, model, req, rec, ignore_eos, extra_body or {})
        rec.end = time.perf_counter()
        rec.success = rec.first_token is not None
        if not rec.success and not rec.error:
            rec.error = "no tokens received"
    except (httpx.HTTPError, ValueError, KeyError) as e:
        rec.end = time.perf_counter()
        rec.error = f"{type(e).__name__}: {e}"[:300]
    return rec


def _token_arrived(rec: RequestRecord) -> None:
    now = time.perf_counter()
    if rec.first_token is None:
        rec.first_token = now
    rec.chunk_times.append(now)


async def _openai(client: httpx.AsyncClient, backend: str, model: str, req: BenchRequest, rec: RequestRecord,
                  ignore_eos: bool, extra_body: dict[str, object]) -> None:
    body: dict[str, object] = {"model": model, "max_tokens": req.output_tokens, "temperature": 0.0, "stream": True,
                               "stream_options": {"include_usage": True}}
    if ignore_eos:
        # Exactly output_tokens from every server: ignore_eos (vLLM, tokenloom) and min_tokens (vLLM,
        # tokenloom, llama.cpp's server); servers ignore the fields they do not know.
        body["ignore_eos"] = True
        body["min_tokens"] = req.output_tokens
    if backend == "openai-chat":
        body["messages"] = list(req.messages) or [{"role": "user", "content": req.prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = req.prompt
        path = "/v1/completions"
    body.update(extra_body)
    chunks = 0
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                rec.error = str(chunk["error"])[:300]
                return
            for c in chunk.get("choices") or []:
                # As vLLM's benchmark: every completion chunk is a token arrival, even with empty text
                # (bytes of a split UTF-8 character); for chat, every content delta but the role opener.
                delta = c.get("delta") or {}
                if backend == "openai" or ("content" in delta and not ("role" in delta and not delta["content"])):
                    piece = c.get("text") or delta.get("content") or ""
                    if c.get("finish_reason") and not piece:
                        continue  # a closing chunk that carries no token
                    rec.text += piece
                    chunks += 1
                    _token_arrived(rec)
            usage = chunk.get("usage")
            if usage:
                rec.output_tokens = int(usage.get("completion_tokens") or 0)
                rec.input_tokens = int(usage.get("prompt_tokens") or rec.input_tokens)
    if not rec.output_tokens:
        rec.output_tokens = chunks


async def _ollama(client: httpx.AsyncClient, model: str, req: BenchRequest, rec: RequestRecord,
                  extra_body: dict[str, object]) -> None:
    body: dict[str, object] = {"model": model, "prompt": req.prompt, "raw": True, "stream": True,
                               "options": {"num_predict": req.output_tokens, "temperature": 0.0}}
    body.update(extra_body)
    chunks = 0
    async with client.stream("POST", "/api/generate", json=body) as r:
        if r.status_code != 200:
            rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            return
        async for line in r.aiter_lines():
            if not line.strip():
                continue
            obj = json.loads(line)
            if "error" in obj:
                rec.error = str(obj["error"])[:300]
                return
            if not obj.get("done"):
                rec.text += obj.get("response") or ""
                chunks += 1
                _token_arrived(rec)
            if obj.get("done"):
                rec.output_tokens = int(obj.get("eval_count") or chunks)
                rec.input_tokens = int(obj.get("prompt_eval_count") or rec.input_tokens)
                if obj.get("prompt_eval_duration") is not None:
                    rec.server_prefill_s = obj["prompt_eval_duration"] / 1e9
                if obj.get("eval_duration") is not None:
                    rec.server_decode_s = obj["eval_duration"] / 1e9
    if not rec.output_tokens:
        rec.output_tokens = chunks


class ServerTokenizer:
    """The server's own tokenizer over vLLM's /tokenize and /detokenize (tokenloom and vLLM serve them):
    exact prompt lengths for a model whose tokenizer files are not at hand (`--tokenizer server`)."""

    def __init__(self, base_url: str, model: str | None = None, timeout: float = 60.0) -> None:
        self._client = httpx.Client(base_url=base_url, timeout=timeout)
        self._model = model

    def _post(self, path: str, body: dict[str, object]) -> dict[str, object]:
        if self._model is not None:
            body["model"] = self._model
        r = self._client.post(path, json=body)
        if r.status_code != 200:
            raise ConfigError(f"--tokenizer server: {path} answered HTTP {r.status_code}: {r.text[:200]}")
        return r.json()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._post("/tokenize", {"prompt": text, "add_special_tokens": add_special_tokens})["tokens"])  # type: ignore[call-overload]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._post("/detokenize", {"tokens": list(ids)})["prompt"])
