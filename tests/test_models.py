"""Model parity against transformers on the same weights: greedy token ids and logprobs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from conftest import PROMPTS, assert_matches_reference, hf_greedy_ids, make_tiny_model
from tokenloom import LLM, SamplingParams
from tokenloom.errors import UnsupportedArchitecture
from tokenloom.models.config import ModelConfig
from tokenloom.models.layers import rope_inv_freq

MAX_NEW = 16
LOGPROB_ATOL = 2e-4  # float32 end to end; differences come from summation order only


def hf_greedy(folder: Path, prompts: list[list[int]], **kw: object) -> tuple[list[list[int]], list[torch.Tensor]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw).eval()
    ids_out, first_logprobs = [], []
    with torch.no_grad():
        for ids in prompts:
            new, first = hf_greedy_ids(model, ids, MAX_NEW)
            ids_out.append(new)
            first_logprobs.append(first)
    return ids_out, first_logprobs


def check_parity(folder: Path, backend: str, hf_kwargs: dict[str, object] | None = None, **engine: object) -> None:
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="32MiB", attention_backend=backend, **engine)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, sp)
    ref_ids, ref_lp = hf_greedy(folder, prompts, **(hf_kwargs or {}))
    assert_matches_reference(outs, ref_ids, ref_lp, LOGPROB_ATOL)


@pytest.mark.parametrize("backend", ["cpu", "sdpa", "reference"])
def test_tiny_llama_matches_transformers(tiny_llama: Path, backend: str) -> None:
    check_parity(tiny_llama, backend)


def test_qwen2_with_qkv_bias_and_tied_embeddings(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "qwen2", arch="qwen2", seed=3, tie_word_embeddings=True)
    cfg = ModelConfig.from_hf_folder(folder)
    assert cfg.attention_bias and cfg.tie_word_embeddings
    check_parity(folder, "auto")


@pytest.mark.parametrize("backend", ["cpu", "sdpa", "reference"])
def test_mistral_sliding_window(tmp_path: Path, backend: str) -> None:
    # A window shorter than the prompts makes the mask matter; small chunks exercise cached context.
    folder = make_tiny_model(tmp_path / "mistral", arch="mistral", seed=5, sliding_window=6)
    check_parity(folder, backend, hf_kwargs={"attn_implementation": "eager"}, max_num_batched_tokens=8, max_num_seqs=8)


def test_llama3_rope_scaling_model(tmp_path: Path) -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    folder = make_tiny_model(tmp_path / "llama3", seed=7, rope_scaling=scaling, rope_theta=500000.0)
    check_parity(folder, "auto")


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 128},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 16, "beta_slow": 2,
         "mscale": 0.707, "mscale_all_dim": 1.0},
        {"rope_type": "dynamic", "factor": 2.0},
    ],
)
def test_rope_scaling_matches_transformers(scaling: dict[str, object]) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=4, max_position_embeddings=512, rope_theta=10000.0, rope_scaling=dict(scaling)
    )
    ours_cfg = ModelConfig.from_hf_dict({**hf_cfg.to_dict(), "architectures": ["LlamaForCausalLM"]})
    ours, factor = rope_inv_freq(64, 10000.0, ours_cfg.rope_scaling, 512)
    ref, ref_factor = ROPE_INIT_FUNCTIONS[str(scaling["rope_type"])](hf_cfg, torch.device("cpu"))
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=1e-9)
    assert factor == pytest.approx(ref_factor)


def test_unknown_architecture_is_named(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "gpt", seed=1)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitecture, match="GPTNeoXForCausalLM"):
        LLM(str(folder))


def test_sharded_safetensors_with_index(tmp_path: Path) -> None:
    folder = tmp_path / "sharded"
    make_tiny_model(folder, seed=2)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = tmp_path / "sharded-out"
    model.save_pretrained(out, max_shard_size="100KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_text((folder / f).read_text())
    assert (out / "model.safetensors.index.json").is_file()
    assert len(list(out.glob("*.safetensors"))) > 1
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB").generate(PROMPTS[:2], sp)
    b = LLM(str(out), dtype="float32", kv_cache_memory="16MiB").generate(PROMPTS[:2], sp)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_bfloat16_runs_and_mostly_agrees(tiny_llama: Path) -> None:
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    f32 = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB").generate(PROMPTS, sp)
    bf16_llm = LLM(str(tiny_llama), dtype="bfloat16", kv_cache_memory="16MiB")
    assert bf16_llm.engine.loaded.dtype is torch.bfloat16
    bf16 = bf16_llm.generate(PROMPTS, sp)
    # bf16 rounding may flip a near-tie, so compare first tokens only, most of which must agree.
    agree = sum(a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0] for a, b in zip(f32, bf16))
    assert agree >= len(PROMPTS) - 1
