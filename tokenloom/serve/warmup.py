"""One streamed request through the HTTP app before the server listens (after the engine's warm-up,
engine/warmup.py).

The engine's warm-up runs its shapes through `LLMEngine.step()`; the first request a server answers paid
about 20-40 ms more on top, in the serving path (on a 2-core Xeon with AMX, SmolLM2 Q4_1: the first of six
streamed completions 1.6-1.8x the later ones' TTFT with or without engine warm-up; in-process through the
app, 82-93 ms against about 52; after one request through the app, 0.93-1.0x; docs/benchmarks.md, "The
first request after start-up"). So a request goes through the app itself (httpx's ASGI transport: every
middleware, route, tokenizer call, the async engine and the stream; not the socket), in its own event loop,
and leaves nothing behind: no /metrics sample, no access-log line, no cached prompt, counters at zero.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
from fastapi import FastAPI

from tokenloom.engine.warmup import reset_counters

# A few tokens and one output token: it fits any --max-model-len a model can be served with.
_PROMPT = "Hello"


async def _one_request(app: FastAPI, api_key: str | None) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": app.state.model_name, "prompt": _PROMPT, "max_tokens": 1, "stream": True}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://warm-up",
                                 timeout=300) as client:
        async with client.stream("POST", "/v1/completions", headers=headers, json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"warm-up request through the app: HTTP {r.status_code}: {await r.aread()!r}")
            async for _ in r.aiter_lines():
                pass


def warm_up_app(app: FastAPI, api_key: str | None) -> float:
    """Send the request (the engine idle, the server not listening yet); seconds it took."""
    engine = app.state.engine
    on_step = engine.on_step  # the serving metrics' hook: this request is not a user's
    access = logging.getLogger("tokenloom.access")
    level = access.level
    engine.on_step, start = None, time.monotonic()
    access.setLevel(logging.WARNING)
    try:
        asyncio.run(_one_request(app, api_key))
    finally:
        engine.on_step = on_step
        access.setLevel(level)
    engine.call_soon(reset_counters).result()
    return time.monotonic() - start
