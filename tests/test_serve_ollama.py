"""The Ollama-compatible API against the official `ollama` Python client."""

from __future__ import annotations

import json

import httpx
import ollama
import pytest

from conftest import LiveServer


@pytest.fixture()
def client(live_server: LiveServer) -> ollama.Client:
    return ollama.Client(host=live_server.url)


def test_generate_stream_equals_non_stream_and_counts(client: ollama.Client, live_server: LiveServer) -> None:
    opts = {"temperature": 0.7, "seed": 11, "num_predict": 9, "top_k": 20}
    full = client.generate(model="tiny", prompt="Hello there", options=opts, stream=False)
    assert full.done and full.eval_count is not None and full.eval_count <= 9
    tok = live_server.engine.engine.tokenizer
    assert full.prompt_eval_count == len(tok.encode_chat([{"role": "user", "content": "Hello there"}]))
    for field in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(getattr(full, field), int)
    assert full.total_duration > 0 and full.prompt_eval_duration > 0
    assert full.total_duration >= full.prompt_eval_duration
    parts = list(client.generate(model="tiny", prompt="Hello there", options=opts, stream=True))
    assert "".join(p.response for p in parts) == full.response
    assert parts[-1].done and parts[-1].eval_count == full.eval_count
    assert all(not p.done for p in parts[:-1])


def test_chat_stream_and_not(client: ollama.Client) -> None:
    msgs = [{"role": "user", "content": "Say something"}]
    opts = {"temperature": 0, "num_predict": 6}
    full = client.chat(model="tiny:latest", messages=msgs, options=opts, stream=False)
    assert full.message.role == "assistant" and full.done
    parts = list(client.chat(model="tiny", messages=msgs, options=opts, stream=True))
    assert "".join(p.message.content for p in parts) == full.message.content
    assert parts[-1].done_reason in ("stop", "length")


def test_tags_show_version(client: ollama.Client, live_server: LiveServer) -> None:
    assert [m.model for m in client.list().models] == ["tiny"]
    show = client.show("tiny")
    assert show.modelinfo is not None and show.modelinfo["llama.block_count"] == 2
    assert httpx.get(live_server.url + "/api/version").json()["version"]


def test_errors_are_ollama_shaped(client: ollama.Client, live_server: LiveServer) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="missing", prompt="x")
    assert e.value.status_code == 404
    r = httpx.post(live_server.url + "/api/generate", json={"model": "tiny", "prompt": "x", "options": {"num_ctx": 2}})
    assert r.status_code == 400 and isinstance(r.json()["error"], str)
    r = httpx.post(live_server.url + "/api/chat", json={"model": "tiny", "messages": "nope"})
    assert r.status_code == 400 and "messages" in r.json()["error"]


def test_a_body_sent_as_a_form_is_read_as_json(live_server: LiveServer) -> None:
    """Ollama's own examples (`curl .../api/chat -d '{...}'`) send the JSON as a form; Ollama reads it as JSON,
    and so does tokenloom on /api/*."""
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "stream": False,
                       "options": {"num_predict": 3}})
    r = httpx.post(live_server.url + "/api/chat", content=body,
                   headers={"content-type": "application/x-www-form-urlencoded"}, timeout=60)
    assert r.status_code == 200 and r.json()["done"] is True, r.text
