"""Disaggregated prefill/decode: KV blocks read out of one engine, checked on the wire, written into
another, and the decode side's output identical to a colocated run."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import torch

from conftest import PROMPTS, LiveServer
from tokenloom import LLM, SamplingParams
from tokenloom.disagg.blocks import (BlockRecord, KVLayout, KVTransferError, export_prefix, import_prefix,
                                     read_blocks, write_blocks)
from tokenloom.disagg.transfer import send_blocks
from tokenloom.disagg.wire import decode_request, encode_request

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PREFILL_ONLY = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
LONG = PROMPTS[3]  # 60-odd tokens: several full blocks of 16


def _llm(model: Path, **kw: object) -> LLM:
    return LLM(str(model), **{"dtype": "float32", "kv_cache_memory": "16MiB", "max_model_len": 256, **kw})


def _prefilled(model: Path, prompt_ids: list[int], **kw: object) -> LLM:
    src = _llm(model, **kw)
    src.generate([prompt_ids], PREFILL_ONLY)
    return src


@pytest.mark.parametrize("cache", [{}, {"kv_cache_dtype": "int8"}, {"kv_cache_dtype": "int8", "kv_cache_scales": "token"}])
def test_blocks_moved_between_engines_give_the_colocated_output(tiny_llama: Path, cache: dict[str, str]) -> None:
    colocated = _llm(tiny_llama, **cache)
    ids = colocated.tokenizer.encode(LONG)
    want = colocated.generate([ids], GREEDY)[0].outputs[0].token_ids

    # Per-head scales: the decode worker serves a longer context than the prefill worker, and still
    # calibrates the same scales (the layouts, digest included, must agree).
    src = _prefilled(tiny_llama, ids, **cache, max_model_len=128)
    records = export_prefix(src.engine, ids)
    assert len(records) == len(ids) // 16 >= 3
    layout, arrived = decode_request(encode_request(KVLayout.of(src.engine), records))

    dst = _llm(tiny_llama, **cache)
    assert import_prefix(dst.engine, layout, arrived) == (len(records), 0)
    dst.engine.kv.pool.check_invariants()
    assert dst.engine.kv.pool.num_cached == len(records)  # held by the cache, by no sequence
    out = dst.generate([ids], GREEDY)[0]
    # The decode side computed only what the blocks do not cover (at least the last prompt token).
    assert out.num_cached_tokens == min(len(records), (len(ids) - 1) // 16) * 16
    assert out.outputs[0].token_ids == want
    # A second import of the same prompt finds every block already there.
    assert import_prefix(dst.engine, layout, arrived) == (0, len(records))
    dst.engine.kv.pool.check_invariants()


def test_import_stops_when_the_pool_is_full_and_keeps_the_prefix(tiny_llama: Path) -> None:
    ids = _llm(tiny_llama).tokenizer.encode(LONG * 3)[:200]
    src = _prefilled(tiny_llama, ids)
    records = export_prefix(src.engine, ids)
    # 2 KiB... float32: 2 layers x 2 (K,V) x 2 heads x 16 dims x 4 bytes x 16 tokens = 8 KiB per block.
    dst = _llm(tiny_llama, kv_cache_memory=str(16 * 8192))
    busy = dst.engine.kv.pool.allocate(dst.engine.kv.pool.num_free - 5)  # others' work, not to be touched
    written, present = import_prefix(dst.engine, KVLayout.of(src.engine), records)
    assert (written, present) == (5, 0) and len(records) > 5
    assert all(dst.engine.kv.pool.ref_counts[b] == 1 for b in busy)
    dst.engine.kv.pool.check_invariants()


def test_a_short_payload_is_refused_before_any_block_is_indexed(tiny_llama: Path) -> None:
    # Blocks are indexed first and written in one pass after: a payload that could not be written must
    # be refused up front, or its block would be found by the next request with stale bytes in it.
    ids = _llm(tiny_llama).tokenizer.encode(LONG)
    src = _prefilled(tiny_llama, ids)
    records = export_prefix(src.engine, ids)
    bad = records[:-1] + [BlockRecord(records[-1].block_hash, records[-1].parent_hash, records[-1].tokens,
                                      records[-1].payload[:-1])]
    dst = _llm(tiny_llama)
    free = dst.engine.kv.pool.num_free
    with pytest.raises(KVTransferError, match="does not match the cache layout"):
        import_prefix(dst.engine, KVLayout.of(src.engine), bad)
    assert dst.engine.kv.pool.num_free == free and dst.engine.kv.pool.num_cached == 0
    dst.engine.kv.pool.check_invariants()


def test_blocks_read_and_written_in_one_pass_equal_block_by_block(tiny_llama: Path) -> None:
    # read_blocks / write_blocks gather and scatter every cache tensor once for all blocks; the payload of
    # each block is its slices of every tensor, layer by layer, as one block at a time would give.
    ids = _llm(tiny_llama).tokenizer.encode(LONG)
    src = _prefilled(tiny_llama, ids)
    caches = src.engine.runner.kv_caches
    blocks = [3, 0, 2]
    want = [b"".join(t[b].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes() for c in caches
                     for t in c.tensors()) for b in blocks]
    assert read_blocks(caches, blocks) == want
    dst = _llm(tiny_llama)
    write_blocks(dst.engine.runner.kv_caches, [5, 1, 4], want)
    assert read_blocks(dst.engine.runner.kv_caches, [5, 1, 4]) == want


def test_wire_rejects_corruption_and_mismatches(tiny_llama: Path) -> None:
    ids = _llm(tiny_llama).tokenizer.encode(LONG)
    src = _prefilled(tiny_llama, ids)
    layout = KVLayout.of(src.engine)
    frames = encode_request(layout, export_prefix(src.engine, ids))

    flipped = bytearray(frames[3])
    flipped[100] ^= 0xFF
    with pytest.raises(KVTransferError, match="SHA-256"):
        decode_request([*frames[:3], bytes(flipped), *frames[4:]])
    with pytest.raises(KVTransferError, match="arrived"):
        decode_request(frames[:-1])
    with pytest.raises(KVTransferError, match="magic"):
        decode_request([b"HTTP/1.1", *frames[1:]])
    # Bytes filed under other tokens: the chained hash no longer matches.
    header = json.loads(frames[1])
    header["blocks"][1]["tokens"][0] += 1
    with pytest.raises(KVTransferError, match="hash does not match"):
        decode_request([frames[0], json.dumps(header).encode(), *frames[2:]])

    other = _llm(tiny_llama, block_size=8)
    with pytest.raises(KVTransferError, match="layout mismatch"):
        import_prefix(other.engine, *decode_request(frames))
    int8 = _llm(tiny_llama, kv_cache_dtype="int8")
    with pytest.raises(KVTransferError, match="layout mismatch"):
        import_prefix(int8.engine, *decode_request(frames))
    # INT8 codes mean the same values only under the same scales: per token against per head, and per
    # head against other per-head scales.
    int8_src = _prefilled(tiny_llama, ids, kv_cache_dtype="int8")
    int8_frames = encode_request(KVLayout.of(int8_src.engine), export_prefix(int8_src.engine, ids))
    assert import_prefix(int8.engine, *decode_request(int8_frames))[0] > 0  # same scales: accepted
    per_token = _llm(tiny_llama, kv_cache_dtype="int8", kv_cache_scales="token")
    with pytest.raises(KVTransferError, match="layout mismatch"):
        import_prefix(per_token.engine, *decode_request(int8_frames))
    other_scales = _llm(tiny_llama, kv_cache_dtype="int8")
    with torch.inference_mode():  # the one (Hkv,) vector under the view: every block sees the change
        other_scales.engine.runner.kv_caches[0].k_scale[0, 0, 0] *= 2
    with pytest.raises(KVTransferError, match="layout mismatch"):
        import_prefix(other_scales.engine, *decode_request(int8_frames))


def test_block_hashes_agree_across_processes() -> None:
    """Workers are separate processes: a prompt's chained block hashes must not depend on the process
    (Python 3.11's hash(None) does: it is address-based)."""
    import subprocess
    import sys

    from tokenloom.engine.kv_cache_manager import hash_block

    code = "from tokenloom.engine.kv_cache_manager import hash_block as h; print(h(None, (1, 2)), h(h(None, (1, 2)), (3,)))"
    theirs = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    first = hash_block(None, (1, 2))
    assert [int(x) for x in theirs] == [first, hash_block(first, (3,))]


def test_send_to_nobody_times_out_with_a_clear_error(tiny_llama: Path) -> None:
    from tokenloom.netutil import free_port

    src = _prefilled(tiny_llama, [5, 6, 7] * 10)
    records = export_prefix(src.engine, [5, 6, 7] * 10)
    t = time.monotonic()
    with pytest.raises(KVTransferError, match="no answer"):
        send_blocks(f"tcp://127.0.0.1:{free_port()}", KVLayout.of(src.engine), records, timeout=0.5)
    assert time.monotonic() - t < 10


@pytest.fixture(scope="module")
def pair(tiny_llama: Path) -> "tuple[LiveServer, LiveServer]":
    p, d = LiveServer(tiny_llama, role="prefill"), LiveServer(tiny_llama, role="decode")
    yield p, d
    p.close()
    d.close()


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_prefill_worker_ships_blocks_and_decode_worker_continues(pair: "tuple[LiveServer, LiveServer]",
                                                                 endpoint: str) -> None:
    prefill, decode = pair
    health = httpx.get(decode.url + "/health").json()
    assert health["role"] == "decode" and health["kv_address"].startswith("tcp://127.0.0.1:")
    if endpoint == "/v1/chat/completions":
        body = {"model": "tiny", "messages": [{"role": "user", "content": LONG}], "max_tokens": 12,
                "temperature": 0}
    else:
        body = {"model": "tiny", "prompt": LONG + " once more", "max_tokens": 12, "temperature": 0}
    # The colocated answer: the prefill worker serving the whole request itself.
    want = httpx.post(prefill.url + endpoint, json=body, timeout=60).json()
    r = httpx.post(prefill.url + "/internal/kv/prefill", timeout=60,
                   json={"endpoint": endpoint, "request": body, "kv_target": health["kv_address"]})
    assert r.status_code == 200, r.text
    shipped = r.json()
    assert shipped["blocks_sent"] >= 3 and shipped["blocks_written"] + shipped["blocks_present"] == shipped["blocks_sent"]
    got = httpx.post(decode.url + endpoint, json=body, timeout=60).json()
    cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == min(shipped["blocks_sent"], (got["usage"]["prompt_tokens"] - 1) // 16) * 16 > 0
    key = "message" if endpoint == "/v1/chat/completions" else None
    pick = (lambda c: c["message"]["content"]) if key else (lambda c: c["text"])
    assert pick(got["choices"][0]) == pick(want["choices"][0])


def test_prefill_endpoint_errors(pair: "tuple[LiveServer, LiveServer]") -> None:
    prefill, decode = pair
    body = {"model": "tiny", "prompt": LONG, "max_tokens": 4}
    r = httpx.post(decode.url + "/internal/kv/prefill", json={"endpoint": "/v1/completions", "request": body,
                                                              "kv_target": "tcp://127.0.0.1:1"})
    assert r.status_code == 400 and "role decode" in r.json()["error"]["message"]
    r = httpx.post(prefill.url + "/internal/kv/prefill", json={"endpoint": "/v1/completions",
                                                               "request": {**body, "model": "nope"},
                                                               "kv_target": "tcp://127.0.0.1:1"})
    assert r.status_code == 404
    from tokenloom.netutil import free_port

    r = httpx.post(prefill.url + "/internal/kv/prefill", timeout=30,
                   json={"endpoint": "/v1/completions", "request": body,
                         "kv_target": f"tcp://127.0.0.1:{free_port()}", "timeout": 0.5})
    assert r.status_code == 502 and r.json()["error"]["type"] == "kv_transfer_error"


def _stream_text(url: str, endpoint: str, body: dict) -> str:
    text = ""
    with httpx.stream("POST", url + endpoint, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


def test_router_splits_prefill_and_decode_with_the_colocated_output(pair: "tuple[LiveServer, LiveServer]") -> None:
    from router_helpers import router_metrics, start_router

    prefill, decode = pair
    router = start_router([decode.url], prefill_workers=(prefill.url,))
    try:
        health = httpx.get(router.url + "/health").json()
        assert health["prefill_workers"][0]["healthy"] and health["workers"][0]["url"] == decode.url
        for i, endpoint in enumerate(["/v1/chat/completions", "/v1/completions"]):
            prompt = f"{i} router split {LONG}"  # a prompt neither worker has seen
            body: dict = ({"messages": [{"role": "user", "content": prompt}]} if i == 0 else {"prompt": prompt})
            body.update(model="tiny", max_tokens=12, temperature=0)
            pick = (lambda c: c["message"]["content"]) if i == 0 else (lambda c: c["text"])
            got = httpx.post(router.url + endpoint, json=body, timeout=60).json()
            # Only the last, partial block was computed by the decode worker.
            assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == (got["usage"]["prompt_tokens"] - 1) // 16 * 16 > 0
            want = httpx.post(prefill.url + endpoint, json=body, timeout=60).json()  # colocated: one worker does all
            assert pick(got["choices"][0]) == pick(want["choices"][0])
            streamed = {**body, "messages": [{"role": "user", "content": "s" + prompt}]} if i == 0 else \
                {**body, "prompt": "s" + prompt}
            assert _stream_text(router.url, endpoint, streamed) == _stream_text(prefill.url, endpoint, streamed)
        # An Ollama request goes straight to the decode worker, which prefills it itself.
        r = httpx.post(router.url + "/api/generate", timeout=60,
                       json={"model": "tiny", "prompt": LONG, "stream": False, "options": {"num_predict": 4}})
        assert r.status_code == 200
        # A bad request is the decode worker's to answer; its prefill is counted as rejected.
        r = httpx.post(router.url + "/v1/completions", json={"model": "nope", "prompt": LONG, "max_tokens": 2})
        assert r.status_code == 404
        m = router_metrics(router)
        assert m[f"tokenloom:router_kv_prefills_total{{outcome=ok,worker={prefill.url}}}"] == 4
        assert m[f"tokenloom:router_kv_prefills_total{{outcome=rejected,worker={prefill.url}}}"] == 1
        assert m[f"tokenloom:router_kv_transfer_bytes_total{{worker={prefill.url}}}"] > 0
    finally:
        router.close()


def test_router_without_a_live_prefill_worker_lets_decode_compute(pair: "tuple[LiveServer, LiveServer]") -> None:
    from router_helpers import router_metrics, start_router

    from tokenloom.netutil import free_port

    prefill, decode = pair
    router = start_router([decode.url], prefill_workers=(f"http://127.0.0.1:{free_port()}",))
    try:
        body = {"model": "tiny", "prompt": "no prefill worker " + LONG, "max_tokens": 8, "temperature": 0}
        got = httpx.post(router.url + "/v1/completions", json=body, timeout=60).json()
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # decode computed it all
        want = httpx.post(prefill.url + "/v1/completions", json=body, timeout=60).json()
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert router_metrics(router)["tokenloom:router_kv_prefills_total{outcome=skipped,worker=none}"] == 1
    finally:
        router.close()


@pytest.mark.cluster
def test_cluster_command_starts_prefill_and_decode_workers(tiny_llama: Path, tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    from router_helpers import samples

    from tokenloom.netutil import free_port, wait_until_healthy

    port = free_port()
    log = tmp_path / "cluster.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tokenloom.cli", "cluster", "--workers", "1", "--prefill-workers",
                                 "1", "--port", str(port), "--model", str(tiny_llama), "--served-model-name", "tiny",
                                 "--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "256",
                                 "--num-threads", "1", "--health-interval", "0.5"], stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, timeout=180, alive=lambda: proc.poll() is None)
        health = httpx.get(url + "/health").json()
        decode_url, prefill_url = health["workers"][0]["url"], health["prefill_workers"][0]["url"]
        assert httpx.get(decode_url + "/health").json()["role"] == "decode"
        assert httpx.get(prefill_url + "/health").json()["role"] == "prefill"
        body = {"model": "tiny", "prompt": LONG, "max_tokens": 6, "temperature": 0}
        got = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == (got["usage"]["prompt_tokens"] - 1) // 16 * 16
        m = samples(httpx.get(url + "/metrics").text)
        assert m[f"tokenloom:router_kv_prefills_total{{outcome=ok,worker={prefill_url}}}"] == 1
    except Exception:
        print(log.read_text()[-3000:])
        raise
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
