"""The decode worker's KV port and the prefill worker's /internal/kv/prefill against untrusted peers:
transfers must carry the shared secret's HMAC, oversized frames are dropped unallocated, refusals
disclose nothing, and the prefill endpoint is not open on a default server."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq

from conftest import PROMPTS, LiveServer
from tokenloom import LLM, SamplingParams
from tokenloom.disagg.blocks import BlockRecord, KVLayout, KVTransferError, export_prefix
from tokenloom.disagg.transfer import KVReceiver, send_blocks
from tokenloom.disagg.wire import encode_request, sign
from tokenloom.errors import ConfigError

SECRET = "kv-test-secret"
LONG = PROMPTS[3]


@pytest.fixture(scope="module")
def source(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB", max_model_len=256)


@pytest.fixture(scope="module")
def target(tiny_llama: Path) -> Iterator[tuple[LiveServer, KVReceiver]]:
    """A server whose engine has a secret-checking KV receiver."""
    srv = LiveServer(tiny_llama)
    recv = KVReceiver(srv.engine, "127.0.0.1", 0, secret=SECRET).start()
    yield srv, recv
    recv.close()
    srv.close()


@pytest.fixture(scope="module")
def control(tiny_llama: Path) -> Iterator[LiveServer]:
    srv = LiveServer(tiny_llama)
    yield srv
    srv.close()


def _records(src: LLM, ids: list[int], zero: bool = False) -> tuple[KVLayout, list[BlockRecord]]:
    src.generate([ids], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    records = export_prefix(src.engine, ids)
    assert len(records) >= 3
    if zero:  # the attack: correct public block hashes, garbage bytes
        records = [BlockRecord(r.block_hash, r.parent_hash, r.tokens, bytes(len(r.payload))) for r in records]
    return KVLayout.of(src.engine), records


def _raw_send(address: str, frames: list[bytes], timeout_ms: int = 10_000) -> bytes | None:
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send_multipart(frames)
        return sock.recv() if sock.poll(timeout_ms) else None
    finally:
        sock.close(0)


def _complete(url: str, ids: list[int]) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def _num_cached(srv: LiveServer) -> int:
    return srv.engine.call_soon(lambda e: e.kv.pool.num_cached).result(10)


def test_unsigned_or_wrongly_signed_blocks_are_refused_and_the_cache_untouched(
        source: LLM, target: tuple[LiveServer, KVReceiver], control: LiveServer) -> None:
    srv, recv = target
    ids = source.tokenizer.encode("poison " + LONG)
    layout, poison = _records(source, ids, zero=True)
    frames = encode_request(layout, poison)
    before = _num_cached(srv)
    for attempt in (frames, sign(frames, b"another secret"), [*frames, b"\0" * 32], frames[:1]):
        reply = _raw_send(recv.address, attempt)
        assert reply == b'{"ok": false, "error": "unauthorized"}'  # no layout, no counts
    with pytest.raises(KVTransferError, match="unauthorized"):
        send_blocks(recv.address, layout, poison, timeout=10, secret="wrong")
    assert recv.num_transfers == 0 and recv.num_unauthorized == 5
    assert _num_cached(srv) == before
    # The prompt answers as on an untouched server, and computed its whole prompt itself.
    got = _complete(srv.url, ids)
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert got["choices"][0]["text"] == _complete(control.url, ids)["choices"][0]["text"]


def test_signed_transfer_is_accepted(source: LLM, target: tuple[LiveServer, KVReceiver], control: LiveServer) -> None:
    srv, recv = target
    ids = source.tokenizer.encode("genuine " + LONG)
    layout, records = _records(source, ids)
    assert send_blocks(recv.address, layout, records, timeout=30, secret=SECRET) == {"written": len(records),
                                                                                   "present": 0}
    got = _complete(srv.url, ids)
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == min(len(records), (len(ids) - 1) // 16) * 16 > 0
    assert got["choices"][0]["text"] == _complete(control.url, ids)["choices"][0]["text"]


def test_oversized_frame_is_dropped_unallocated(source: LLM, target: tuple[LiveServer, KVReceiver]) -> None:
    srv, recv = target
    assert recv.max_frame < 1 << 20  # tiny model, max_model_len 256: well under a MiB

    def vm(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise AssertionError(field)

    size = 256 << 20
    hwm = vm("VmHWM")
    # A separate process sends it: its own buffer is not counted in ours.
    code = ("import sys, zmq; s = zmq.Context.instance().socket(zmq.REQ); s.setsockopt(zmq.LINGER, 0); "
            f"s.connect({recv.address!r}); s.send_multipart([b'TLKV/1', bytes({size})]); "
            "sys.exit(3 if s.poll(3000) else 0)")
    proc = subprocess.run([sys.executable, "-c", code], timeout=120)
    assert proc.returncode == 0  # no answer: the receiver dropped the connection
    assert vm("VmHWM") - hwm < size // 4
    # A peer that is not a REQ socket (no empty delimiter) does not stop the receiver either.
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(recv.address)
    dealer.send(b"TLKV/1")
    dealer.close(0)
    # Still serving.
    ids = source.tokenizer.encode("after the flood " + LONG)
    layout, records = _records(source, ids)
    assert send_blocks(recv.address, layout, records, timeout=30, secret=SECRET)["written"] == len(records)


def test_receiver_without_secret_binds_loopback_only(target: tuple[LiveServer, KVReceiver]) -> None:
    srv, _ = target
    with pytest.raises(ConfigError, match="kv-secret"):
        KVReceiver(srv.engine, "0.0.0.0", 0)
    KVReceiver(srv.engine, "127.0.0.1", 0).close()  # allowed, with a warning


def test_prefill_endpoint_is_closed_on_a_default_server(control: LiveServer, tiny_llama: Path,
                                                        target: tuple[LiveServer, KVReceiver]) -> None:
    _, recv = target
    body = {"endpoint": "/v1/completions", "request": {"model": "tiny", "prompt": LONG, "max_tokens": 2},
            "kv_target": recv.address, "timeout": 5}
    r = httpx.post(control.url + "/internal/kv/prefill", json=body, timeout=30)  # role both, no API key
    assert r.status_code == 403
    prefill = LiveServer(tiny_llama, role="prefill")
    try:
        app = prefill._server.config.app
        for bad in ("ipc:///tmp/x", "inproc://x", "tcp://127.0.0.1", "tcp://127.0.0.1:0", "tcp://h:99999",
                    "epgm://eth0;239.0.0.1:5555", "tcp://127.0.0.1:1/x"):
            r = httpx.post(prefill.url + "/internal/kv/prefill", json={**body, "kv_target": bad}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == "kv_target", bad
        # Without the receiver's secret: refused, told only "unauthorized".
        r = httpx.post(prefill.url + "/internal/kv/prefill", json=body, timeout=30)
        assert r.status_code == 502 and r.json()["error"]["message"].endswith("unauthorized")
        app.state.kv_secret = SECRET
        r = httpx.post(prefill.url + "/internal/kv/prefill", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["blocks_written"] > 0, r.text
    finally:
        prefill.close()
