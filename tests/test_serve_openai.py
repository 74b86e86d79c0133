"""The OpenAI-compatible server against the official `openai` client, on 127.0.0.1."""

from __future__ import annotations

import httpx
import openai
import pytest

from conftest import LiveServer

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(live_server: LiveServer) -> str:
    return live_server.url


@pytest.fixture()
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="unused")


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_completion_stream_equals_non_stream(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0.8, seed=7,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)  # type: ignore[arg-type]
    text = full.choices[0].text
    assert full.usage is not None and full.usage.completion_tokens == 12
    assert full.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))  # type: ignore[arg-type]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_completion_tokens=10,
              temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)  # type: ignore[arg-type]
    assert full.choices[0].message.role == "assistant" and full.usage is not None
    assert full.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(stream=True, **kw))  # type: ignore[arg-type]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    timing = chunks[-1].model_extra["metrics"]  # type: ignore[index]
    assert timing["time_to_first_token"] > 0 and timing["prefill_time"] > 0 and timing["queue_time"] >= 0
    assert full.model_extra["metrics"]["decode_time"] > 0  # type: ignore[index]


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)


def test_errors(server: str, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1000)
    assert "1000" in str(e.value) and "256" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert e.value.body["param"] == "temperature"  # type: ignore[index]
    r = httpx.post(server + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": "many"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_completion_prompt_forms_n_and_echo(client: openai.OpenAI, live_server: LiveServer) -> None:
    tok = live_server.engine.engine.tokenizer
    ids = tok.encode("The quick brown fox")
    by_text = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=5, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text
    many = client.completions.create(model=MODEL, prompt=["The quick brown fox", "Hello"], max_tokens=5,
                                     temperature=0.8, seed=3, n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.usage is not None and many.usage.completion_tokens == 4 * 5
    assert many.usage.prompt_tokens == len(ids) + len(tok.encode("Hello"))
    echo = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, echo=True, logprobs=2)
    assert echo.choices[0].text.startswith("Hello") and echo.choices[0].logprobs is not None
    assert len(echo.choices[0].logprobs.token_logprobs or []) == 3
