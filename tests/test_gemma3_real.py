"""The second real model, Gemma 3 270M (Q4_K_M GGUF, assembled by `make setup`), against transformers loading
the same file: its tokenizer, its greedy output, and a factual answer.

The file is the pretrained model (google/gemma-3-270m, not the -it one: no general.finetune, no chat template
in the file). Through Gemma's chat template it echoes the question, in transformers exactly as here (the
parity test below runs on chat prompts), so its "Paris" is asked for as a completion.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from conftest import hf_greedy_ids
from tokenloom import LLM, SamplingParams
from tokenloom.errors import ModelLoadError
from tokenloom.models.default import gemma3_270m_path

MAX_NEW = 12
# float32 on both sides, the same dequantized weights; 18 layers of summation-order differences on logits of
# magnitude ~100 (measured: 1e-4 on the logits).
LOGPROB_ATOL = 1e-3
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence, please, and keep it short and simple for a beginner.",
]
STRINGS = [
    "Hello world", "  leading spaces", "trailing spaces   ", "new\nlines\n\n\nhere", "tabs\tand\t\tmore",
    "Ünïcödé façade naïve", "日本語のテキストです。", "emoji 🤖🚀👍🏽 family 👨‍👩‍👧", "def f(x):\n    return x * 2  # comment\n",
    "1234567890 3.14159 -42 1e10", "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", "<bos>text<eos>",
    "a  b   c    d", "   ", "\n", "x", "The quick brown fox jumps over the lazy dog.", "Привет, мир!",
    "مرحبا بالعالم", "🙂", "\u00a0nbsp\u200bzero width", "C++ && Rust || Go != Java; <html><table></table></html>",
    "$$\\frac{a}{b}$$", "URL: https://example.com/path?q=1&r=2#frag", "snake_case camelCase PascalCase kebab-case",
    "   \n  \n", "<unused0> <mask> [multimodal]", "Ǆ ǅ ǆ ﬁ ﬂ ① ²", "वाक्य हिंदी में", "Mixed: 中文 English 123 !!!???",
    "a\r\nb\rc", "<start_of_image>", "😀😀😀😀😀", "quote \"double\" 'single' `back`", "",
]


@pytest.fixture(scope="module")
def gguf() -> Path:
    try:
        return gemma3_270m_path()
    except ModelLoadError as e:
        pytest.skip(f"Gemma 3 270M is not assembled ({e})")


@pytest.fixture(scope="module")
def ours(gguf: Path) -> LLM:
    return LLM(str(gguf), dtype="float32", gguf_weights="dequantize", kv_cache_memory="128MiB", max_model_len=1024)


@pytest.fixture(scope="module")
def reference(gguf: Path, one_gguf_parse: None) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference_tokenizer(gguf: Path, one_gguf_parse: None) -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def test_tokenizer_ids_match_transformers(ours: LLM, reference_tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    ref = reference_tokenizer
    assert len(STRINGS) >= 30
    for s in STRINGS:
        assert ours.tokenizer.encode(s) == ref.encode(s), s
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "What is 2 + 2?"}]
    text = ours.tokenizer.apply_chat_template(chat)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\nHello!"
                    "<end_of_turn>\n<start_of_turn>user\nWhat is 2 + 2?<end_of_turn>\n<start_of_turn>model\n")
    assert ours.tokenizer.encode_chat(chat) == ref.encode(text, add_special_tokens=False)
    assert ours.tokenizer.backend.token_to_id("<end_of_turn>") in ours.tokenizer.eos_token_ids


def test_greedy_ids_and_logprobs_match_transformers(ours: LLM, reference: transformers.PreTrainedModel) -> None:
    prompts = [ours.tokenizer.encode_chat([{"role": "user", "content": c}]) for c in CHATS]
    assert len({len(p) for p in prompts}) == len(prompts), "mixed prompt lengths"
    outs = ours.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5))
    with torch.no_grad():
        for ids, out in zip(prompts, outs):
            ref_ids, ref_lp = hf_greedy_ids(reference, ids, MAX_NEW)
            assert out.outputs[0].token_ids == ref_ids
            first = out.outputs[0].logprobs[0]
            for tok, lp in first.top.items():
                assert abs(lp - float(ref_lp[tok])) < LOGPROB_ATOL


def test_long_prompt_past_the_window_matches_transformers(ours: LLM, reference: transformers.PreTrainedModel) -> None:
    """A prompt longer than the local layers' 512-token window: their mask and the global layers' RoPE base
    both matter here."""
    ids = ours.tokenizer.encode(" ".join(f"item {i}: the value is {i * 7 % 13}." for i in range(60)))
    assert len(ids) > 512
    out = ours.generate([ids], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].outputs[0]
    with torch.no_grad():
        assert out.token_ids == hf_greedy_ids(reference, ids, 4)[0]


def test_capital_of_france_is_paris(gguf: Path) -> None:
    """tokenloom's default path for the file (bfloat16; GGUF layers kept quantized where the kernels take
    their type, the rest dequantized)."""
    llm = LLM(str(gguf), kv_cache_memory="64MiB", max_model_len=512)
    assert llm.engine.loaded.dtype is torch.bfloat16
    out = llm.generate(["Q: What is the capital of France?\nA:"], SamplingParams(temperature=0, max_tokens=12))
    assert "Paris" in out[0].outputs[0].text


def test_assembly_refuses_a_wrong_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenloom.models import assemble

    parts = []
    for i in range(4):
        parts.append(tmp_path / f"part{i}")
        parts[-1].write_bytes(bytes([i]) * 1000)
    monkeypatch.setattr(assemble, "part_paths", lambda: parts)
    with pytest.raises(ModelLoadError, match="sha256"):
        assemble.assemble(tmp_path / "out")
    assert not any((tmp_path / "out").iterdir())  # nothing half-written left behind
