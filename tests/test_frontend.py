"""serve/frontend.py: prompt forms, the one max_tokens rule (OpenAI and Ollama), SamplingParams, streams."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenloom.config import EngineConfig
from tokenloom.engine.async_engine import AsyncLLMEngine
from tokenloom.errors import ContextTooLong, InvalidRequest
from tokenloom.outputs import RequestOutput
from tokenloom.sampling_params import SamplingParams
from tokenloom.serve.errors import ModelNotFound
from tokenloom.serve.frontend import Frontend, chain, first, gather
from tokenloom.serve.ollama_protocol import Message, Options
from tokenloom.serve.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest

LIMIT = 64  # max_model_len


@pytest.fixture(scope="module")
def fe(tiny_llama: Path) -> Iterator[Frontend]:
    cfg = EngineConfig(model=str(tiny_llama), dtype="float32", kv_cache_memory="16MiB", max_model_len=LIMIT)
    engine = AsyncLLMEngine.from_config(cfg)
    yield Frontend(engine, "tiny")
    engine.shutdown()


def raises(exc: type[InvalidRequest], field: str, fn: object, *args: object, **kw: object) -> InvalidRequest:
    with pytest.raises(exc) as e:
        fn(*args, **kw)  # type: ignore[operator]
    assert e.value.field == field
    return e.value


def test_engine_exposes_what_handlers_need(fe: Frontend) -> None:
    eng = fe.engine
    assert eng.max_model_len == fe.max_model_len == LIMIT
    assert eng.tokenizer is fe.tokenizer and eng.model_config.num_hidden_layers == 2
    info = eng.model_info
    assert info.dtype == "float32" and info.path.is_dir()
    assert info.num_parameters == sum(p.numel() for p in eng.engine.loaded.model.parameters())


def test_check_model(fe: Frontend) -> None:
    fe.check_model("tiny")
    fe.check_model("tiny:latest", latest_ok=True)
    with pytest.raises(ModelNotFound):
        fe.check_model("tiny:latest")
    with pytest.raises(ModelNotFound):
        fe.check_model("other", latest_ok=True)


def test_completion_prompt_forms(fe: Frontend) -> None:
    tok = fe.tokenizer
    a, b = tok.encode("The quick brown fox"), tok.encode("Hello")
    assert fe.completion_prompts("The quick brown fox") == (["The quick brown fox"], [a])
    assert fe.completion_prompts(a) == ([None], [a])
    assert fe.completion_prompts(["The quick brown fox", "Hello"]) == (["The quick brown fox", "Hello"], [a, b])
    assert fe.completion_prompts([a, b]) == ([None, None], [a, b])
    for empty in ("", [], [[]], [a, []], ["Hello", ""]):
        raises(InvalidRequest, "prompt", fe.completion_prompts, empty)


def test_chat_and_generate_templating(fe: Frontend) -> None:
    tok = fe.tokenizer
    want = tok.encode_chat([{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}])
    parts = ChatMessage(role="user", content=[{"type": "text", "text": "H"}, {"type": "text", "text": "i"}])
    with pytest.raises(ValueError, match="takes text only"):  # an image part is refused, not dropped
        ChatMessage(role="user", content=[{"type": "text", "text": "H"}, {"type": "image_url"}])
    assert fe.chat_ids([ChatMessage(role="system", content="Be brief"), parts]) == want
    assert fe.chat_ids([Message(role="system", content="Be brief"), Message(role="user", content="Hi")]) == want
    assert fe.generate_ids("Hi", system="Be brief") == want
    assert fe.generate_ids("Hi", system="Be brief", raw=True) == tok.encode("Hi")
    no_prompt = fe.chat_ids([Message(role="user", content="Hi")], add_generation_prompt=False)
    assert no_prompt == tok.encode_chat([{"role": "user", "content": "Hi"}], add_generation_prompt=False)


def test_detokenize(fe: Frontend) -> None:
    ids = fe.tokenizer.encode("Hello")
    assert fe.detokenize(ids) == fe.tokenizer.decode(ids)
    raises(InvalidRequest, "tokens", fe.detokenize, [fe.engine.model_config.vocab_size])


def test_max_tokens_rule_openai(fe: Frontend) -> None:
    assert fe.max_tokens(10, None) == LIMIT - 10  # no max_tokens: fill the context
    assert fe.max_tokens(10, 54) == 54  # exactly fits
    err = raises(ContextTooLong, "max_tokens", fe.max_tokens, 10, 55)
    assert "55" in str(err) and str(LIMIT) in str(err)
    raises(ContextTooLong, "prompt", fe.max_tokens, LIMIT, None)  # no room for a single token
    raises(ContextTooLong, "prompt", fe.max_tokens, LIMIT, 1)
    assert fe.max_tokens(10, 0) == 0  # left to the caller's own check, which names its field


def test_max_tokens_rule_ollama(fe: Frontend) -> None:
    assert fe.max_tokens(10, 1000, cap=True) == LIMIT - 10  # num_predict is capped by the room
    assert fe.max_tokens(10, 5, cap=True) == 5
    assert fe.max_tokens(10, None, context=20, cap=True) == 10  # num_ctx lowers the limit
    assert fe.max_tokens(10, None, context=1000, cap=True) == LIMIT - 10  # ... never raises it
    raises(ContextTooLong, "prompt", fe.max_tokens, 20, None, context=20, cap=True)


def test_openai_sampling_params(fe: Frontend) -> None:
    body = CompletionRequest(model="tiny", prompt="x", stop="END", temperature=None, top_k=5, seed=3, logprobs=2,
                             max_tokens=7, ignore_eos=True, stop_token_ids=[4])
    assert fe.completion_params(body, 10) == SamplingParams(
        temperature=1.0, top_k=5, seed=3, max_tokens=7, stop=("END",), stop_token_ids=(4,), ignore_eos=True,
        logprobs=2)
    raises(ContextTooLong, "max_tokens", fe.completion_params, body.model_copy(update={"max_tokens": 60}), 10)
    raises(InvalidRequest, "max_tokens", fe.completion_params, body.model_copy(update={"max_tokens": 0}), 10)

    msgs = [ChatMessage(role="user", content="Hi")]
    chat = ChatCompletionRequest(model="tiny", messages=msgs, max_tokens=3, max_completion_tokens=5)
    p = fe.chat_params(chat, 10)
    assert p.max_tokens == 5 and p.logprobs is None and p.temperature == 1.0  # max_completion_tokens wins
    assert fe.chat_params(ChatCompletionRequest(model="tiny", messages=msgs), 10).max_tokens == LIMIT - 10
    top = ChatCompletionRequest(model="tiny", messages=msgs, logprobs=True)
    assert fe.chat_params(top, 10).logprobs == 0
    assert fe.chat_params(top.model_copy(update={"top_logprobs": 3}), 10).logprobs == 3
    no_lp = ChatCompletionRequest(model="tiny", messages=msgs, top_logprobs=3)
    raises(InvalidRequest, "top_logprobs", fe.chat_params, no_lp, 10)


def test_ollama_sampling_params(fe: Frontend) -> None:
    p = fe.ollama_params(Options(), 10)  # Ollama's defaults; num_predict unset fills the context
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (0.8, 40, 0.9, LIMIT - 10)
    assert fe.ollama_params(Options(num_predict=-1), 10).max_tokens == LIMIT - 10
    assert fe.ollama_params(Options(num_predict=500), 10).max_tokens == LIMIT - 10
    assert fe.ollama_params(Options(num_predict=6, num_ctx=12), 10).max_tokens == 2
    o = Options(temperature=0, top_k=3, repeat_penalty=1.2, stop=["\n"], seed=9, presence_penalty=0.5)
    p = fe.ollama_params(o, 10)
    assert (p.temperature, p.top_k, p.repetition_penalty, p.stop, p.seed, p.presence_penalty) == (
        0, 3, 1.2, ("\n",), 9, 0.5)
    with pytest.raises(ValueError, match="num_ctx"):  # declared on the field (and in the OpenAPI document)
        Options(num_ctx=0)
    assert fe.ollama_params(Options(repeat_last_n=-1), 10).repetition_window is None
    assert fe.ollama_params(Options(), 10).repetition_window == 64  # Ollama's default
    assert fe.ollama_params(Options(typical_p=0.5), 10).typical_p == 0.5
    raises(InvalidRequest, "options.num_predict", fe.ollama_params, Options(num_predict=0), 10)
    raises(ContextTooLong, "prompt", fe.ollama_params, Options(num_ctx=2), 10)


def test_run_merges_prompts_and_helpers_replay_the_stream(fe: Frontend) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    _, prompts = fe.completion_prompts(["The quick brown fox", "Hello"])

    async def main() -> tuple[list[RequestOutput], list[RequestOutput], list[RequestOutput]]:
        each = [(await gather(fe.run([p], [greedy]), 1))[0] for p in prompts]
        merged = await gather(fe.run(prompts, [greedy, greedy], ["The quick brown fox", None]), 2)
        stream = fe.run(prompts, [greedy, greedy])
        head = await first(stream)
        assert head is not None
        replayed = await gather(chain(head, stream), 2)
        return each, merged, replayed

    each, merged, replayed = asyncio.run(main())
    want = [o.outputs[0].token_ids for o in each]
    assert all(len(t) == 4 for t in want)
    assert [o.outputs[0].token_ids for o in merged] == want
    assert [o.outputs[0].token_ids for o in replayed] == want
    assert merged[0].prompt == "The quick brown fox" and merged[1].prompt is None


def test_run_fails_whole_request_on_a_bad_prompt(fe: Frontend) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    bad = [fe.engine.model_config.vocab_size]  # outside the vocabulary: the engine's own check

    async def main() -> None:
        await gather(fe.run([fe.tokenizer.encode("Hello"), bad], [greedy, greedy]), 2)

    with pytest.raises(InvalidRequest) as e:
        asyncio.run(main())
    assert e.value.field == "prompt"
    assert fe.engine.num_unfinished == 0
