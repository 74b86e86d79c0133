"""The KV transfer wire format: one ZeroMQ multipart message per prompt, one reply.

Request (prefill worker -> decode worker):
    frame 0   b"TLKV/1"                              magic and version
    frame 1   UTF-8 JSON header:
              {"layout": {"model", "num_layers", "num_kv_heads", "head_dim", "block_size", "cache_dtype",
                          "kv_scales"},
               "blocks": [{"hash": int, "parent_hash": int | null, "tokens": [int, ...],
                           "nbytes": int, "sha256": hex}, ...]}
    frame 2+i the bytes of block i: for each layer, the block's slice of K, V (and, with per-token INT8
              scales, kv_scales "token", of the K and V scales), each (block_size, num_kv_heads,
              head_dim) or (block_size, num_kv_heads), C order, little-endian, in the cache's dtype.
              Per-head scales (kv_scales "head:<digest>") never travel: the digest must match.
    last      with a shared secret (`serve --kv-secret`, or the --api-key): the 32-byte HMAC-SHA256, keyed
              by the secret, over every frame before it, each as its 8-byte big-endian length then its bytes
              (`sign`). A receiver with a secret checks it (`verify`, hmac.compare_digest) before it parses
              anything else, and answers a missing or wrong one with only "unauthorized".
Reply (decode worker -> prefill worker): one UTF-8 JSON frame,
    {"ok": true, "written": int, "present": int} or {"ok": false, "error": str}.

Checks on arrival (`decode_request`), before a byte reaches the cache: the magic; one frame per block;
each frame's length and SHA-256 against the header; each block's hash recomputed from its parent's hash
and its tokens (the prefix cache's chained hash: the bytes are filed under the tokens they belong to);
the chain unbroken from the first block; block size and bytes per block against the layout (counted as
the cache is sized: `KVLayout.spec`, an engine/kv_cache.py `KVCacheSpec`). The
receiver also checks the layout against its own cache (`blocks.import_prefix`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from tokenloom.disagg.blocks import BlockRecord, KVLayout, KVTransferError
from tokenloom.engine.kv_cache_manager import hash_block

MAGIC = b"TLKV/1"
MAC_BYTES = 32  # HMAC-SHA256
UNAUTHORIZED = "unauthorized"  # all a peer without the secret is told


class KVUnauthorized(KVTransferError):
    """A transfer without a valid HMAC (no secret, or another one)."""

    def __init__(self) -> None:
        super().__init__(UNAUTHORIZED)


def secret_bytes(secret: str | bytes | None) -> bytes | None:
    """The HMAC key for a secret given as text (a flag) or bytes; None or empty: no secret."""
    if not secret:
        return None
    return secret.encode() if isinstance(secret, str) else bytes(secret)


def mac(secret: bytes, frames: list[bytes]) -> bytes:
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for f in frames:
        h.update(len(f).to_bytes(8, "big"))
        h.update(f)
    return h.digest()


def sign(frames: list[bytes], secret: bytes | None) -> list[bytes]:
    """`frames` with their HMAC appended (unchanged without a secret)."""
    return frames if secret is None else [*frames, mac(secret, frames)]


def verify(frames: list[bytes], secret: bytes | None) -> list[bytes]:
    """The frames without their HMAC, after checking it; KVUnauthorized when it is missing or wrong. Only
    the magic is looked at before the check (no header is parsed, no layout disclosed)."""
    if secret is None:
        return frames
    if len(frames) < 3 or frames[0] != MAGIC or len(frames[-1]) != MAC_BYTES:
        raise KVUnauthorized()
    if not hmac.compare_digest(mac(secret, frames[:-1]), frames[-1]):
        raise KVUnauthorized()
    return frames[:-1]


def encode_request(layout: KVLayout, records: list[BlockRecord]) -> list[bytes]:
    header = {
        "layout": layout.to_json(),
        "blocks": [{"hash": r.block_hash, "parent_hash": r.parent_hash, "tokens": list(r.tokens),
                    "nbytes": len(r.payload), "sha256": hashlib.sha256(r.payload).hexdigest()} for r in records],
    }
    return [MAGIC, json.dumps(header).encode(), *(r.payload for r in records)]


def decode_request(frames: list[bytes]) -> tuple[KVLayout, list[BlockRecord]]:
    if len(frames) < 2 or frames[0] != MAGIC:
        raise KVTransferError("not a tokenloom KV transfer (bad magic or too few frames)")
    try:
        header: dict[str, Any] = json.loads(frames[1])
        layout = KVLayout(**header["layout"])
        metas: list[dict[str, Any]] = header["blocks"]
    except (ValueError, KeyError, TypeError) as e:
        raise KVTransferError(f"bad KV transfer header: {e}") from e
    payloads = frames[2:]
    if len(payloads) != len(metas):
        raise KVTransferError(f"header names {len(metas)} blocks, {len(payloads)} arrived")
    records: list[BlockRecord] = []
    parent: int | None = None
    for i, (m, data) in enumerate(zip(metas, payloads)):
        tokens = tuple(int(t) for t in m["tokens"])
        if len(tokens) != layout.block_size:
            raise KVTransferError(f"block {i}: {len(tokens)} tokens, the block size is {layout.block_size}")
        if m["parent_hash"] != parent:
            raise KVTransferError(f"block {i}: its parent is not the block before it")
        if hash_block(parent, tokens) != m["hash"]:
            raise KVTransferError(f"block {i}: hash does not match its tokens and parent")
        if len(data) != m["nbytes"] or len(data) != layout.block_nbytes:
            raise KVTransferError(f"block {i}: {len(data)} bytes, expected {layout.block_nbytes}")
        if hashlib.sha256(data).hexdigest() != m["sha256"]:
            raise KVTransferError(f"block {i}: bytes corrupted in transit (SHA-256 mismatch)")
        records.append(BlockRecord(m["hash"], parent, tokens, bytes(data)))
        parent = m["hash"]
    return layout, records


def encode_reply(ok: bool, **fields: Any) -> bytes:
    return json.dumps({"ok": ok, **fields}).encode()


def decode_reply(frame: bytes) -> dict[str, Any]:
    try:
        reply: dict[str, Any] = json.loads(frame)
    except ValueError as e:
        raise KVTransferError(f"bad reply from the decode worker: {e}") from e
    if not reply.get("ok"):
        raise KVTransferError(f"the decode worker refused the KV blocks: {reply.get('error', 'no reason given')}")
    return reply
