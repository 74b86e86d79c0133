"""Gemma 3 text (and Gemma 2) against transformers' Gemma3ForCausalLM / Gemma2ForCausalLM on tiny random-weight
models: interleaved sliding-window and global layers with their own RoPE bases, a window shorter than the prompts."""

from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from conftest import PROMPTS, assert_matches_reference, build_tokenizer
from test_models import MAX_NEW, hf_greedy
from test_qwen3 import _prefill_logits
from tokenloom import LLM, SamplingParams
from tokenloom.engine.fused_decode import FusedDecoder
from tokenloom.errors import ModelLoadError, UnsupportedArchitecture
from tokenloom.models.config import ModelConfig

LOGITS_ATOL = 2e-4  # float32 on both sides; differences come from summation order only
LOGPROB_ATOL = 2e-4
WINDOW = 4  # tokens; every prompt but "Hello" and "1 2 3" is longer, so the local layers' mask matters

# Local, global, local, local: both kinds, the global one with linear RoPE scaling on a base of its own.
GEMMA3 = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6, sliding_window=WINDOW,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
    query_pre_attn_scalar=24, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}},
)


def make_tiny_gemma(folder: Path, arch: str = "gemma3", seed: int = 0, **overrides: object) -> Path:
    """A random-weight Gemma saved by transformers. Every weight is drawn, the norms' too: Gemma's are
    centred on 0 (the model scales by 1 + w), so the default all-zero init would hide a missing (1 + w)."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(folder)
    if arch == "gemma3":
        cfg: transformers.PretrainedConfig = transformers.Gemma3TextConfig(vocab_size=vocab, **(GEMMA3 | overrides))
        model: torch.nn.Module = transformers.Gemma3ForCausalLM(cfg)
    else:
        common = {k: v for k, v in GEMMA3.items() if k != "rope_parameters"}
        cfg = transformers.Gemma2Config(vocab_size=vocab, **(common | overrides))
        model = transformers.Gemma2ForCausalLM(cfg)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08 if p.dim() > 1 else 0.3)
    model.float().save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gemma(tmp_path_factory.mktemp("gemma3"), seed=21)


def test_config(tiny_gemma3: Path) -> None:
    cfg = ModelConfig.from_hf_folder(tiny_gemma3)
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.family == "gemma"
    assert [cfg.layer_window(i) for i in range(4)] == [WINDOW, None, WINDOW, WINDOW]
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling.kind == "linear" and cfg.rope_local_theta == 1000.0
    assert cfg.qk_norm and cfg.tie_word_embeddings and cfg.query_pre_attn_scalar == 24
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.final_logit_softcapping is None


def test_prefill_logits_match_transformers(tiny_gemma3: Path) -> None:
    llm = LLM(str(tiny_gemma3), dtype="float32", kv_cache_memory="16MiB", attention_backend="reference")
    ref = transformers.Gemma3ForCausalLM.from_pretrained(tiny_gemma3, dtype=torch.float32).eval()
    for prompt in PROMPTS[1:4]:
        ids = llm.tokenizer.encode(prompt)
        assert len(ids) > WINDOW
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(_prefill_logits(llm, ids), want, rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_engine_greedy_matches_transformers_with_preemption(tiny_gemma3: Path, backend: str) -> None:
    """Mixed-length prompts through the paged cache: prefill chunks of at most 16 tokens, and a cache too small
    for the batch, so requests are preempted and recomputed. The budget is 16 blocks' worth of K/V for every
    layer; with the windowed layers' blocks released, it buys 64 blocks (256 tokens), fewer than the batch needs."""
    cfg = ModelConfig.from_hf_folder(tiny_gemma3)
    block_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * 4  # K,V float32, 4 tokens
    llm = LLM(str(tiny_gemma3), dtype="float32", block_size=4, max_model_len=160, kv_cache_memory=str(16 * block_bytes),
              max_num_batched_tokens=16, max_num_seqs=8, enable_prefix_caching=False, attention_backend=backend)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5))
    assert llm.engine.scheduler.num_preemptions > 0
    ref_ids, ref_lp = hf_greedy(tiny_gemma3, prompts)
    assert_matches_reference(outs, ref_ids, ref_lp, LOGPROB_ATOL)
    llm.engine.kv.pool.check_invariants()


def test_fused_decode_needs_the_gemma_stack_and_bfloat16_runs(tiny_gemma3: Path) -> None:
    """Gemma's norms, GeGLU and per-layer RoPE tables are the Gemma stack's (tests/test_gemma_stack.py): kernels
    with only the Llama stack leave a Gemma on the Python model, which decodes in bfloat16 too."""
    llm = LLM(str(tiny_gemma3), dtype="bfloat16", kv_cache_memory="16MiB", fused_decode=False)
    able_kernels = types.SimpleNamespace(DecodeStack=object, skinny_available=lambda: True)
    why = FusedDecoder.supports(able_kernels, llm.engine.loaded.model, torch.device("cpu"))  # type: ignore[arg-type]
    assert why is not None and "Gemma" in why
    out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)


def test_gemma2_with_final_softcapping_matches_transformers(tmp_path: Path) -> None:
    """Gemma 2: no q/k norm, one RoPE base, the final logits soft-capped (at 3, near the logits' size, so the cap bites)."""
    folder = make_tiny_gemma(tmp_path / "gemma2", arch="gemma2", seed=22, attn_logit_softcapping=None,
                             final_logit_softcapping=3.0, layer_types=None)
    cfg = ModelConfig.from_hf_folder(folder)
    assert cfg.family == "gemma" and not cfg.qk_norm and cfg.rope_local_theta is None
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2  # Gemma 2 alternates
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB", attention_backend="reference")
    ref = transformers.Gemma2ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = llm.tokenizer.encode(PROMPTS[1])
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    assert want.abs().max() < 3.0  # capped
    torch.testing.assert_close(_prefill_logits(llm, ids), want, rtol=0, atol=LOGITS_ATOL)


def test_multimodal_gemma3_is_refused_by_name(tiny_gemma3: Path) -> None:
    raw = json.loads((tiny_gemma3 / "config.json").read_text())
    with pytest.raises(UnsupportedArchitecture, match="Gemma3ForConditionalGeneration"):
        ModelConfig.from_hf_dict({**raw, "architectures": ["Gemma3ForConditionalGeneration"]})


# --- GGUF ---------------------------------------------------------------------------------------------

_GEMMA_GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def write_gemma3_gguf(folder: Path, path: Path, arch: str = "gemma3") -> Path:
    """The tiny HF Gemma 3 as a float32 GGUF laid out as llama.cpp's converter writes it: the norm weights
    stored as 1 + w, no q/k row permutation, every 6th layer global (so the tiny model has 6 layers). With
    arch="gemma2", a tiny HF Gemma 2 (no q/k norms; every 2nd layer global) with its soft-capping values."""
    from gguf import GGMLQuantizationType as Q
    from safetensors.torch import load_file

    from test_gguf import write_gguf

    hf = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    tokenizer = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": [t for t, _ in vocab],
                 "tokenizer.ggml.merges": merges, "tokenizer.ggml.eos_token_id": int(hf["eos_token_id"])}
    tensors: dict[str, tuple[np.ndarray, Q]] = {}
    for name, value in load_file(str(folder / "model.safetensors")).items():
        w = value.float().numpy()
        if name == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = (w, Q.F32)
        elif name == "model.norm.weight":
            tensors["output_norm.weight"] = (w + 1, Q.F32)
        else:
            _, _, i, rest = name.split(".", 3)  # model.layers.{i}.{module}.weight
            module = rest.removesuffix(".weight")
            tensors[f"blk.{i}.{_GEMMA_GGUF_NAMES[module]}.weight"] = (w + 1 if "norm" in module else w, Q.F32)
    rope = hf.get("rope_parameters") or {}
    theta = (rope.get("full_attention") or rope).get("rope_theta", hf.get("rope_theta", 10000.0))
    caps = {k: float(hf[k]) for k in ("attn_logit_softcapping", "final_logit_softcapping") if hf.get(k) is not None}
    hp = {"block_count": hf["num_hidden_layers"], "context_length": hf["max_position_embeddings"],
          "embedding_length": hf["hidden_size"], "feed_forward_length": hf["intermediate_size"],
          "attention.head_count": hf["num_attention_heads"], "attention.head_count_kv": hf["num_key_value_heads"],
          "attention.key_length": hf["head_dim"], "attention.value_length": hf["head_dim"],
          "attention.layer_norm_rms_epsilon": float(hf["rms_norm_eps"]),
          "attention.sliding_window": hf["sliding_window"],
          "rope.freq_base": float(theta), **caps}
    return write_gguf(path, arch, tokenizer, tensors, **hp)


def test_gguf_round_trip_matches_transformers(tmp_path: Path) -> None:
    """What transformers reads from a Gemma 3 GGUF: layers 1-5 local and 6 global, the local RoPE base 10000,
    no RoPE scaling, query_pre_attn_scalar = head_dim. The tiny HF model is made so; then both load the file."""
    layers = ["sliding_attention"] * 5 + ["full_attention"]
    folder = make_tiny_gemma(tmp_path / "hf", seed=24, num_hidden_layers=6, layer_types=layers,
                             query_pre_attn_scalar=32,
                             rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    path = write_gemma3_gguf(folder, tmp_path / "gemma3.gguf")
    from tokenloom.models.gguf import load_gguf

    cfg, sd, _ = load_gguf(path, torch.float32)
    want = ModelConfig.from_hf_folder(folder)
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.layer_types == want.layer_types
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (1e6, 10000.0, 32.0)
    assert cfg.sliding_window == WINDOW and cfg.qk_norm and cfg.tie_word_embeddings
    hf_sd = transformers.Gemma3ForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    torch.testing.assert_close(sd["model.layers.2.post_feedforward_layernorm.weight"],
                               hf_sd["model.layers.2.post_feedforward_layernorm.weight"], rtol=0, atol=1e-6)
    llm = LLM(str(path), dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=16, max_num_seqs=4)
    ref_tok = transformers.AutoTokenizer.from_pretrained(folder)
    prompts = [ref_tok.encode(p) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    ref_ids, _ = hf_greedy(folder, prompts)
    assert [o.outputs[0].token_ids for o in outs] == ref_ids


def test_gguf_missing_post_norm_is_named(tmp_path: Path) -> None:
    from tokenloom.models.gguf import config_from_gguf, state_dict_from_gguf
    from tokenloom.models.gguf_file import read_gguf

    folder = make_tiny_gemma(tmp_path / "hf", seed=25, num_hidden_layers=6,
                             layer_types=["sliding_attention"] * 5 + ["full_attention"])
    f = read_gguf(write_gemma3_gguf(folder, tmp_path / "gemma3.gguf"))
    del f.tensors["blk.3.post_ffw_norm.weight"]  # as if the file lacked it
    with pytest.raises(ModelLoadError, match="post_feedforward_layernorm"):
        state_dict_from_gguf(f, config_from_gguf(f), torch.float32)


def test_gemma_merges_equal_transformers_generate_merges() -> None:
    """The merges rebuilt from a Gemma vocabulary's order (gguf_tokenizer._merges_by_position, without the global
    sort) equal transformers' `generate_merges(vocab, {token: -position})`, on a vocabulary with ties to break."""
    from transformers.tokenization_utils_base import generate_merges

    from tokenloom.models.gguf_tokenizer import _merges_by_position

    tokens = ["<pad>", "a", "b", "c", "▁", "ab", "bc", "abc", "▁a", "▁ab", "ca", "cab", "abca", "▁▁", "▁▁▁", "bca",
              "aa", "aaa", "aaaa", "▁abc", "cc"]
    want = generate_merges({t: i for i, t in enumerate(tokens)}, {t: -i for i, t in enumerate(tokens)})
    assert _merges_by_position(tokens) == want and len(want) > len(tokens)


def test_gemma_norm_equals_its_reference_and_follows_weight_changes() -> None:
    """The fused rms_norm path gives the reference's values (bfloat16 and float32, with and without the residual
    add), and a weight changed after a call is picked up once refresh_scale() rebuilds the cached (1 + w)."""
    from tokenloom.models.gemma import GemmaRMSNorm

    torch.manual_seed(0)
    norm = GemmaRMSNorm(96, 1e-6)
    norm.weight.data.normal_(0, 0.3)
    for dtype in (torch.float32, torch.bfloat16):
        x, r = torch.randn(5, 96).to(dtype), torch.randn(5, 96).to(dtype)
        for residual in (None, r):
            got, got_res = norm(x, residual)
            want, want_res = norm.reference(x, residual)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6 if dtype == torch.float32 else 0)
            assert torch.equal(got_res, want_res)
    x = torch.randn(3, 96)
    norm(x)
    norm.weight.data.add_(1.0)
    norm.refresh_scale()
    torch.testing.assert_close(norm(x)[0], norm.reference(x)[0], rtol=0, atol=1e-6)
