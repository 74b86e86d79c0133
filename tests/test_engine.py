"""Engine behaviour through the offline API: stops, lengths, n, abort, streaming, validation, capacity."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PROMPTS
from tokenloom import LLM, ContextTooLong, InvalidRequest, SamplingParams
from tokenloom.errors import ConfigError, ModelLoadError


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB", max_model_len=256)


def greedy(max_tokens: int = 24, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


def test_max_tokens_and_finish_reason_length(llm: LLM) -> None:
    out = llm.generate(PROMPTS[1], greedy(7, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    assert out.text == llm.tokenizer.decode(out.token_ids)


def test_stop_string_is_cut_and_not_emitted(llm: LLM) -> None:
    full = llm.generate(PROMPTS[2], greedy(24, ignore_eos=True))[0].outputs[0].text
    stop = full[6:9]
    assert stop and stop in full
    out = llm.generate(PROMPTS[2], greedy(24, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.text == full[: full.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(PROMPTS[2], greedy(24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True))[0]
    assert kept.outputs[0].text == full[: full.index(stop) + len(stop)]


def test_streamed_deltas_add_up_and_never_leak_a_stop_string(llm: LLM) -> None:
    full = llm.generate(PROMPTS[0], greedy(30, ignore_eos=True))[0].outputs[0]
    stop = full.text[10:14]
    params = greedy(30, ignore_eos=True, stop=[stop])
    whole = llm.generate(PROMPTS[0], params)[0].outputs[0]
    deltas = list(llm.stream(PROMPTS[0], params))
    assert "".join(d.text for d in deltas) == whole.text
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert deltas[-1].finish_reason == "stop" and all(d.finish_reason is None for d in deltas[:-1])
    running = ""
    for d in deltas:
        running += d.text
        assert stop not in running


def test_stop_token_ids_and_eos(llm: LLM) -> None:
    ref = llm.generate(PROMPTS[1], greedy(20, ignore_eos=True))[0].outputs[0].token_ids
    target = ref[5]
    out = llm.generate(PROMPTS[1], greedy(20, ignore_eos=True, stop_token_ids=[target]))[0].outputs[0]
    assert out.token_ids == ref[: ref.index(target) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target
    # min_tokens keeps it going past the stop token.
    later = llm.generate(PROMPTS[1], greedy(20, ignore_eos=True, stop_token_ids=[target], min_tokens=12))[0].outputs[0]
    assert len(later.token_ids) >= 12


def test_eos_ends_generation_unless_ignored(tiny_llama: Path) -> None:
    # Make EOS the stop token the model picks: reuse whatever greedy emits 3rd as "eos".
    probe = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB")
    ids = probe.generate(PROMPTS[4], greedy(10, ignore_eos=True))[0].outputs[0].token_ids
    probe.engine._stop_ids = frozenset({ids[2]})
    out = probe.generate(PROMPTS[4], greedy(10))[0].outputs[0]
    assert out.token_ids == ids[: ids.index(ids[2]) + 1] and out.finish_reason == "stop" and out.stop_reason is None
    assert len(probe.generate(PROMPTS[4], greedy(10, ignore_eos=True))[0].outputs[0].token_ids) == 10


def test_n_completions_with_seed(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=42, max_tokens=12, ignore_eos=True, logprobs=2)
    a = llm.generate(PROMPTS[3], params)[0]
    b = llm.generate(PROMPTS[3], params)[0]
    assert [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1
    for o in a.outputs:
        assert o.logprobs is not None and len(o.logprobs) == 12
        assert all(len(lp.top) == 2 for lp in o.logprobs)
        assert o.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in o.logprobs), abs=1e-4)


def test_abort_frees_blocks_at_once(llm: LLM) -> None:
    eng = llm.engine
    rid = eng.add_request(llm.tokenizer.encode(PROMPTS[3]), greedy(100, ignore_eos=True))
    other = eng.add_request(llm.tokenizer.encode(PROMPTS[1]), greedy(5, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.kv.pool.num_used > 0
    final = eng.abort_request(rid)
    assert final is not None and final.finished and final.outputs[0].finish_reason == "abort"
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.kv.pool.num_free == eng.kv.pool.num_blocks
    assert eng.abort_request(other) is None  # already finished


def test_stream_abandoned_early_aborts(llm: LLM) -> None:
    gen = llm.stream(PROMPTS[0], greedy(50, ignore_eos=True))
    next(gen)
    gen.close()
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks


def test_validation_errors(llm: LLM) -> None:
    with pytest.raises(InvalidRequest, match="empty"):
        llm.generate([[]], greedy())
    with pytest.raises(InvalidRequest, match="empty"):
        llm.generate("", greedy())
    with pytest.raises(ContextTooLong, match="256"):
        llm.generate([[5] * 300], greedy())
    with pytest.raises(InvalidRequest, match="vocabulary"):
        llm.generate([[10**6]], greedy())
    # A bad prompt in a batch rejects the batch before anything is queued.
    with pytest.raises(ContextTooLong):
        llm.generate([PROMPTS[0], [5] * 300], greedy())
    assert not llm.engine.has_unfinished_requests()


def test_engine_config_errors(tiny_llama: Path) -> None:
    with pytest.raises(ConfigError, match="kv-cache-memory"):
        LLM(str(tiny_llama), kv_cache_memory="lots")
    with pytest.raises(ConfigError, match="max-num-batched-tokens"):
        LLM(str(tiny_llama), max_num_seqs=64, max_num_batched_tokens=8)
    with pytest.raises(ConfigError, match="fewer than one"):
        LLM(str(tiny_llama), kv_cache_memory="1KB")
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM("/nonexistent/model")


def test_capacity_report(llm: LLM) -> None:
    cap = llm.engine.capacity
    # 16 MiB / (2 KiB per 4 tokens... here block 16: 2*2*2*16*4 bytes/token * 16 tokens = 8 KiB per block).
    assert cap.num_blocks == 16 * 2**20 // (2 * 2 * 2 * 16 * 4 * 16)
    assert cap.num_tokens == cap.num_blocks * 16
    assert cap.max_concurrency == pytest.approx(cap.num_blocks / (256 // 16))
    assert "max concurrency" in cap.describe()


def test_chat_uses_template(llm: LLM) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    rendered = llm.tokenizer.apply_chat_template(messages)
    assert rendered == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    a = llm.chat(messages, greedy(8, ignore_eos=True))[0]
    assert a.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert len(a.outputs[0].token_ids) == 8


def test_priority_and_metrics(llm: LLM) -> None:
    outs = llm.generate(PROMPTS[:3], greedy(4, ignore_eos=True), priority=[2, 0, 1])
    for o in outs:
        m = o.metrics
        assert m is not None and m.time_to_first_token is not None and m.e2e_latency is not None
        assert 0 <= m.queue_time <= m.time_to_first_token <= m.e2e_latency
    assert llm.engine.stats.generated_tokens > 0


def test_cli_generate_reports_errors() -> None:
    r = subprocess.run([sys.executable, "-m", "tokenloom.cli", "generate", "hi", "--model", "/no/such/model"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "does not exist" in r.stderr
