"""The prefill worker's side of disaggregated serving: POST /internal/kv/prefill.

The router sends the client's request here (with the decode worker's KV address) before sending it
to the decode worker. This worker computes the prompt exactly as the endpoint would tokenize it,
reads the prompt's full KV blocks out of its cache and ships them (`disagg.transfer`). The decode
worker then finds them in its prefix cache and computes only the last, partial block.

Who may call it: a server with --api-key has every non-health path behind the key (app.py's middleware).
Without a key, only a `--role prefill` worker serves it (a `--role both` server answers 403), so a
default server does not compute prompts and open connections on anyone's behalf. The kv_target must be a
tcp://host:port address (no other ZeroMQ transport); the send has a bounded timeout, and is signed with
the worker's KV secret (`app.state.kv_secret`: --kv-secret, else --api-key), which the receiver checks.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal

import pydantic
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field, StrictFloat

from tokenloom.disagg.blocks import KVLayout, KVTransferError, export_prefix
from tokenloom.disagg.transfer import send_blocks
from tokenloom.engine.async_engine import AsyncLLMEngine
from tokenloom.errors import InvalidRequest
from tokenloom.sampling_params import SamplingParams
from tokenloom.serve.errors import error_body
from tokenloom.serve.frontend import Frontend
from tokenloom.serve.protocol import Body, ChatCompletionRequest, CompletionRequest

router = APIRouter()


MAX_TIMEOUT = 600.0  # seconds; the transfer's timeout must be in (0, MAX_TIMEOUT]
# tcp://host:port only: a host name, IPv4 address or [IPv6] address, and a port in 1..65535.
_PORT = r"(?:6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3})"  # 1..65535
KV_TARGET = rf"^tcp://(?:[A-Za-z0-9][A-Za-z0-9.-]{{0,252}}|\[[0-9A-Fa-f:.]{{2,45}}\]):{_PORT}$"


class PrefillRequest(Body):  # unknown fields are 400s, as on every route
    endpoint: Literal["/v1/completions", "/v1/chat/completions"]
    request: dict[str, Any]  # the client's body, as it will be sent to the decode worker
    # The decode worker's KV receiver, tcp://host:port (its /health says); declared as a pattern so the
    # OpenAPI document says which values are accepted.
    kv_target: str = Field(pattern=KV_TARGET)
    # Seconds for the block transfer: finite, > 0 and at most MAX_TIMEOUT (NaN, inf, 1e300, -1 are 400s).
    timeout: StrictFloat = Field(30.0, gt=0, le=MAX_TIMEOUT, allow_inf_nan=False)


async def _layout(state: Any, engine: AsyncLLMEngine) -> KVLayout:
    """This worker's KV layout, read once on the loop thread and kept: it is fixed at start-up (shapes,
    dtype, the per-head INT8 scales calibrated while loading). Asked for per request, it waited for the
    step in flight: a whole batched prefill when prompts queue (docs/benchmarks.md, "The prefill worker's
    waits")."""
    layout = getattr(state, "kv_layout", None)
    if layout is None:
        layout = state.kv_layout = await engine.call(KVLayout.of)
    return layout


@router.post("/internal/kv/prefill")
async def prefill(body: PrefillRequest, request: Request) -> Any:
    fe: Frontend = request.app.state.frontend
    engine: AsyncLLMEngine = fe.engine
    if request.app.state.role == "decode":
        raise InvalidRequest("this worker runs --role decode; send prefills to a prefill (or both) worker")
    try:
        if body.endpoint == "/v1/chat/completions":
            chat: ChatCompletionRequest | None = ChatCompletionRequest.model_validate(body.request)
        else:
            comp = CompletionRequest.model_validate(body.request)
            chat = None
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, InvalidRequest):  # e.g. a lone surrogate: name the inner field
            raise InvalidRequest(str(cause), f"request.{cause.field}" if cause.field else "request") from e
        loc = ".".join(str(p) for p in first.get("loc", ()))
        param = f"request.{loc}" if loc else "request"
        raise InvalidRequest(f"{param}: {first.get('msg', 'invalid')}", param) from e
    # Tokenized off the event loop, exactly as the decode worker's endpoint will (tools and template kwargs
    # included), so the blocks sent are the ones it looks up.
    if chat is not None:
        model, prompts = chat.model, [await fe.chat_ids_async(chat.messages, chat.add_generation_prompt, chat.tools,
                                                              chat.chat_template_kwargs,
                                                              chat.continue_final_message)]
    else:
        model, prompts = comp.model, (await fe.completion_prompts_async(comp.prompt))[1]
    fe.check_model(model)
    state = request.app.state
    if state.role != "prefill" and getattr(state, "api_key", None) is None:
        # Validated above (so a bad body is the same 400 everywhere), refused before any work is done.
        return JSONResponse(error_body("/internal/kv/prefill is served only by --role prefill workers (or behind "
                                       "--api-key)", "permission_error", None, 403), status_code=403)
    secret = getattr(state, "kv_secret", None)
    start = time.monotonic()
    sent = written = present = nbytes = 0
    layout = await _layout(state, engine)
    for ids in prompts:
        # One token computes the whole prompt; its blocks, cached when it finishes, are read right after that
        # step, before the next one could evict them.
        _, records = await engine.run_then(ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                                           lambda e, ids=ids: export_prefix(e, ids))
        try:
            reply = await asyncio.to_thread(send_blocks, body.kv_target, layout, records, body.timeout, secret)
        except KVTransferError as e:
            return JSONResponse(error_body(str(e), "kv_transfer_error", "kv_target", 502), status_code=502)
        sent += len(records)
        nbytes += sum(len(r.payload) for r in records)
        written += reply["written"]
        present += reply["present"]
    return {"prompt_tokens": [len(p) for p in prompts], "blocks_sent": sent, "bytes": nbytes,
            "blocks_written": written, "blocks_present": present,
            "seconds": round(time.monotonic() - start, 4)}
