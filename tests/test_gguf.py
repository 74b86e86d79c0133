"""GGUF loading against its references: `gguf.quants` (numpy) for dequantization, and transformers'
own GGUF loading for weights, config and tokenizer, on the real SmolLM2 file and on tiny files
written here with `gguf.GGUFWriter`."""

from __future__ import annotations

import importlib
import io
import math
import pydoc
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, TokenType

from tokenloom.errors import ConfigError, ModelLoadError, UnsupportedArchitecture
from tokenloom.models.config import ModelConfig
from tokenloom.models.default import default_model_path
from tokenloom.models.gguf import config_from_gguf, load_gguf
from tokenloom.models.gguf_file import GGUFFile, read_gguf
from tokenloom.models.gguf_tokenizer import tokenizer_from_gguf
from tokenloom.models.gguf_quants import dequantize, has_torch_dequantizer
from tokenloom.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")


# --- dequantization ---------------------------------------------------------------------------------

# Byte offsets of the float16 scale fields in one block, so random blocks get finite scales.
F16_FIELDS: dict[Q, tuple[int, ...]] = {
    Q.Q8_0: (0,),
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.IQ4_NL: (0,),  # no torch version: checks the numpy fallback
}
QUANTIZABLE = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]


def random_blocks(qtype: Q, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    _, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, type_size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scales = rng.normal(0, 0.05, size=len(raw)).astype(np.float16)
        raw[:, off : off + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", list(F16_FIELDS), ids=lambda q: q.name)
def test_dequantize_random_blocks_match_numpy(qtype: Q) -> None:
    raw = random_blocks(qtype, rows=6, blocks_per_row=3)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    got = dequantize(raw, qtype, tuple(ref.shape))
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert torch.equal(got, ref)
    assert torch.equal(dequantize(raw, qtype, tuple(ref.shape), torch.bfloat16), ref.bfloat16())


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda q: q.name)
def test_dequantize_quantized_data_matches_numpy(qtype: Q) -> None:
    x = np.random.default_rng(1).normal(size=(8, 64)).astype(np.float32)
    raw = gguf.quants.quantize(x, qtype)
    ref = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32))
    got = dequantize(raw, qtype, (8, 64))
    assert torch.equal(got, ref)
    if qtype in (Q.F32, Q.F16, Q.BF16):
        assert torch.allclose(got, torch.from_numpy(x), rtol=1e-2, atol=1e-2)


def test_dequantize_spans_several_chunks() -> None:
    # 4 M elements: several internal chunks of work.
    raw = random_blocks(Q.Q4_K, rows=64, blocks_per_row=256, seed=2)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, Q.Q4_K))
    assert torch.equal(dequantize(raw, Q.Q4_K, tuple(ref.shape)), ref)


def test_dequantize_errors_name_the_problem() -> None:
    assert has_torch_dequantizer(Q.Q6_K) and not has_torch_dequantizer(Q.IQ4_NL)
    with pytest.raises(ModelLoadError, match="Q4_0"):
        dequantize(np.zeros(18 * 3, dtype=np.uint8), Q.Q4_0, (2, 64))  # needs 4 blocks
    with pytest.raises(ModelLoadError, match="multiple"):
        dequantize(np.zeros(18, dtype=np.uint8), Q.Q4_0, (1, 20))
    with pytest.raises(ModelLoadError, match="Q8_K"):  # no numpy dequantizer either
        dequantize(np.zeros(GGML_QUANT_SIZES[Q.Q8_K][1], dtype=np.uint8), Q.Q8_K, (1, 256))


# --- the real SmolLM2 file ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_path() -> Path:
    try:
        return default_model_path()
    except ModelLoadError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def smol(smol_path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    return load_gguf(smol_path, torch.float32)


@pytest.fixture(scope="module")
def hf_smol_state_dict(smol_path: Path, one_gguf_parse: None) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smol_path.parent, gguf_file=smol_path.name, dtype=torch.float32
    )
    return model.state_dict()


@pytest.fixture(scope="module")
def hf_smol_tokenizer(smol_path: Path, one_gguf_parse: None) -> Any:
    return transformers.AutoTokenizer.from_pretrained(smol_path.parent, gguf_file=smol_path.name)


def assert_within(ours: torch.Tensor, ref: torch.Tensor, key: str, atol: float = 1e-6) -> None:
    ref = ref.float()
    assert ours.shape == ref.shape, key
    if not torch.equal(ours, ref):  # cheap exact check first; these are bit-identical in practice
        assert (ours - ref).abs().max().item() <= atol, key


def test_smollm2_config(smol: tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]) -> None:
    cfg = smol[0]
    assert cfg.architecture == "LlamaForCausalLM" and cfg.family == "llama"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings and not cfg.attention_bias
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling.kind == "default"
    assert cfg.max_position_embeddings == 8192
    assert math.isclose(cfg.rms_norm_eps, 1e-5, rel_tol=1e-6)
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)


def test_smollm2_weights_match_transformers(
    smol: tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer], hf_smol_state_dict: dict[str, torch.Tensor]
) -> None:
    ours = smol[1]
    # transformers lists the tied lm_head too; a tied model has none of its own here.
    assert set(ours) == set(hf_smol_state_dict) - {"lm_head.weight"}
    for layer in (0, 1, 17, 29):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm"):
            key = f"model.layers.{layer}.{name}.weight"
            assert_within(ours[key], hf_smol_state_dict[key], key)
    for key in ("model.embed_tokens.weight", "model.norm.weight"):
        assert_within(ours[key], hf_smol_state_dict[key], key)
    assert all(t.dtype == torch.float32 for t in ours.values())


def test_bfloat16_load_is_the_float32_load_rounded(
    smol_path: Path, smol: tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]
) -> None:
    _, sd16, _ = load_gguf(smol_path, torch.bfloat16)
    for key in ("model.embed_tokens.weight", "model.layers.3.self_attn.q_proj.weight", "model.norm.weight"):
        assert sd16[key].dtype == torch.bfloat16
        assert torch.equal(sd16[key], smol[1][key].bfloat16())
    with pytest.raises(ConfigError):
        load_gguf(smol_path, torch.int8)


def test_reader_metadata_matches_gguf_reader(smol_path: Path) -> None:
    ours = read_gguf(smol_path)
    ref = gguf.GGUFReader(smol_path)
    for key in ("general.architecture", "llama.block_count", "llama.rope.freq_base", "tokenizer.ggml.pre",
                "tokenizer.chat_template", "tokenizer.ggml.add_bos_token"):
        assert ours.metadata[key] == ref.fields[key].contents(), key
    assert ours.metadata["tokenizer.ggml.tokens"] == ref.fields["tokenizer.ggml.tokens"].contents()
    assert list(ours.metadata["tokenizer.ggml.token_type"]) == ref.fields["tokenizer.ggml.token_type"].contents()
    assert len(ours.tensors) == len(ref.tensors)
    for t in ref.tensors[:20]:
        info = ours.tensors[t.name]
        assert info.qtype == t.tensor_type and info.shape == tuple(int(d) for d in reversed(t.shape))
        assert np.array_equal(ours.raw(t.name), np.asarray(t.data).reshape(-1).view(np.uint8))


TEXTS = [
    "Hello world",
    "Hello, world! How are you?",
    " leading space",
    "trailing space ",
    "  two leading spaces",
    "multiple    spaces   inside",
    "   ",
    "",
    "\tTabs\tand\nnewlines\n",
    "\n\nDouble newline first",
    "line1\r\nline2",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "3.14159 2718281828 1,000,000 42nd 0x1F",
    "Numbers: 12345678901234567890",
    "Café naïve résumé façade",
    "東京は日本の首都です。",
    "Привет, мир!",
    "مرحبا بالعالم",
    "😀🎉👍🏽 emoji 🇫🇷",
    "<|im_start|>user\nHi<|im_end|>\n",
    "text<|im_end|>more<|endoftext|>",
    "<|im_start|><|im_start|>",
    "<s>hello</s> <unk>",
    "<think>reasoning</think> and <|user|>",
    "I'm sure they can't, won't, and we've",
    "UPPER lower MiXeD",
    "https://example.com/path?q=1&x=y",
    "a\u00a0b\u200bc",
    "ﬁ ligature ÅÅ Ω",
    "The quick brown fox jumps over the lazy dog. " * 3,
]

CHAT = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is the capital of France?  Answer in one word.\n"},
]


def assert_same_tokenizer(ours: Tokenizer, ref: Any) -> None:
    for text in TEXTS:
        ids = ref(text)["input_ids"]
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False)["input_ids"], text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
    assert ours.bos_token == ref.bos_token and ours.eos_token == ref.eos_token
    assert ours.vocab_size == len(ref)


def assert_same_chat(ours: Tokenizer, ref: Any) -> None:
    text = ref.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(CHAT, add_generation_prompt=True) == text
    ref_ids = ref.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    if isinstance(ref_ids, Mapping):
        ref_ids = ref_ids["input_ids"]
    assert ours.encode_chat(CHAT, add_generation_prompt=True) == list(ref_ids)


def test_smollm2_tokenizer_matches_transformers(
    smol: tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer], hf_smol_tokenizer: Any
) -> None:
    tok = smol[2]
    assert_same_tokenizer(tok, hf_smol_tokenizer)
    assert_same_chat(tok, hf_smol_tokenizer)
    assert tok.encode("<|im_start|>") == [1] and tok.stop_token_ids == (2,) and not tok.add_bos_token
    assert tok.decode(tok.encode("a<|im_end|>b"), skip_special_tokens=True) == "ab"


# --- tiny files written here -------------------------------------------------------------------------


def write_gguf(path: Path, arch: str, tokenizer: dict[str, Any] | None = None,
               tensors: dict[str, tuple[np.ndarray, Q]] | None = None, **kv: Any) -> Path:
    """A GGUF with llama-style hyper-parameters (overridable via kv), tokenizer metadata and tensors."""
    w = gguf.GGUFWriter(path, arch)
    hp = {"block_count": 1, "context_length": 128, "embedding_length": 64, "feed_forward_length": 96,
          "attention.head_count": 4, "attention.head_count_kv": 2,
          "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 10000.0} | kv
    for k, v in hp.items():
        (w.add_float32 if isinstance(v, float) else w.add_uint32)(f"{arch}.{k}", v)
    for k, v in (tokenizer or {}).items():
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, str):
            w.add_string(k, v)
        else:
            w.add_array(k, list(v))
    for name, (arr, qtype) in (tensors or {}).items():
        data = arr if qtype in (Q.F32, Q.F16) else gguf.quants.quantize(arr, qtype)
        w.add_tensor(name, data.astype(np.float16) if qtype == Q.F16 else data,
                     raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch", ["gpt2", "falcon", "phi2"])
def test_unsupported_architecture_is_named(tmp_path: Path, arch: str) -> None:
    path = write_gguf(tmp_path / f"{arch}.gguf", arch)
    with pytest.raises(UnsupportedArchitecture, match=arch):
        load_gguf(path, torch.float32)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        read_gguf(bad)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(write_gguf(tmp_path / "ok.gguf", "llama").read_bytes()[:40])
    with pytest.raises(ModelLoadError):
        read_gguf(truncated)


def test_llama3_rope_scaling_read_from_rope_freqs(tmp_path: Path) -> None:
    # The divisors llama.cpp's converter writes for Llama 3.2 (factor 32, low 1, high 4, context 8192).
    head_dim, theta, factor = 16, 500000.0, 32.0
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (8192 / wavelen - 1) / 3
    div = np.where(wavelen < 2048, 1.0, np.where(wavelen > 8192, factor, 1 / ((1 - smooth) / factor + smooth)))
    path = write_gguf(tmp_path / "l3.gguf", "llama", {"tokenizer.ggml.tokens": byte_vocab()},
                      tensors={"rope_freqs.weight": (div.astype(np.float32), Q.F32)},
                      **{"embedding_length": 64, "attention.head_count": 4, "rope.freq_base": theta})
    rs = config_from_gguf(read_gguf(path)).rope_scaling
    assert (rs.kind, rs.factor, rs.original_max_position_embeddings) == ("llama3", factor, 8192)
    assert (rs.low_freq_factor, rs.high_freq_factor) == (1.0, 4.0)


def byte_vocab() -> list[str]:
    """The 256 single-byte tokens of a byte-level BPE vocabulary, spelled GPT-2's way."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return [bytes_to_unicode()[b] for b in range(256)]


def test_tiny_qwen2_weights_match_transformers(tmp_path: Path) -> None:
    """Qwen2: q/k/v biases, an untied lm_head, and no RoPE permutation; mixed tensor types."""
    rng = np.random.default_rng(3)
    h, ff, vocab, heads, kv_heads, d = 64, 96, 256, 4, 2, 16

    def w(*shape: int) -> np.ndarray:
        return rng.normal(0, 0.1, size=shape).astype(np.float32)

    tensors = {
        "token_embd.weight": (w(vocab, h), Q.Q8_0),
        "output_norm.weight": (1 + w(h), Q.F32),
        "output.weight": (w(vocab, h), Q.F16),
        "blk.0.attn_norm.weight": (1 + w(h), Q.F32),
        "blk.0.attn_q.weight": (w(heads * d, h), Q.Q4_0),
        "blk.0.attn_q.bias": (w(heads * d), Q.F32),
        "blk.0.attn_k.weight": (w(kv_heads * d, h), Q.Q5_1),
        "blk.0.attn_k.bias": (w(kv_heads * d), Q.F32),
        "blk.0.attn_v.weight": (w(kv_heads * d, h), Q.Q8_0),
        "blk.0.attn_v.bias": (w(kv_heads * d), Q.F32),
        "blk.0.attn_output.weight": (w(h, heads * d), Q.Q4_1),
        "blk.0.ffn_norm.weight": (1 + w(h), Q.F32),
        "blk.0.ffn_gate.weight": (w(ff, h), Q.Q5_0),
        "blk.0.ffn_up.weight": (w(ff, h), Q.F16),
        "blk.0.ffn_down.weight": (w(h, ff), Q.Q8_0),
    }
    tok = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": byte_vocab(),
           "tokenizer.ggml.token_type": [int(TokenType.NORMAL)] * vocab,
           "tokenizer.ggml.eos_token_id": 1}
    path = write_gguf(tmp_path / "qwen.gguf", "qwen2", tok, tensors, feed_forward_length=ff)
    cfg, ours, _ = load_gguf(path, torch.float32)
    assert cfg.architecture == "Qwen2ForCausalLM" and cfg.attention_bias and not cfg.tie_word_embeddings
    assert cfg.vocab_size == vocab and cfg.eos_token_ids == (1,)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    ref_sd = ref.state_dict()
    assert set(ours) == set(ref_sd)
    for key, value in ours.items():
        assert_within(value, ref_sd[key], key)


@pytest.fixture(scope="module")
def smol_tokenizer_metadata(smol_path: Path) -> GGUFFile:
    return read_gguf(smol_path)


@pytest.mark.parametrize("arch,pre", [("qwen2", "qwen2"), ("llama", "llama-bpe")])
def test_byte_level_split_regexes_match_transformers(
    tmp_path: Path, smol_tokenizer_metadata: GGUFFile, arch: str, pre: str
) -> None:
    """SmolLM2's vocabulary under other `tokenizer.ggml.pre` regexes, with BOS added by the file."""
    md = smol_tokenizer_metadata.metadata
    tok = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
           "tokenizer.ggml.tokens": md["tokenizer.ggml.tokens"],
           "tokenizer.ggml.token_type": [int(t) for t in md["tokenizer.ggml.token_type"]],
           "tokenizer.ggml.merges": md["tokenizer.ggml.merges"],
           "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.add_bos_token": True,
           "tokenizer.chat_template": md["tokenizer.chat_template"]}
    path = write_gguf(tmp_path / f"{pre}.gguf", arch, tok)
    ours = tokenizer_from_file(path)
    assert ours.add_bos_token and ours.encode("hi")[0] == 0
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert_same_tokenizer(ours, ref)
    assert_same_chat(ours, ref)


def tokenizer_from_file(path: Path) -> Tokenizer:
    return tokenizer_from_gguf(read_gguf(path))


def corpus() -> list[str]:
    mods = ["os", "re", "json", "collections", "argparse", "pathlib", "typing", "dataclasses", "unittest"]
    lines: list[str] = []
    for name in mods:
        mod = importlib.import_module(name)
        docs = [pydoc.getdoc(mod)] + [pydoc.getdoc(getattr(mod, a)) for a in dir(mod) if not a.startswith("_")]
        lines += "\n".join(docs)[:15000].splitlines()
    return lines + ["Café naïve résumé — 東京 北京 日本語 😀🎉 Ünïcödé ß Привет мир 3.14159 1,000,000"] * 3


def test_sentencepiece_tokenizer_matches_transformers(tmp_path: Path) -> None:
    """A `llama` (sentencepiece BPE) vocabulary, written as llama.cpp's converter does: scores, no merges,
    byte-fallback tokens, control and user-defined pieces, BOS added by default."""
    spm = pytest.importorskip("sentencepiece")
    from sentencepiece import sentencepiece_model_pb2

    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()), model_writer=proto, vocab_size=1000, model_type="bpe",
        byte_fallback=True, character_coverage=0.9995, user_defined_symbols=["<|user|>", "<think>"],
        control_symbols=["<|im_start|>", "<|im_end|>"], minloglevel=2,
    )
    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(proto.getvalue())
    # sentencepiece piece types: 1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte -- the
    # same numbering as llama.cpp's token_type.
    tok = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
           "tokenizer.ggml.tokens": [p.piece for p in model.pieces],
           "tokenizer.ggml.scores": [float(p.score) for p in model.pieces],
           "tokenizer.ggml.token_type": [int(p.type) for p in model.pieces],
           "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
           "tokenizer.ggml.unknown_token_id": 0,
           "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                                      "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                                      "{% endif %}"}
    path = write_gguf(tmp_path / "spm.gguf", "llama", tok)
    ours = tokenizer_from_file(path)
    assert ours.add_bos_token and ours.bos_token == "<s>"
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert_same_tokenizer(ours, ref)
    assert_same_chat(ours, ref)
