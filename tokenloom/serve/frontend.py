"""The one front door of the OpenAI, Ollama and KV routes: request -> token ids -> SamplingParams -> streams.

Each route used to tokenize, template, size max_tokens against the context and build SamplingParams on its
own, with two policies for the same question. Here they share one copy of each; handlers only parse their
body, call the frontend and format the response. The prompt's own checks (token ids inside the vocabulary,
shorter than max_model_len) are the engine's (`LLMEngine.process_request`, run once by
`AsyncLLMEngine.generate` on the caller's thread); the frontend adds only what the engine cannot know: the
API's max_tokens policy against the context.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from pydantic import BaseModel

from tokenloom.engine.async_engine import AsyncLLMEngine
from tokenloom.errors import ContextTooLong, InvalidRequest
from tokenloom.outputs import RequestOutput, merge_delta
from tokenloom.sampling_params import SamplingParams, StructuredOutput
from tokenloom.serve.chat_output import ToolMode
from tokenloom.serve.constraints import request_constraint, tool_choice_constraint
from tokenloom.serve.errors import ModelNotFound
from tokenloom.serve.ollama_protocol import Message, Options
from tokenloom.serve.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from tokenloom.serve.reasoning import ReasoningParser, get_reasoning_parser
from tokenloom.serve.tool_parsers import ToolParser, detect_tool_parser, get_tool_parser
from tokenloom.tokenizer import Tokenizer

Indexed = tuple[int, RequestOutput]  # (prompt index, delta output)


class Frontend:
    """Built once per app (`app.state.frontend`) from the engine and the name the model is served under."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, tool_parser: str | None = None,
                 reasoning_parser: str | None = None) -> None:
        """`tool_parser`: how the model writes tool calls (serve/tool_parsers.py; None: detected from the
        chat template, if it can be). `reasoning_parser`: how it writes its thinking (serve/reasoning.py;
        None: thinking stays in the content)."""
        self.engine = engine
        self.model_name = model_name
        name = tool_parser if tool_parser is not None else detect_tool_parser(engine.tokenizer.chat_template)
        self.tool_parser: ToolParser | None = None if name is None else get_tool_parser(name)
        self.reasoning: ReasoningParser | None = (None if reasoning_parser is None
                                                  else get_reasoning_parser(reasoning_parser))

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_model(self, name: str, latest_ok: bool = False) -> None:
        """OpenAI clients name the served model exactly; Ollama clients may add the implied ":latest" tag."""
        if name != self.model_name and not (latest_ok and name == f"{self.model_name}:latest"):
            raise ModelNotFound(name)

    # -- prompts ----------------------------------------------------------------------------------------

    def completion_prompts(self, prompt: str | list[str] | list[int] | list[list[int]]
                           ) -> tuple[list[str | None], list[list[int]]]:
        """A completion prompt (a string, token ids, or a list of either) as its texts (None for token ids)
        and token ids. Every prompt must be non-empty here, so that a bad one fails the request before any
        of the others starts; token ids are passed on as given (`generate` copies them once)."""
        if isinstance(prompt, str):
            raw: list[str | list[int]] = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            raw = [prompt]  # type: ignore[list-item]
        else:
            raw = list(prompt)  # type: ignore[arg-type]
        ids = [self.encode(r) if isinstance(r, str) else r for r in raw]
        if not ids or not all(ids):
            raise InvalidRequest("prompt must not be empty", "prompt")
        return [r if isinstance(r, str) else None for r in raw], ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens)

    def chat_prompt(self, messages: Sequence[ChatMessage | Message], add_generation_prompt: bool = True,
                    tools: Sequence[BaseModel] | None = None, template_kwargs: dict[str, Any] | None = None,
                    continue_final: bool = False) -> str:
        """Chat messages through the model's chat template, as text. The template gets the whole history
        (assistant tool calls, tool results with their call ids), the `tools` (the request's function objects)
        and `template_kwargs` (vLLM's chat_template_kwargs, e.g. enable_thinking). `continue_final`: the
        last (assistant) message is left open for the model to continue."""
        kwargs = dict(template_kwargs or {})
        for reserved in ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools"):
            if reserved in kwargs:
                raise InvalidRequest(f"chat_template_kwargs.{reserved}: set by the server", "chat_template_kwargs")
        if tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in tools]
        msgs = [m.template_dict() for m in messages]
        text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt, **kwargs)
        if continue_final:
            last = msgs[-1]["content"]
            cut = text.rfind(last) if last else -1
            if cut < 0:
                raise InvalidRequest("continue_final_message: the template does not write the final message's "
                                     "content verbatim", "continue_final_message")
            text = text[: cut + len(last)]
        return text

    def chat_ids(self, messages: Sequence[ChatMessage | Message], add_generation_prompt: bool = True,
                 tools: Sequence[BaseModel] | None = None, template_kwargs: dict[str, Any] | None = None,
                 continue_final: bool = False) -> list[int]:
        """`chat_prompt` as token ids (the template writes BOS itself where the model wants one)."""
        text = self.chat_prompt(messages, add_generation_prompt, tools, template_kwargs, continue_final)
        return self.encode(text, add_special_tokens=False)

    def generate_ids(self, prompt: str, system: str | None = None, raw: bool = False,
                     template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Ollama's /api/generate prompt: templated as one user turn (after `system`) unless `raw` or the
        model has no chat template."""
        if raw or not self.tokenizer.chat_template:
            return self.encode(prompt)
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        text = self.tokenizer.apply_chat_template(msgs, True, **(template_kwargs or {}))
        return self.encode(text, add_special_tokens=False)

    def detokenize(self, tokens: list[int]) -> str:
        vocab = self.engine.model_config.vocab_size
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
        return self.tokenizer.decode(tokens)

    # The same, in a worker thread: a large prompt's tokenization must not stall the event loop (/health,
    # every other request's stream). The handlers use these; the synchronous ones stay for other callers.

    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await asyncio.to_thread(self.encode, text, add_special_tokens)

    async def completion_prompts_async(self, prompt: str | list[str] | list[int] | list[list[int]]
                                       ) -> tuple[list[str | None], list[list[int]]]:
        return await asyncio.to_thread(self.completion_prompts, prompt)

    async def chat_ids_async(self, messages: Sequence[ChatMessage | Message], add_generation_prompt: bool = True,
                             tools: Sequence[BaseModel] | None = None,
                             template_kwargs: dict[str, Any] | None = None, continue_final: bool = False
                             ) -> list[int]:
        return await asyncio.to_thread(self.chat_ids, messages, add_generation_prompt, tools, template_kwargs,
                                       continue_final)

    async def generate_ids_async(self, prompt: str, system: str | None = None, raw: bool = False,
                                 template_kwargs: dict[str, Any] | None = None) -> list[int]:
        return await asyncio.to_thread(self.generate_ids, prompt, system, raw, template_kwargs)

    async def detokenize_async(self, tokens: list[int]) -> str:
        return await asyncio.to_thread(self.detokenize, tokens)

    # -- max_tokens and SamplingParams ------------------------------------------------------------------

    def max_tokens(self, prompt_len: int, asked: int | None, context: int | None = None, cap: bool = False) -> int:
        """The one rule for output length against the context, for both APIs.

        The limit is max_model_len, lowered to `context` when given (Ollama's num_ctx). A prompt that leaves
        no room for one token is ContextTooLong on "prompt". `asked` None fills the room (OpenAI chat without
        max_tokens, Ollama's num_predict -1). An `asked` larger than the room is ContextTooLong on
        "max_tokens", as vLLM answers, or, with `cap` (Ollama's num_predict), the room. An `asked` below 1 is
        returned as is for the caller's own check to name its field."""
        limit = self.max_model_len if context is None else min(self.max_model_len, context)
        if prompt_len >= limit:
            what = "max_model_len is" if context is None else "the context is"
            raise ContextTooLong(f"the prompt has {prompt_len} tokens; {what} {limit}", "prompt")
        room = limit - prompt_len
        if asked is None:
            return room
        if asked <= room or cap:
            return min(asked, room)
        raise ContextTooLong(f"prompt ({prompt_len} tokens) + max_tokens ({asked}) = {prompt_len + asked} exceeds "
                             f"max_model_len ({limit})", "max_tokens")

    def completion_params(self, body: CompletionRequest, prompt_len: int) -> SamplingParams:
        structured = request_constraint(body)
        return self._openai_params(body, self.max_tokens(prompt_len, body.max_tokens), body.logprobs, structured)

    def chat_params(self, body: ChatCompletionRequest, prompt_len: int,
                    structured: StructuredOutput | None = None) -> SamplingParams:
        """`structured`: the request's output constraint (its response_format, or the forced tool call's)."""
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", "top_logprobs")
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return self._openai_params(body, self.max_tokens(prompt_len, asked), logprobs, structured)

    def reasoning_for(self, prompt_ids: list[int]) -> ReasoningParser | None:
        """The reasoning parser for one request (None without --reasoning-parser), told whether the output
        begins inside the thinking: read off the prompt's end, where a template may open <think> itself
        (or close an empty one when thinking is off, e.g. Qwen3's enable_thinking false)."""
        if self.reasoning is None:
            return None
        r = self.reasoning
        tail = self.tokenizer.decode(prompt_ids[-32:], skip_special_tokens=False)
        opened, closed = tail.rfind(r.start), tail.rfind(r.end)
        inside = opened > closed or (r.starts_in_reasoning and closed < 0)
        return type(r)(starts_in_reasoning=inside)

    def chat_constraint(self, body: ChatCompletionRequest, mode: ToolMode,
                        reasoning: ReasoningParser | None) -> StructuredOutput | None:
        """The chat request's output constraint: a forced tool call's, or its response_format's. With a
        reasoning parser it starts once the thinking is over: unconstrained while inside it, and where the
        model may open it, its first token may be the opening tag."""
        asked = request_constraint(body)
        forced = None
        if mode.kind in ("named", "required") and body.tools and body.tool_choice is not None:
            forced = tool_choice_constraint(body.tools, body.tool_choice, body.parallel_tool_calls)  # type: ignore[arg-type]
        if asked is not None and forced is not None:
            raise InvalidRequest(f"{asked.field} cannot be combined with a forced tool call (tool_choice "
                                 "required or a named function)", asked.field)
        constraint = forced or asked
        if constraint is None or reasoning is None:
            return constraint
        return self.thinking_first(constraint, reasoning)

    def thinking_first(self, constraint: StructuredOutput, reasoning: ReasoningParser) -> StructuredOutput:
        """`constraint`, starting after the thinking `reasoning` expects (see StructuredOutput)."""
        inside = reasoning.starts_in_reasoning
        start = () if inside else tuple(self.encode(reasoning.start, add_special_tokens=False))
        end = tuple(self.encode(reasoning.end, add_special_tokens=False))
        return replace(constraint, think_start=start, think_end=end, starts_thinking=inside)

    def _openai_params(self, body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
                       logprobs: int | None, structured: StructuredOutput | None) -> SamplingParams:
        stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
        return SamplingParams(
            n=body.n,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            seed=body.seed,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=tuple(stop),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            logit_bias=_logit_bias(body.logit_bias),
            allowed_token_ids=None if body.allowed_token_ids is None else tuple(body.allowed_token_ids),
            bad_words_token_ids=self.bad_words(body.bad_words or []),
            structured=structured,
        )

    def bad_words(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's bad_words as token sequences: each word as written and after a space (" word" is a
        different token in most vocabularies), without special tokens."""
        seqs: dict[tuple[int, ...], None] = {}
        for i, w in enumerate(words):
            if not w.strip():
                raise InvalidRequest(f"bad_words.{i} must not be empty", f"bad_words.{i}")
            for text in (w, " " + w.lstrip()):
                seqs.setdefault(tuple(self.encode(text, add_special_tokens=False)), None)
        return tuple(s for s in seqs if s)

    def ollama_params(self, o: Options, prompt_len: int, structured: StructuredOutput | None = None) -> SamplingParams:
        """Ollama's options with Ollama's defaults; num_predict below 0 means "until the context is full".
        repeat_last_n: the repeat penalty looks at the last N tokens (Ollama's default 64; -1: the context;
        0: off). `structured`: the request's `format`, as a constraint."""
        predict = o.num_predict
        max_tokens = self.max_tokens(prompt_len, None if predict is None or predict < 0 else predict,
                                     context=o.num_ctx, cap=True)
        if max_tokens < 1:
            raise InvalidRequest(f"options.num_predict must be -1 or positive, got {predict}", "options.num_predict")
        last_n = 64 if o.repeat_last_n is None else o.repeat_last_n
        return SamplingParams(
            temperature=0.8 if o.temperature is None else o.temperature,
            top_k=40 if o.top_k is None else o.top_k,
            top_p=0.9 if o.top_p is None else o.top_p,
            min_p=0.0 if o.min_p is None else o.min_p,
            typical_p=1.0 if o.typical_p is None else o.typical_p,
            seed=o.seed,
            max_tokens=max_tokens,
            stop=tuple(o.stop or ()),
            repetition_penalty=1.0 if o.repeat_penalty is None else o.repeat_penalty,
            repetition_window=None if last_n < 0 else last_n,
            presence_penalty=o.presence_penalty or 0.0,
            frequency_penalty=o.frequency_penalty or 0.0,
            structured=structured,
        )

    # -- running ------------------------------------------------------------------------------------

    async def run(self, prompts: list[list[int]], params: list[SamplingParams],
                  texts: Sequence[str | None] | None = None) -> AsyncGenerator[Indexed, None]:
        """Merge the delta streams of several prompts: yields (prompt index, delta). Closing it early (a
        client gone) closes every request's stream, which aborts it in the engine."""
        texts = texts if texts is not None else [None] * len(prompts)
        if len(prompts) == 1:  # the common case: no pump task, no second queue
            async with aclosing(self.engine.generate(prompts[0], params[0], prompt=texts[0])) as gen:
                async for out in gen:
                    yield 0, out
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async with aclosing(self.engine.generate(prompts[i], params[i], prompt=texts[i])) as gen:
                    async for out in gen:
                        await queue.put((i, out))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                await queue.put((i, e))
                return
            await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(prompts))]
        try:
            remaining = len(prompts)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias keys are token ids written as JSON strings."""
    if not bias:
        return {}
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise InvalidRequest(f"logit_bias: key {key!r} is not a token id", "logit_bias")
        out[int(key)] = value
    return out


async def gather(stream: AsyncIterator[Indexed], n_prompts: int) -> list[RequestOutput]:
    """Fold every prompt's deltas into its complete output (the non-streaming responses)."""
    acc: dict[int, RequestOutput] = {}
    async for i, delta in stream:
        acc[i] = merge_delta(acc.get(i), delta)
    return [acc[i] for i in range(n_prompts)]


async def first(stream: AsyncIterator[Indexed]) -> Indexed | None:
    """The stream's first item, awaited before the response starts: errors until then stay HTTP errors."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


async def chain(head: Indexed | None, stream: AsyncIterator[Indexed]) -> AsyncIterator[Indexed]:
    """The stream again, with its already-awaited first item put back in front."""
    if head is not None:
        yield head
    async for x in stream:
        yield x
