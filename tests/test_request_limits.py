"""Request size limits (413 before the body is read) and tokenization off the event loop (/health answers
while a prompt of a few MB is tokenized)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest

from conftest import LiveServer

LIMIT = 4 << 20
BIG = 1 << 20  # prompts longer than this are held by the gate


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[LiveServer]:
    srv = LiveServer(tiny_llama, max_request_bytes=LIMIT)
    yield srv
    srv.close()


def raw_request(url: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, Any]]:
    """Send the headers and only `body` (however large Content-Length says the body is), read the answer."""
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: {u.hostname}\r\n{head}\r\n".encode() + body)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    head_bytes, payload = data.split(b"\r\n\r\n", 1)
    return int(head_bytes.split()[1]), json.loads(payload)


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            return int(v)
    return 1 << 62


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_content_length_over_the_limit_is_413_before_the_body_is_read(server: LiveServer, path: str) -> None:
    status, body = raw_request(server.url, path, {"Content-Type": "application/json",
                                                  "Content-Length": str(LIMIT + 1)}, b'{"model": ')
    assert status == 413
    err = body["error"]
    assert err["type"] == "request_too_large" and err["code"] == 413 and str(LIMIT) in err["message"]


@pytest.mark.parametrize("path", ["/api/generate", "/api/chat"])
def test_content_length_over_the_limit_is_413_in_ollama_shape(server: LiveServer, path: str) -> None:
    status, body = raw_request(server.url, path, {"Content-Type": "application/json",
                                                  "Content-Length": str(20 << 20)}, b"{")
    assert status == 413
    assert isinstance(body["error"], str) and str(LIMIT) in body["error"]


def _chunks(total: int, size: int = 1 << 20) -> Iterator[bytes]:
    """A JSON completion body of `total` bytes or so, in chunks (Transfer-Encoding: chunked)."""
    yield b'{"model": "tiny", "max_tokens": 1, "prompt": "'
    sent = 0
    while sent < total:
        yield b"a" * size
        sent += size
    yield b'"}'


@pytest.mark.parametrize("path, ollama", [("/v1/completions", False), ("/api/generate", True)])
def test_chunked_body_growing_past_the_limit_is_413(server: LiveServer, path: str, ollama: bool) -> None:
    r = httpx.post(server.url + path, content=_chunks(LIMIT + (1 << 20)),
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert "content-length" not in r.request.headers  # really sent chunked
    assert r.status_code == 413
    err = r.json()["error"]
    if ollama:
        assert isinstance(err, str) and str(LIMIT) in err
    else:
        assert err["type"] == "request_too_large" and err["code"] == 413


def test_bodies_under_the_limit_work(server: LiveServer) -> None:
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(server.url + "/v1/completions", content=_chunks(LIMIT - (2 << 20)),
                   headers={"Content-Type": "application/json"}, timeout=60)  # chunked, under the limit
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"  # too long for the model, not 413
    r = httpx.post(server.url + "/api/generate", json={"model": "tiny", "prompt": "Hello", "stream": False,
                                                       "options": {"num_predict": 2}}, timeout=60)
    assert r.status_code == 200, r.text


class Gate:
    """The tokenizer backend, except that encoding a big text waits until the test lets it go: the request is
    then held in the middle of its tokenization while the test asks /health."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.started = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def _hold(self, n: int) -> None:
        if n > BIG:
            self.started.set()
            assert self.release.wait(60), "the gate was never released"

    def encode(self, text: str, *args: Any, **kwargs: Any) -> Any:
        self._hold(len(text))
        return self._backend.encode(text, *args, **kwargs)

    def encode_batch(self, texts: list[str], *args: Any, **kwargs: Any) -> Any:
        self._hold(sum(len(t) for t in texts))
        return self._backend.encode_batch(texts, *args, **kwargs)


BIG_TEXT = "The quick brown fox jumps over the lazy dog. " * 70_000  # ~3 MB, under LIMIT


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "tiny", "prompt": BIG_TEXT, "max_tokens": 1}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": BIG_TEXT}], "max_tokens": 1}),
    ("/api/generate", {"model": "tiny", "prompt": BIG_TEXT, "stream": False}),
    ("/api/chat", {"model": "tiny", "messages": [{"role": "user", "content": BIG_TEXT}], "stream": False}),
    ("/tokenize", {"model": "tiny", "prompt": BIG_TEXT}),
])
def test_health_answers_while_a_big_prompt_is_tokenized(server: LiveServer, path: str, body: dict[str, Any]) -> None:
    tok = server.engine.tokenizer
    gate = Gate(tok.backend)
    tok.backend = gate

    async def main() -> tuple[httpx.Response, httpx.Response, bool]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            big = asyncio.ensure_future(c.post(path, json=body))
            try:
                assert await asyncio.to_thread(gate.started.wait, 60), "the big prompt was never tokenized"
                # The big request is now inside its tokenization, which cannot finish before release: with
                # the tokenizer on the event loop, the loop would be stuck there and /health would not answer.
                health = await c.get("/health", timeout=20)
                pending = not big.done()
            finally:
                gate.release.set()
            return health, await big, pending

    try:
        health, big, pending = asyncio.run(main())
    finally:
        tok.backend = gate._backend
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert pending  # /health answered before the big request completed
    if path == "/tokenize":
        assert big.status_code == 200 and big.json()["count"] > 100_000
    else:  # tokenized in full, then refused as too long for the model
        assert big.status_code == 400, big.text
        assert "256" in json.dumps(big.json()["error"])
