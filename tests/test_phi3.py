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
