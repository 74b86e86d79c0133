"""The prefill worker's side of disaggregated serving: POST /internal/kv/prefill.

The router sends the client's request here (with the decode worker's KV address) before sending it
to the decode worker. This worker computes the prompt exactly as the endpoint would tokenize it,
reads the prompt's full KV blocks out of its cache and ships them (`disagg.transfer`). The decode
worker then finds them in its prefix cache and computes only the last, partial block.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal

import pydantic
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from tokenloom.disagg.blocks import KVLayout, KVTransferError, export_prefix
from tokenloom.disagg.transfer import send_blocks
from tokenloom.engine.async_engine import AsyncLLMEngine
from tokenloom.errors import InvalidRequest
from tokenloom.sampling_params import SamplingParams
from tokenloom.serve.errors import error_body
from tokenloom.serve.frontend import Frontend
from tokenloom.serve.protocol import ChatCompletionRequest, CompletionRequest

router = APIRouter()


class PrefillRequest(BaseModel):
    endpoint: Literal["/v1/completions", "/v1/chat/completions"]
    request: dict[str, Any]  # the client's body, as it will be sent to the decode worker
    kv_target: str  # the decode worker's KV receiver, tcp://host:port (its /health says)
    timeout: float = 30.0


@router.post("/internal/kv/prefill")
async def prefill(body: PrefillRequest, request: Request) -> Any:
    fe: Frontend = request.app.state.frontend
    engine: AsyncLLMEngine = fe.engine
    if request.app.state.role == "decode":
        raise InvalidRequest("this worker runs --role decode; send prefills to a prefill (or both) worker")
    try:
        if body.endpoint == "/v1/chat/completions":
            chat = ChatCompletionRequest.model_validate(body.request)
            model, prompts = chat.model, [fe.chat_ids(chat.messages, chat.add_generation_prompt)]
        else:
            comp = CompletionRequest.model_validate(body.request)
            model, prompts = comp.model, fe.completion_prompts(comp.prompt)[1]
    except pydantic.ValidationError as e:
        raise InvalidRequest(f"request: {e.errors()[0].get('msg', 'invalid')}", "request") from e
    fe.check_model(model)
    start = time.monotonic()
    sent = written = present = nbytes = 0
    layout = await engine.call(KVLayout.of)
    for ids in prompts:
        # One token computes the whole prompt; its blocks stay in this worker's prefix cache.
        async for _ in engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)):
            pass
        records = await engine.call(lambda e, ids=ids: export_prefix(e, ids))
        try:
            reply = await asyncio.to_thread(send_blocks, body.kv_target, layout, records, body.timeout)
        except KVTransferError as e:
            return JSONResponse(error_body(str(e), "kv_transfer_error", "kv_target", 502), status_code=502)
        sent += len(records)
        nbytes += sum(len(r.payload) for r in records)
        written += reply["written"]
        present += reply["present"]
    return {"prompt_tokens": [len(p) for p in prompts], "blocks_sent": sent, "bytes": nbytes,
            "blocks_written": written, "blocks_present": present,
            "seconds": round(time.monotonic() - start, 4)}
