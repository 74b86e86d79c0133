"""Phi-3 / Phi-4-mini (fused qkv/gate_up checkpoint tensors, LongRoPE, partial rotary) against transformers'
Phi3ForCausalLM."""

from __future__ import annotations

import random
import types
from pathlib import Path

import pytest
import torch
import transformers

from conftest import PROMPTS, make_tiny_model
from test_models import check_parity
from test_qwen3 import _prefill_logits
from tokenloom.engine.fused_decode import FusedDecoder
from tokenloom.models.config import ModelConfig

PHI3 = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
# Every PROMPTS prompt (at most 112 tokens here) is shorter than ORIG_MAX; the longest one's decode steps
# cross it (positions 112..127), where transformers switches to the long factors.
ORIG_MAX, MAX_POS = 120, 256


def _longrope(rotary_dim: int, seed: int) -> dict[str, object]:
    rng = random.Random(seed)
    return dict(rope_type="longrope", rope_theta=10000.0,
                short_factor=[rng.uniform(1, 3) for _ in range(rotary_dim // 2)],
                long_factor=[rng.uniform(1, 3) for _ in range(rotary_dim // 2)])


CONFIGS = {
    "plain": dict(seed=21),
    "longrope": dict(seed=22, rope_scaling=_longrope(16, 1), original_max_position_embeddings=ORIG_MAX,
                     max_position_embeddings=MAX_POS),
    # Phi-4-mini: LongRoPE over the first 0.75 of each head (12 of 16 dims)
    "partial": dict(seed=23, partial_rotary_factor=0.75, rope_scaling=_longrope(12, 2),
                    original_max_position_embeddings=ORIG_MAX, max_position_embeddings=MAX_POS),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny_phi3(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    kw = dict(CONFIGS[request.param])
    seed = int(kw.pop("seed"))  # type: ignore[arg-type]
    return make_tiny_model(tmp_path_factory.mktemp(f"phi3-{request.param}"), arch="phi3", seed=seed, **(PHI3 | kw))


def test_config(tiny_phi3: Path) -> None:
    cfg = ModelConfig.from_hf_folder(tiny_phi3)
    ref = transformers.AutoConfig.from_pretrained(tiny_phi3)
    assert cfg.architecture == "Phi3ForCausalLM" and cfg.family == "llama"
    assert not cfg.attention_bias and not cfg.mlp_bias and not cfg.qk_norm and cfg.head_dim == 16
    assert cfg.rotary_dim == int(16 * ref.rope_parameters.get("partial_rotary_factor", 1.0))
    if cfg.rope_scaling.kind == "longrope":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        _, attention = ROPE_INIT_FUNCTIONS["longrope"](ref, None)
        assert cfg.rope_scaling.original_max_position_embeddings == ORIG_MAX
        assert cfg.rope_scaling.attention_factor == pytest.approx(attention) and attention > 1


def test_rope_table_matches_transformers(tiny_phi3: Path) -> None:
    """Short factors below original_max_position_embeddings, long ones from it on, as transformers picks them
    for a forward whose last position is below / at or past it."""
    from tokenloom import LLM

    llm = LLM(str(tiny_phi3), dtype="float32", kv_cache_memory="16MiB", attention_backend="reference")
    rotary = llm.engine.loaded.model.rotary
    ref = transformers.Phi3ForCausalLM.from_pretrained(tiny_phi3, dtype=torch.float32).model.rotary_emb
    x = torch.zeros(1, dtype=torch.float32)
    short_pos = torch.arange(ORIG_MAX)
    long_pos = torch.arange(ORIG_MAX, min(MAX_POS, rotary.max_position))
    for pos in (short_pos, long_pos):
        cos, sin = ref(x, pos.view(1, -1))
        ours_cos, ours_sin = rotary.lookup(pos, torch.float32)
        torch.testing.assert_close(ours_cos[:, 0], cos[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(ours_sin[:, 0], sin[0], rtol=0, atol=1e-5)


def test_prefill_logits_match_transformers(tiny_phi3: Path) -> None:
    from tokenloom import LLM

    llm = LLM(str(tiny_phi3), dtype="float32", kv_cache_memory="16MiB", attention_backend="reference")
    ref = transformers.Phi3ForCausalLM.from_pretrained(tiny_phi3, dtype=torch.float32).eval()
    for prompt in PROMPTS[1:4]:
        ids = llm.tokenizer.encode(prompt)
        assert len(ids) < ORIG_MAX
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(_prefill_logits(llm, ids), want, rtol=0, atol=2e-4)


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_engine_greedy_matches_transformers(tiny_phi3: Path, backend: str) -> None:
    # Small batches chunk the longer prompts; the longest prompt's decode crosses ORIG_MAX (longrope configs).
    check_parity(tiny_phi3, backend, max_num_batched_tokens=16, max_num_seqs=4)


def test_prompt_longer_than_original_max_is_documented_divergence(tmp_path: Path) -> None:
    """A prompt past original_max_position_embeddings: transformers ropes all of it with the long factors,
    tokenloom keeps the short ones below original_max (its paged cache never re-ropes written keys). Only the
    table rows from original_max on agree, so the logits differ; this pins that behaviour down."""
    from tokenloom import LLM

    kw = {k: v for k, v in CONFIGS["longrope"].items() if k != "seed"} | {"original_max_position_embeddings": 8}
    folder = make_tiny_model(tmp_path / "phi3", arch="phi3", seed=24, **(PHI3 | kw))
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB", attention_backend="reference")
    ids = llm.tokenizer.encode(PROMPTS[1])  # 34 tokens > 8
    ref = transformers.Phi3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    got = _prefill_logits(llm, ids)
    torch.testing.assert_close(got[:8], ref(torch.tensor([ids[:8]])).logits[0].detach(), rtol=0, atol=2e-4)
    assert not torch.allclose(got, want, atol=2e-4)


def test_fused_decode_refuses_partial_rotary(tmp_path: Path) -> None:
    from tokenloom import LLM, SamplingParams

    kw = dict(CONFIGS["partial"])
    kw.pop("seed")
    folder = make_tiny_model(tmp_path / "phi4", arch="phi3", seed=25, **(PHI3 | kw))
    llm = LLM(str(folder), dtype="bfloat16", kv_cache_memory="16MiB")
    able_kernels = types.SimpleNamespace(DecodeStack=object, skinny_available=lambda: True)
    why = FusedDecoder.supports(able_kernels, llm.engine.loaded.model, torch.device("cpu"))  # type: ignore[arg-type]
    assert why is not None and "partial rotary" in why
    out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)


# --- GGUF (llama.cpp's "phi3": attn_qkv and ffn_up fused, LongRoPE factors as tensors) ------------------------


def write_phi3_gguf(folder: Path, path: Path, linear_type: object = None) -> Path:
    """The tiny HF model as a GGUF (float32; the 2-D linear weights in `linear_type` when given), as llama.cpp's Phi3MiniModel converter writes it: qkv_proj ->
    attn_qkv, gate_up_proj -> ffn_up (no q/k row permutation), rope.dimension_count the rotary dims, and for
    LongRoPE rope_factors_long/short tensors, the original context length and the attention factor."""
    import json
    import math

    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from safetensors.torch import load_file

    from test_gguf import write_gguf
    from test_moe import hf_tokenizer_kv

    hf = json.loads((folder / "config.json").read_text())
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    sd = {k: v.float().numpy() for k, v in load_file(str(folder / "model.safetensors")).items()}
    names = {"input_layernorm": "attn_norm", "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    tensors = {"token_embd.weight": sd.pop("model.embed_tokens.weight"), "output_norm.weight": sd.pop("model.norm.weight"),
               "output.weight": sd.pop("lm_head.weight")}
    for i in range(hf["num_hidden_layers"]):
        tensors |= {f"blk.{i}.{g}.weight": sd.pop(f"model.layers.{i}.{n}.weight") for n, g in names.items()}
    assert not sd, f"unmapped tensors {sorted(sd)[:3]}"
    head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    partial = float(hf.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0)
    orig, ctx = hf["original_max_position_embeddings"], hf["max_position_embeddings"]
    hp: dict[str, object] = {
        "block_count": hf["num_hidden_layers"], "context_length": ctx, "embedding_length": hf["hidden_size"],
        "feed_forward_length": hf["intermediate_size"], "attention.head_count": hf["num_attention_heads"],
        "attention.head_count_kv": hf["num_key_value_heads"],
        "attention.layer_norm_rms_epsilon": float(hf["rms_norm_eps"]),
        "rope.dimension_count": int(partial * hf["hidden_size"]) // hf["num_attention_heads"],
        "rope.freq_base": float(rope.get("rope_theta") or hf.get("rope_theta") or 10000.0),
        "rope.scaling.original_context_length": orig, "attention.sliding_window": hf.get("sliding_window") or 0}
    assert hp["rope.dimension_count"] == int(head_dim * partial)
    if rope.get("long_factor"):
        hp["rope.scaling.attn_factor"] = math.sqrt(1 + math.log(ctx / orig) / math.log(orig)) if ctx > orig else 1.0
        tensors["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        tensors["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    types = {k: linear_type if linear_type is not None and v.ndim == 2 and k != "token_embd.weight" else Q.F32
             for k, v in tensors.items()}
    return write_gguf(path, "phi3", hf_tokenizer_kv(folder), {k: (v, types[k]) for k, v in tensors.items()}, **hp)


def test_gguf_round_trip_matches_transformers(tiny_phi3: Path, tmp_path: Path) -> None:
    """The GGUF of each config (plain, LongRoPE, partial rotary + LongRoPE) gives transformers' greedy ids on
    the HF folder over MAX_NEW tokens for a batch of mixed-length prompts, first-token logprobs within
    LOGPROB_ATOL; the longest prompt's decode crosses ORIG_MAX, where the long factors take over."""
    from conftest import assert_matches_reference
    from test_models import LOGPROB_ATOL, MAX_NEW, hf_greedy
    from tokenloom import LLM, SamplingParams
    from tokenloom.models.gguf import config_from_gguf
    from tokenloom.models.gguf_file import read_gguf

    path = write_phi3_gguf(tiny_phi3, tmp_path / "phi3.gguf")
    cfg, want = config_from_gguf(read_gguf(path)), ModelConfig.from_hf_folder(tiny_phi3)
    assert (cfg.architecture, cfg.rotary_dim, cfg.head_dim, cfg.sliding_window, cfg.tie_word_embeddings) == (
        want.architecture, want.rotary_dim, want.head_dim, want.sliding_window, want.tie_word_embeddings)
    got_rope, want_rope = cfg.rope_scaling, want.rope_scaling
    assert got_rope.kind == want_rope.kind
    if want_rope.kind == "longrope":
        assert got_rope.original_max_position_embeddings == want_rope.original_max_position_embeddings
        assert got_rope.attention_factor == pytest.approx(want_rope.attention_factor)
        assert got_rope.long_factor == pytest.approx(want_rope.long_factor, rel=1e-6)
        assert got_rope.short_factor == pytest.approx(want_rope.short_factor, rel=1e-6)
    llm = LLM(str(path), dtype="float32", kv_cache_memory="32MiB", max_num_batched_tokens=16, max_num_seqs=4)
    # The HF tokenizer's ids (the GGUF's split regex may differ); the parity checked here is the model's.
    ref_tok = transformers.AutoTokenizer.from_pretrained(tiny_phi3)
    prompts = [ref_tok.encode(p) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5))
    ref_ids, ref_lp = hf_greedy(tiny_phi3, prompts)
    assert_matches_reference(outs, ref_ids, ref_lp, LOGPROB_ATOL)


def test_gguf_fused_tensors_kept_quantized(tmp_path: Path) -> None:
    """Q8_0 attn_qkv and ffn_up (gate and up rows) stay quantized as the fused layers themselves, their weights the
    file's dequantization, and decode as the same file loaded dequantized (bfloat16) does."""
    from gguf import GGMLQuantizationType as Q

    from tokenloom import LLM, SamplingParams
    from tokenloom.models.gguf_file import read_gguf
    from tokenloom.quant.linear import Int8Linear

    if Int8Linear.kernel_module() is None:
        pytest.skip("GGUF weights are kept only with the compiled kernels")
    kw = dict(CONFIGS["partial"])
    kw.pop("seed")
    folder = make_tiny_model(tmp_path / "phi4", arch="phi3", seed=26, **(PHI3 | kw))
    path = write_phi3_gguf(folder, tmp_path / "phi4.gguf", linear_type=Q.Q8_0)
    f = read_gguf(path)
    args = dict(model=str(path), dtype="bfloat16", kv_cache_memory="16MiB")
    kept = LLM(**args)
    layer = kept.engine.loaded.model.layers[1]
    for module, name in ((layer.self_attn.qkv_proj, "attn_qkv"), (layer.mlp.gate_up_proj, "ffn_up")):
        assert isinstance(module, Int8Linear)
        assert torch.equal(module.dequantize(), f.tensor(f"blk.1.{name}.weight"))
    dense = LLM(gguf_weights="dequantize", **args)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    got, want = (llm.generate(PROMPTS[1:3], sp) for llm in (kept, dense))
    # bfloat16 both, the same weights summed in another order: the first tokens agree
    assert [o.outputs[0].token_ids[0] for o in got] == [o.outputs[0].token_ids[0] for o in want]
