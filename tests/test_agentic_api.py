"""Agentic API end to end: structured outputs, tool calls (named, required, auto through the Hermes parser,
streamed and not), a two-turn tool loop, Ollama's format/tools, batch isolation of constraints, the 400s of
rejected fields and the sampling extras, against a live server with the unmodified `openai` and `ollama`
clients. The model is random and tiny, so its text is gibberish: what is checked is that every constraint
holds and that the API's shapes and round trips are right."""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Optional, Union

import httpx
import ollama
import openai
import pytest
from pydantic import BaseModel, Field

from conftest import LiveServer, make_tiny_model

MODEL = "tiny"

# A short Hermes / Qwen2.5-style template: tools in the system turn, assistant tool calls as <tool_call>
# blocks, tool results as <tool_response> blocks inside a user turn.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{%- endif %}"
    "# Tools\n{%- for tool in tools %}\n<tools>{{ tool | tojson }}</tools>{%- endfor %}<|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{%- elif message['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "<|im_start|>assistant\n{{ message['content'] or '' }}"
    "{%- for call in message['tool_calls'] %}"
    "<tool_call>\n{\"name\": \"{{ call['function']['name'] }}\", \"arguments\": "
    "{{ call['function']['arguments'] | tojson }}}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}, "hours": {"type": "integer"}},
    "required": ["zone", "hours"],
    "additionalProperties": False,
}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                 "parameters": WEATHER_PARAMS}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
                                              "parameters": TIME_PARAMS}}
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


# -- fixtures -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = make_tiny_model(tmp_path_factory.mktemp("agentic"), max_position_embeddings=1024)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = HERMES_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def srv(model_dir: Path) -> Iterator[LiveServer]:
    server = LiveServer(model_dir, max_model_len=1024, kv_cache_memory="64MiB")
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(srv: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tok(srv: LiveServer) -> Any:
    return srv.engine.engine.tokenizer


def _validate(instance: Any, schema: dict[str, Any]) -> None:
    import jsonschema_rs

    jsonschema_rs.validate(schema, instance)


# -- 1, 2: structured outputs through the SDK's parse() and json_object --------------------------------

class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    street: str = Field(max_length=6)
    number: int


class Person(BaseModel):  # nested objects
    name: str = Field(max_length=6)
    address: Address


class Paint(BaseModel):  # enums: a Literal and an Enum
    color: Color
    finish: Literal["matte", "gloss"]


class Basket(BaseModel):  # a list of objects
    items: list[Address] = Field(max_length=3)
    tags: list[str] = Field(max_length=3)


class Code(BaseModel):  # a string with a regex pattern
    code: str = Field(pattern=r"^[A-Z]{2}-[0-9]{3}$")


class Maybe(BaseModel):  # Optional and a Union (anyOf)
    note: Optional[str] = Field(max_length=5)
    value: Union[int, bool]


@pytest.mark.parametrize("schema", [Person, Paint, Basket, Code, Maybe], ids=lambda s: s.__name__)
def test_parse_pydantic(client: openai.OpenAI, schema: type[BaseModel]) -> None:
    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Fill the form."}],
                                      response_format=schema, max_tokens=400, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    parsed = choice.message.parsed
    assert isinstance(parsed, schema)
    assert schema.model_validate_json(choice.message.content or "") == parsed
    if schema is Code:
        assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", parsed.code)  # type: ignore[attr-defined]


def test_parse_stream_helper(client: openai.OpenAI) -> None:
    """The SDK's streaming helper parses the reassembled stream into the same object as parse()."""
    kw: dict[str, Any] = dict(model=MODEL, messages=[{"role": "user", "content": "Paint it."}],
                              response_format=Paint, max_tokens=400, temperature=0)
    whole = client.chat.completions.parse(**kw)
    with client.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.parsed == whole.choices[0].message.parsed
    assert isinstance(final.choices[0].message.parsed, Paint)


def test_json_object(client: openai.OpenAI) -> None:
    for seed in (1, 2):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Some JSON"}],
                                           response_format={"type": "json_object"}, max_tokens=300,
                                           temperature=0.7, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(r.choices[0].message.content or ""), dict)


# -- 3: regex and choice constraints over many seeded samples -----------------------------------------

def test_guided_regex_100_samples(client: openai.OpenAI) -> None:
    texts = []
    for seed in range(5):
        r = client.completions.create(model=MODEL, prompt="Code:", n=20, seed=seed, temperature=1.0, max_tokens=20,
                                      extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2}"})
        assert len(r.choices) == 20
        for c in r.choices:
            assert c.finish_reason == "stop"
            texts.append(c.text)
    assert len(texts) == 100
    bad = [t for t in texts if not re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)]
    assert not bad
    assert len(set(texts)) > 1  # sampled, not one fixed string


def test_guided_choice_100_samples(client: openai.OpenAI) -> None:
    choices = ["Paris", "Rome", "Berlin", "Madrid"]
    texts = []
    for seed in range(5):
        r = client.completions.create(model=MODEL, prompt="Capital:", n=20, seed=100 + seed, temperature=1.0,
                                      max_tokens=10, extra_body={"guided_choice": choices})
        texts += [c.text for c in r.choices]
    assert len(texts) == 100
    assert set(texts) <= set(choices)
    assert len(set(texts)) > 1


# -- 4: forced tool calls ------------------------------------------------------------------------------

def _named(**kw: Any) -> dict[str, Any]:
    return dict(model=MODEL, messages=USER, tools=[WEATHER_TOOL, TIME_TOOL],
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                max_tokens=300, temperature=0, seed=11, **kw)


def test_named_tool_call(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(**_named())  # type: ignore[arg-type]
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1
    assert calls[0].type == "function" and calls[0].id
    assert calls[0].function.name == "get_weather"
    _validate(json.loads(calls[0].function.arguments), WEATHER_PARAMS)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_calls(client: openai.OpenAI, tok: Any, parallel: bool) -> None:
    # The random model loves whitespace (the grammar allows runs of it between JSON tokens) and, with
    # parallel calls, may go on with more calls: whitespace-only tokens are biased away to keep it terse.
    terse = {str(i): -100 for i in range(tok.vocab_size) if tok.decode([i], skip_special_tokens=False).isspace()}
    assert terse
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER_TOOL, TIME_TOOL],
                                       tool_choice="required", parallel_tool_calls=parallel, max_tokens=350,
                                       temperature=1.0, seed=0, n=12, logit_bias=terse)
    counts = []
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice.message.content
        calls = choice.message.tool_calls or []
        assert calls and choice.message.content is None
        assert len({c.id for c in calls}) == len(calls)
        for c in calls:
            assert c.function.name in SCHEMAS
            _validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
        counts.append(len(calls))
    assert len({c.function.name for ch in r.choices for c in ch.message.tool_calls or []}) == 2  # both tools
    if parallel:
        assert max(counts) > 1  # the same seeds make several calls when allowed
    else:
        assert counts == [1] * 12


def test_required_tool_calls_stream(client: openai.OpenAI, tok: Any) -> None:
    terse = {str(i): -100 for i in range(tok.vocab_size) if tok.decode([i], skip_special_tokens=False).isspace()}
    kw: dict[str, Any] = dict(model=MODEL, messages=USER, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required",
                              max_tokens=350, temperature=0.8, seed=2, logit_bias=terse)
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].finish_reason == "tool_calls"
    expect = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls or []]
    calls, content, finish = _reassemble(list(client.chat.completions.create(stream=True, **kw)))
    assert finish == "tool_calls" and content == ""
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == expect
    assert all(c["id"].startswith("call_") for c in calls.values())


# -- 5: a two-turn tool loop ---------------------------------------------------------------------------

def test_two_turn_tool_loop(client: openai.OpenAI, srv: LiveServer) -> None:
    first = client.chat.completions.create(**_named())  # type: ignore[arg-type]
    call = (first.choices[0].message.tool_calls or [])[0]
    messages: list[Any] = list(USER)
    messages.append(first.choices[0].message)  # as the SDK's users do: the returned message, as is
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "SUNNY-42"})
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL, TIME_TOOL],
                                            tool_choice="none", max_tokens=8, temperature=0)
    msg = second.choices[0].message
    assert second.choices[0].finish_reason in ("stop", "length")
    assert not msg.tool_calls and isinstance(msg.content, str)

    # What the model saw: the tool, the earlier call (its name and arguments) and the tool's result.
    wire = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages]
    body = {"model": MODEL, "messages": wire, "tools": [WEATHER_TOOL, TIME_TOOL]}
    ids = httpx.post(srv.url + "/tokenize", json=body).json()["tokens"]
    text = httpx.post(srv.url + "/detokenize", json={"model": MODEL, "tokens": ids}).json()["prompt"]
    assert "SUNNY-42" in text and "<tool_response>" in text
    assert '"name": "get_weather"' in text and "<tool_call>" in text
    args = json.loads(call.function.arguments)
    assert json.dumps(args) in text  # the template re-serialises the arguments object with tojson
    assert "# Tools" in text and '"get_time"' in text
    assert second.usage is not None and second.usage.prompt_tokens == len(ids)


# -- 6: streamed tool calls reassemble to the whole response -----------------------------------------

def _reassemble(chunks: list[Any]) -> tuple[dict[int, dict[str, str]], str, str | None]:
    calls: dict[int, dict[str, str]] = {}
    content = ""
    finish = None
    for ch in chunks:
        if not ch.choices:
            continue
        c = ch.choices[0]
        content += c.delta.content or ""
        for d in c.delta.tool_calls or []:
            slot = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            if d.id:
                slot["id"] = d.id
            if d.function and d.function.name:
                slot["name"] += d.function.name
            if d.function and d.function.arguments:
                slot["arguments"] += d.function.arguments
        if c.finish_reason is not None:
            finish = c.finish_reason
    return calls, content, finish


def test_named_tool_call_stream(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(**_named())  # type: ignore[arg-type]
    (call,) = whole.choices[0].message.tool_calls or []
    chunks = list(client.chat.completions.create(stream=True, **_named()))  # type: ignore[arg-type]
    calls, content, finish = _reassemble(chunks)
    assert finish == "tool_calls" and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert list(calls) == [0] and calls[0]["id"].startswith("call_")
    assert calls[0]["name"] == call.function.name == "get_weather"
    assert calls[0]["arguments"] == call.function.arguments
    assert content == ""


HERMES_REGEX = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}\n</tool_call>'


def _auto(**kw: Any) -> dict[str, Any]:
    return dict(model=MODEL, messages=USER, tools=[WEATHER_TOOL], tool_choice="auto", max_tokens=120,
                temperature=0, extra_body={"guided_regex": HERMES_REGEX}, **kw)


def test_auto_tool_call_hermes(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(**_auto())  # type: ignore[arg-type]
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) in ({"city": "Paris"}, {"city": "Rome"})
    assert not (choice.message.content or "").strip()

    chunks = list(client.chat.completions.create(stream=True, **_auto()))  # type: ignore[arg-type]
    calls, content, finish = _reassemble(chunks)
    assert finish == "tool_calls"
    assert list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"]
    assert calls[0]["arguments"] == call.function.arguments
    assert "<tool_call>" not in content and not content.strip()


def test_auto_content_then_call_n2(client: openai.OpenAI) -> None:
    """Text before the call stays content; two sampled choices stream apart and reassemble per choice."""
    regex = r'Sure\. <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome|Oslo)"\}\}\n</tool_call>'
    kw: dict[str, Any] = dict(model=MODEL, messages=USER, tools=[WEATHER_TOOL], tool_choice="auto", max_tokens=120,
                              temperature=1.0, seed=9, n=2, extra_body={"guided_regex": regex})
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    for choice in whole.choices:
        assert choice.finish_reason == "tool_calls"
        assert (choice.message.content or "").strip() == "Sure."
        (call,) = choice.message.tool_calls or []
        assert call.function.name == "get_weather"
        mine = [ch for ch in chunks if ch.choices and ch.choices[0].index == choice.index]
        calls, content, finish = _reassemble(mine)
        assert finish == "tool_calls" and content == choice.message.content
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", call.function.arguments)]


# -- 7: the same through the ollama client -------------------------------------------------------------

def test_ollama_format_schema_and_json(srv: LiveServer) -> None:
    oc = ollama.Client(host=srv.url)
    msgs = [{"role": "user", "content": "Fill the form."}]
    for schema in (Person, Paint, Maybe):
        r = oc.chat(model=MODEL, messages=msgs, format=schema.model_json_schema(),
                    options={"num_predict": 300, "temperature": 0})
        assert r.done_reason == "stop"
        schema.model_validate_json(r.message.content or "")
    r = oc.chat(model=MODEL, messages=msgs, format="json", options={"num_predict": 300, "temperature": 0, "seed": 3})
    json.loads(r.message.content or "")
    g = oc.generate(model=MODEL, prompt="Fill the form.", format=Paint.model_json_schema(),
                    options={"num_predict": 300, "temperature": 0})
    Paint.model_validate_json(g.response)


def test_ollama_tools_accepted(srv: LiveServer) -> None:
    # Ollama has no tool_choice and its `format` cannot force the Hermes text, so only the request's
    # acceptance (tools rendered, the Hermes parser in the loop, a tool result in the history) is checked.
    oc = ollama.Client(host=srv.url)
    # In the shape the ollama client sends (it rebuilds tools with its own model: keys in its order, no
    # keywords it does not know), so that the OpenAI rendering below is of the same tool.
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                             "parameters": {"type": "object", "required": ["city"],
                                                            "properties": {"city": {"type": "string"}}}}}
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                             "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "SUNNY-42", "tool_name": "get_weather"},
    ]
    r = oc.chat(model=MODEL, messages=history, tools=[tool], options={"num_predict": 8, "temperature": 0})
    assert r.done and r.message.role == "assistant"
    # The prompt it saw is the OpenAI rendering of the same conversation: tools, the call and its result.
    same = [history[0],
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "SUNNY-42"}]
    ids = httpx.post(srv.url + "/tokenize", json={"messages": same, "tools": [tool]}).json()["tokens"]
    text = httpx.post(srv.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert "SUNNY-42" in text and '"get_weather"' in text and "# Tools" in text and "<tool_call>" in text
    assert r.prompt_eval_count == len(ids)
    bare = oc.chat(model=MODEL, messages=history, options={"num_predict": 1, "temperature": 0})
    assert (bare.prompt_eval_count or 0) < len(ids)  # without tools: no tools section
    for part in oc.chat(model=MODEL, messages=history, tools=[tool], stream=True,
                        options={"num_predict": 8, "temperature": 0}):
        assert part.message.role == "assistant"


# -- 8: a constrained request does not change its batch neighbours' greedy outputs -------------------

def test_constraint_batch_isolation(model_dir: Path) -> None:
    from tokenloom.llm import LLM
    from tokenloom.sampling_params import SamplingParams, StructuredOutput

    llm = LLM(model=str(model_dir), dtype="float32", kv_cache_memory="32MiB", max_model_len=512)
    prompts = ["Hello", "The quick brown fox", "What is the capital of France?", "1 2 3"]
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain)]
    schema = json.dumps(Paint.model_json_schema())
    constrained = [SamplingParams(temperature=0, max_tokens=200,
                                  structured=StructuredOutput("json_schema", schema)),
                   SamplingParams(temperature=0.9, seed=5, max_tokens=20,
                                  structured=StructuredOutput("regex", "[0-9]{3}-[a-z]{2}"))]
    outs = llm.generate(["Paint:", prompts[0]] + prompts + ["Code:"],
                        [constrained[0], constrained[1]] + [plain] * 4 + [constrained[0]])
    assert [list(o.outputs[0].token_ids) for o in outs[2:6]] == [list(t) for t in alone]
    Paint.model_validate_json(outs[0].outputs[0].text)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[1].outputs[0].text)
    Paint.model_validate_json(outs[6].outputs[0].text)


# -- 9: rejected fields are 400s naming them; no-effect fields are accepted ---------------------------

BAD_TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "bogus"}}}}}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMP = {"model": MODEL, "prompt": "hi", "max_tokens": 2}

REJECTED: list[tuple[str, str, dict[str, Any], str]] = [
    ("unknown", "chat", {"foo": 1}, "foo"),
    ("suffix", "comp", {"suffix": "x"}, "suffix"),
    ("best_of", "comp", {"best_of": 3, "n": 1}, "best_of"),
    ("modalities", "chat", {"modalities": ["audio"]}, "modalities.0"),
    ("audio", "chat", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("prediction", "chat", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("functions", "chat", {"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ("web_search_options", "chat", {"web_search_options": {}}, "web_search_options"),
    ("image", "chat", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, "messages.0.content"),
    ("json_schema_missing", "chat", {"response_format": {"type": "json_schema"}}, "response_format"),
    ("bad_regex", "comp", {"guided_regex": "[0-9"}, "guided_regex"),
    ("bad_schema", "chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}}},
     "response_format.json_schema"),
    ("bad_guided_json", "chat", {"guided_json": {"type": "object", "properties": {"a": {"type": "bogus"}}}},
     "guided_json"),
    ("bad_grammar", "comp", {"guided_grammar": "root ::= ("}, "guided_grammar"),
    ("bad_structured_regex", "chat", {"structured_outputs": {"regex": "[0-9"}}, "structured_outputs.regex"),
    ("bad_tool_schema_named", "chat", {"tools": [BAD_TOOL], "tool_choice": {"type": "function",
                                                                            "function": {"name": "f"}}},
     "tools.0.function.parameters"),
    ("tool_choice_without_tools", "chat", {"tool_choice": "auto"}, "tool_choice"),
    ("bad_tool_schema_required", "chat", {"tools": [BAD_TOOL], "tool_choice": "required"}, "tools"),
    ("format_and_forced_call", "chat", {"response_format": {"type": "json_object"}, "tools": [WEATHER_TOOL],
                                        "tool_choice": "required"}, "response_format"),
    ("missing_tool", "chat", {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function",
                                                                      "function": {"name": "nope"}}}, "tool_choice"),
    ("two_constraints", "comp", {"guided_regex": "[0-9]+", "guided_choice": ["a", "b"]}, "guided_choice"),
    ("logit_bias_key", "chat", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("logit_bias_value", "chat", {"logit_bias": {"5": 200}}, "logit_bias.5"),
    ("logit_bias_vocab", "chat", {"logit_bias": {"99999": 5}}, "logit_bias"),
    ("allowed_empty", "comp", {"allowed_token_ids": []}, "allowed_token_ids"),
    ("min_tokens_constraint", "comp", {"min_tokens": 2, "guided_regex": "[0-9]+"}, "min_tokens"),
]


@pytest.mark.parametrize("kind,extra,param", [r[1:] for r in REJECTED], ids=[r[0] for r in REJECTED])
def test_rejected_fields(srv: LiveServer, kind: str, extra: dict[str, Any], param: str) -> None:
    base, path = (CHAT, "/v1/chat/completions") if kind == "chat" else (COMP, "/v1/completions")
    r = httpx.post(srv.url + path, json={**base, **extra}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == 400 and err["message"]
    assert err["param"] == param, err
    if param == "messages.0.content":
        assert "text only" in err["message"]


OLLAMA_REJECTED: list[tuple[str, dict[str, Any], str]] = [
    ("mirostat", {"options": {"mirostat": 1}}, "mirostat"),
    ("images", {"messages": [{"role": "user", "content": "hi", "images": ["aGVsbG8="]}]}, "text only"),
    ("unknown_option", {"options": {"no_such_option": 1}}, "options.no_such_option"),
    ("bad_format", {"format": {"type": "object", "properties": {"a": {"type": "bogus"}}}}, "format"),
]


@pytest.mark.parametrize("extra,says", [r[1:] for r in OLLAMA_REJECTED], ids=[r[0] for r in OLLAMA_REJECTED])
def test_ollama_rejected(srv: LiveServer, extra: dict[str, Any], says: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": False,
            "options": {"num_predict": 2}}
    body.update(extra)
    r = httpx.post(srv.url + "/api/chat", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]
    with pytest.raises(ollama.ResponseError) as e:  # the client raises it with the status and message
        ollama.Client(host=srv.url).chat(model=MODEL, messages=body["messages"], options=body["options"],
                                         format=body.get("format"))
    assert e.value.status_code == 400 and says in str(e.value)


def test_no_effect_fields_accepted(srv: LiveServer, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, user="u1", store=False,
                                       metadata={"k": "v"}, service_tier="auto")
    assert r.choices[0].message.role == "assistant"
    c = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, user="u1",
                                  extra_body={"store": False, "metadata": {"k": "v"}, "service_tier": "auto"})
    assert len(c.choices) == 1
    o = ollama.Client(host=srv.url).chat(model=MODEL, messages=USER, keep_alive="5m",
                                         options={"num_predict": 2, "num_gpu": 1, "num_thread": 2})
    assert o.done


# -- 10: logit_bias, allowed_token_ids and bad_words over HTTP ----------------------------------------

def test_logit_bias_forces_token(client: openai.OpenAI, tok: Any) -> None:
    (target,) = tok.encode(" fox", add_special_tokens=False)
    kw: dict[str, Any] = dict(model=MODEL, prompt="Hello", max_tokens=8, temperature=0, logprobs=0,
                              extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw)
    assert plain.choices[0].text != " fox" * 8  # the bias is what makes it
    r = client.completions.create(**kw, logit_bias={str(target): 100})
    assert r.choices[0].logprobs.tokens == [" fox"] * 8  # type: ignore[union-attr]
    assert r.choices[0].text == " fox" * 8


def test_allowed_token_ids(client: openai.OpenAI, tok: Any) -> None:
    a = tok.encode(" quick", add_special_tokens=False)
    b = tok.encode(" dog", add_special_tokens=False)
    allowed = [a[0], b[0]]
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=12, temperature=1.0, seed=4,
                                       logprobs=True, n=3,
                                       extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    names = {tok.decode([t], skip_special_tokens=False) for t in allowed}
    for c in r.choices:
        toks = [e.token for e in c.logprobs.content]  # type: ignore[union-attr]
        assert len(toks) == 12 and set(toks) <= names, toks
    assert len({e.token for c in r.choices for e in c.logprobs.content}) == 2  # type: ignore[union-attr]


def test_bad_words(client: openai.OpenAI, tok: Any) -> None:
    kw: dict[str, Any] = dict(model=MODEL, prompt="The quick brown fox", max_tokens=24, temperature=0, logprobs=0)
    plain = client.completions.create(**kw, extra_body={"ignore_eos": True})
    toks = plain.choices[0].logprobs.tokens  # type: ignore[union-attr]
    # A word the greedy output produces as one token; banning it bans that token (as written and after a space).
    word = next(t.strip() for t in toks if t.strip().isalnum()
                and len(tok.encode(t.strip(), add_special_tokens=False)) == 1)
    forms = {w for w in (word, " " + word) if len(tok.encode(w, add_special_tokens=False)) == 1}
    assert forms & set(toks)
    banned = client.completions.create(**kw, extra_body={"ignore_eos": True, "bad_words": [word]})
    got = banned.choices[0].logprobs.tokens  # type: ignore[union-attr]
    assert len(got) == 24 and not forms & set(got), (word, got)


# -- reasoning: --reasoning-parser splits the thinking off, streamed and not ------------------------------

def test_reasoning_content_is_split_off(model_dir: Path) -> None:
    """With --reasoning-parser qwen3 the thinking goes to reasoning_content and the rest to content, in a
    whole response and in a stream (the random model's text is forced by a regex constraint)."""
    server = LiveServer(model_dir, max_model_len=1024, kv_cache_memory="64MiB", reasoning_parser="qwen3")
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 60,
                "temperature": 0, "guided_regex": r"<think>(ab|cd)</think>\n\nDONE-[0-9]"}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        assert msg["reasoning_content"] in ("ab", "cd") and msg["content"].startswith("DONE-")
        streamed = {"reasoning_content": "", "content": ""}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True},
                          timeout=60) as s:
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in json.loads(line[6:])["choices"]:
                        for k in streamed:
                            streamed[k] += choice["delta"].get(k) or ""
        assert streamed == {"reasoning_content": msg["reasoning_content"], "content": msg["content"]}
    finally:
        server.close()
