"""Bad input is a clean 400 (or 404/405) in the API's own error shape, never a plain-text 500: lone
surrogates, out-of-range seeds and token ids, malformed content parts, bad prefill timeouts, unknown
routes, unparsable bodies and values of the wrong JSON type."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from conftest import LiveServer
from tokenloom.errors import InvalidRequest
from tokenloom.sampling_params import SamplingParams

MODEL = "tiny"
BAD = "a\\ud800b"  # as written in the JSON text: a lone high surrogate


@pytest.fixture(scope="module")
def url(live_server: LiveServer) -> str:
    return live_server.url


def post_raw(url: str, path: str, text: str | bytes) -> httpx.Response:
    return httpx.post(url + path, content=text, headers={"content-type": "application/json"}, timeout=60)


def openai_error(r: httpx.Response, status: int = 400, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def ollama_error(r: httpx.Response, status: int = 400) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"]
    return body["error"]


# -- item 5: lone surrogates --------------------------------------------------------------------------

@pytest.mark.parametrize("path,text,param", [
    ("/v1/completions", f'{{"model": "tiny", "prompt": "{BAD}", "max_tokens": 2}}', "prompt"),
    ("/v1/completions", f'{{"model": "tiny", "prompt": ["ok", "{BAD}"], "max_tokens": 2}}', "prompt.1"),
    ("/v1/completions", f'{{"model": "tiny", "prompt": "x", "stop": ["{BAD}"], "max_tokens": 2}}', "stop.0"),
    ("/v1/chat/completions", f'{{"model": "tiny", "messages": [{{"role": "user", "content": "{BAD}"}}]}}',
     "messages.0.content"),
    ("/v1/chat/completions", f'{{"model": "tiny", "messages": [{{"role": "user", "content": '
                             f'[{{"type": "text", "text": "{BAD}"}}]}}]}}', "messages.0.content.0.text"),
    ("/tokenize", f'{{"prompt": "{BAD}"}}', "prompt"),
    ("/tokenize", f'{{"messages": [{{"role": "user", "content": "{BAD}"}}]}}', "messages.0.content"),
])
def test_lone_surrogate_is_400_naming_the_field(url: str, path: str, text: str, param: str) -> None:
    err = openai_error(post_raw(url, path, text), 400, param)
    assert "surrogate" in err["message"]


@pytest.mark.parametrize("path,text", [
    ("/api/generate", f'{{"model": "tiny", "prompt": "{BAD}", "stream": false}}'),
    ("/api/chat", f'{{"model": "tiny", "messages": [{{"role": "user", "content": "{BAD}"}}], "stream": false}}'),
])
def test_lone_surrogate_ollama(url: str, path: str, text: str) -> None:
    assert "surrogate" in ollama_error(post_raw(url, path, text))


def test_lone_surrogate_in_prefill_request(url: str) -> None:
    text = (f'{{"endpoint": "/v1/completions", "kv_target": "tcp://127.0.0.1:1", '
            f'"request": {{"model": "tiny", "prompt": "{BAD}"}}}}')
    openai_error(post_raw(url, "/internal/kv/prefill", text), 400, "request.prompt")


# -- item 5: seeds and stop_token_ids outside int64 ---------------------------------------------------

@pytest.mark.parametrize("seed,n", [(2**70, 1), (-(2**63) - 1, 1), (2**64 - 1, 2), (2**63 - 1, 2)])
def test_seed_outside_int64(seed: int, n: int) -> None:
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(seed=seed, n=n)
    assert e.value.field == "seed"


def test_seed_at_the_int64_bounds_is_accepted() -> None:
    SamplingParams(seed=2**63 - 1)
    SamplingParams(seed=2**63 - 2, n=2)
    SamplingParams(seed=-(2**63), n=3)


def test_stop_token_ids_outside_int64() -> None:
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(stop_token_ids=(2**70,))
    assert e.value.field == "stop_token_ids"


@pytest.mark.parametrize("extra,param", [
    ({"seed": 2**70}, "seed"), ({"seed": -(2**63) - 1}, "seed"), ({"seed": 2**64 - 1, "n": 2}, "seed"),
    ({"seed": 2**63 - 1, "n": 2}, "seed"), ({"stop_token_ids": [2**70]}, "stop_token_ids.0"),
])
def test_seed_and_stop_ids_over_http(url: str, extra: dict[str, Any], param: str) -> None:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, **extra}, timeout=60)
    openai_error(r, 400, param)
    r = httpx.post(url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **extra})
    openai_error(r, 400, param)


def test_ollama_seed_outside_int64(url: str) -> None:
    r = httpx.post(url + "/api/generate", timeout=60,
                   json={"model": MODEL, "prompt": "x", "stream": False, "options": {"seed": 2**70, "num_predict": 2}})
    assert "seed" in ollama_error(r)


def test_largest_seed_still_serves(url: str) -> None:
    r = httpx.post(url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "x", "max_tokens": 2, "seed": 2**63 - 2, "n": 2})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2


# -- item 5: content parts ----------------------------------------------------------------------------

@pytest.mark.parametrize("part,param", [
    ({"type": "text", "text": 123}, "messages.1.content.0.text"),
    ({"type": "text", "text": None}, "messages.1.content.0.text"),
    ({"type": "text"}, "messages.1.content.0.text"), ({"text": "no type"}, "messages.1.content.0.type"),
])
def test_bad_text_part_is_400_on_the_message(url: str, part: dict[str, Any], param: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [part]}],
            "max_tokens": 2}
    openai_error(httpx.post(url + "/v1/chat/completions", json=body, timeout=60), 400, param)


def test_image_parts_are_400_saying_text_only(url: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                                      {"type": "image_url", "image_url": {}}]}],
            "max_tokens": 2}
    err = openai_error(httpx.post(url + "/v1/chat/completions", json=body, timeout=60), 400, "messages.0.content")
    assert "text only" in err["message"]


def test_good_text_parts_still_work(url: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "H"},
                                                                      {"type": "text", "text": "i"}]}],
            "max_tokens": 2}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


# -- item 5: /internal/kv/prefill timeout --------------------------------------------------------------

@pytest.mark.parametrize("timeout", ["NaN", "Infinity", "-Infinity", "1e300", "0", "-1", "600.5", '"5"', "true"])
def test_prefill_timeout_out_of_range(url: str, timeout: str) -> None:
    text = ('{"endpoint": "/v1/completions", "kv_target": "tcp://127.0.0.1:1", '
            f'"request": {{"model": "tiny", "prompt": "x"}}, "timeout": {timeout}}}')
    openai_error(post_raw(url, "/internal/kv/prefill", text), 400, "timeout")


# -- item 11: 404, 405, unparsable bodies ---------------------------------------------------------------

def test_unknown_route_and_method(url: str) -> None:
    err = openai_error(httpx.get(url + "/v1/nope"), 404)
    assert err["type"] == "not_found_error" and "/v1/nope" in err["message"]
    r = httpx.get(url + "/v1/completions")
    err = openai_error(r, 405)
    assert "GET" in err["message"] and "POST" in r.headers.get("allow", "")
    assert ollama_error(httpx.get(url + "/api/nope"), 404)
    assert ollama_error(httpx.get(url + "/api/generate"), 405)


BODIES = {
    "invalid JSON": b'{"model": "tiny", "prompt": ',
    "invalid UTF-8": b'{"model": "tiny", "prompt": "\xff\xfe"}',
    "deeply nested": ("[" * 100_000 + "]" * 100_000).encode(),
    "not an object": b'[1, 2]',
}


@pytest.mark.parametrize("what", list(BODIES))
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_unparsable_body_openai(url: str, path: str, what: str) -> None:
    openai_error(post_raw(url, path, BODIES[what]), 400)


@pytest.mark.parametrize("what", list(BODIES))
@pytest.mark.parametrize("path", ["/api/generate", "/api/chat"])
def test_unparsable_body_ollama(url: str, path: str, what: str) -> None:
    ollama_error(post_raw(url, path, BODIES[what]))


def test_invalid_json_has_no_position_as_param(url: str) -> None:
    err = openai_error(post_raw(url, "/v1/completions", BODIES["invalid JSON"]), 400)
    assert err["param"] is None and "JSON" in err["message"]


# -- item 11: strict JSON types -------------------------------------------------------------------------

@pytest.mark.parametrize("extra,param", [
    ({"n": "2"}, "n"), ({"n": 2.0}, "n"), ({"n": True}, "n"), ({"stream": "yes"}, "stream"),
    ({"stream": 1}, "stream"), ({"max_tokens": "2"}, "max_tokens"), ({"seed": "1"}, "seed"),
    ({"temperature": "0.5"}, "temperature"), ({"temperature": True}, "temperature"),
])
def test_no_coercion(url: str, extra: dict[str, Any], param: str) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, **extra}
    err = openai_error(httpx.post(url + "/v1/completions", json=body, timeout=60), 400)
    assert err["param"] is not None and err["param"].split(".")[0] == param


@pytest.mark.parametrize("prompt", [[True, False], [[1, True]], [1.0, 2.0], ["x", 1]])
def test_prompt_items_are_strict(url: str, prompt: Any) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    err = openai_error(httpx.post(url + "/v1/completions", json=body, timeout=60), 400)
    assert err["param"].startswith("prompt")


def test_ollama_stream_is_strict(url: str) -> None:
    r = httpx.post(url + "/api/generate", json={"model": MODEL, "prompt": "x", "stream": "no"}, timeout=60)
    assert "stream" in ollama_error(r)


def test_ints_still_accepted_for_floats(url: str) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "temperature": 1, "top_p": 1, "presence_penalty": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(url + "/api/generate", timeout=60,
                   json={"model": MODEL, "prompt": "x", "stream": False, "options": {"temperature": 0, "num_predict": 2}})
    assert r.status_code == 200, r.text
    assert json.loads(r.text)["done"] is True
