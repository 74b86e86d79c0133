"""Qwen3 dense (Llama layout + per-head q/k RMSNorm, explicit head_dim) against transformers' Qwen3ForCausalLM."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
import transformers

from conftest import PROMPTS, make_tiny_model
from test_models import check_parity
from tokenloom.attention.base import AttentionMetadata
from tokenloom.attention.paged_kv import LayerKVCache
from tokenloom.config import KVCacheFormat
from tokenloom.engine.fused_decode import FusedDecoder
from tokenloom.models.config import ModelConfig

# head_dim 32 != hidden 64 / heads 4, so the explicit head_dim is what sizes q/k/v.
QWEN3 = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1000000.0)


def make_tiny_qwen3(folder: Path, seed: int, **overrides: object) -> Path:
    """make_tiny_model's Qwen3, with q_norm/k_norm weights moved off their all-ones init so they matter."""
    make_tiny_model(folder, arch="qwen3", seed=seed, **(QWEN3 | overrides))
    model = transformers.Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32)
    torch.manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1 + 0.5 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def tiny_qwen3(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tied = bool(request.param)
    return make_tiny_qwen3(tmp_path_factory.mktemp(f"qwen3-{tied}"), seed=11 if tied else 12, tie_word_embeddings=tied)


def test_config(tiny_qwen3: Path) -> None:
    cfg = ModelConfig.from_hf_folder(tiny_qwen3)
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.family == "llama"
    assert cfg.qk_norm and not cfg.attention_bias and not cfg.o_proj_bias
    assert cfg.head_dim == 32 and cfg.hidden_size // cfg.num_attention_heads == 16
    assert cfg.rope_theta == 1000000.0 and cfg.sliding_window is None


def test_prefill_logits_match_transformers(tiny_qwen3: Path) -> None:
    from tokenloom import LLM

    llm = LLM(str(tiny_qwen3), dtype="float32", kv_cache_memory="16MiB", attention_backend="reference")
    model = llm.engine.loaded.model
    ids = llm.tokenizer.encode(PROMPTS[1])
    ref = transformers.Qwen3ForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    got = _prefill_logits(llm, ids)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=2e-4)
    assert model.layers[0].self_attn.q_norm is not None


def _prefill_logits(llm: object, ids: list[int]) -> torch.Tensor:
    """All-position logits of one prompt through tokenloom's model: one prefill chunk, a fresh paged cache."""
    loaded = llm.engine.loaded  # type: ignore[attr-defined]
    model, cfg = loaded.model, loaded.config
    backend = model.layers[0].self_attn.backend
    block, n = 16, len(ids)
    n_blocks = (n + block - 1) // block
    caches = [LayerKVCache.allocate(n_blocks, block, cfg.num_key_value_heads, cfg.head_dim, loaded.dtype,
                                    KVCacheFormat.MODEL_DTYPE, torch.device("cpu"))
              for _ in range(cfg.num_hidden_layers)]
    meta = AttentionMetadata([0, n], [n], torch.arange(n_blocks).view(1, -1), torch.arange(n), block)
    meta.plan = meta.plan_for(backend, torch.device("cpu"), cfg.sliding_window)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), caches, meta))


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_engine_greedy_matches_transformers(tiny_qwen3: Path, backend: str) -> None:
    # Small batches split the longer prompts into chunks; decode runs on the paged KV cache.
    check_parity(tiny_qwen3, backend, max_num_batched_tokens=16, max_num_seqs=4)


def test_fused_decode_refuses_qk_norm(tiny_qwen3: Path) -> None:
    """The C++ decode stack has no q/k norm: a Qwen3 decodes on the Python model, in bfloat16 too."""
    from tokenloom import LLM, SamplingParams

    llm = LLM(str(tiny_qwen3), dtype="bfloat16", kv_cache_memory="16MiB")
    model = llm.engine.loaded.model
    able_kernels = types.SimpleNamespace(DecodeStack=object, skinny_available=lambda: True)
    why = FusedDecoder.supports(able_kernels, model, torch.device("cpu"))  # type: ignore[arg-type]
    assert why is not None and "Qwen3ForCausalLM" in why and "q and k" in why
    out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)


# --- GGUF ---------------------------------------------------------------------------------------------


def _gguf_name(hf_name: str) -> str:
    """HF tensor name -> llama.cpp's (the inverse of tokenloom.models.gguf.hf_tensor_name)."""
    from tokenloom.models.gguf import _GLOBAL_TENSORS, _LAYER_TENSORS

    inverse = {v: k for k, v in _GLOBAL_TENSORS.items()}
    if hf_name in inverse:
        return inverse[hf_name]
    _, _, i, rest = hf_name.split(".", 3)  # model.layers.{i}.{rest}
    return f"blk.{i}.{next(k for k, v in _LAYER_TENSORS.items() if v == rest)}"


def write_qwen3_gguf(folder: Path, path: Path) -> Path:
    """The tiny HF Qwen3 as a float32 GGUF, as llama.cpp's converter lays it out (no q/k row permutation)."""
    import json

    from gguf import GGMLQuantizationType as Q
    from safetensors.torch import load_file

    from test_gguf import write_gguf

    hf = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(len(vocab)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    tokenizer = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
                 "tokenizer.ggml.tokens": [t for t, _ in vocab], "tokenizer.ggml.merges": merges,
                 "tokenizer.ggml.eos_token_id": int(hf["eos_token_id"])}
    sd = load_file(str(folder / "model.safetensors"))
    tensors = {_gguf_name(k): (v.float().numpy(), Q.F32) for k, v in sd.items()}
    hp = {"block_count": hf["num_hidden_layers"], "context_length": hf["max_position_embeddings"],
          "embedding_length": hf["hidden_size"], "feed_forward_length": hf["intermediate_size"],
          "attention.head_count": hf["num_attention_heads"], "attention.head_count_kv": hf["num_key_value_heads"],
          "attention.key_length": hf["head_dim"], "attention.value_length": hf["head_dim"],
          "attention.layer_norm_rms_epsilon": float(hf["rms_norm_eps"]),
          "rope.freq_base": float(hf.get("rope_theta") or hf["rope_parameters"]["rope_theta"])}
    return write_gguf(path, "qwen3", tokenizer, tensors, **hp)


def test_gguf_loads_and_matches_transformers(tiny_qwen3: Path, tmp_path: Path) -> None:
    from tokenloom import LLM, SamplingParams
    from tokenloom.models.gguf import load_gguf
    from test_models import MAX_NEW, hf_greedy

    path = write_qwen3_gguf(tiny_qwen3, tmp_path / "qwen3.gguf")
    cfg, sd, _ = load_gguf(path, torch.float32)
    want = ModelConfig.from_hf_folder(tiny_qwen3)
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.qk_norm and cfg.head_dim == 32
    assert cfg.tie_word_embeddings == want.tie_word_embeddings and cfg.rope_theta == want.rope_theta
    assert "model.layers.1.self_attn.k_norm.weight" in sd
    llm = LLM(str(path), dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=16, max_num_seqs=4)
    # Token ids from the HF tokenizer (the GGUF's "qwen2" split regex may split text differently);
    # the parity checked here is the model's.
    ref_tok = transformers.AutoTokenizer.from_pretrained(tiny_qwen3)
    prompts = [ref_tok.encode(p) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    ref_ids, _ = hf_greedy(tiny_qwen3, prompts)
    assert [o.outputs[0].token_ids for o in outs] == ref_ids


def test_gguf_missing_q_norm_is_named(tiny_qwen3: Path, tmp_path: Path) -> None:
    from tokenloom.errors import ModelLoadError
    from tokenloom.models.gguf import config_from_gguf, state_dict_from_gguf
    from tokenloom.models.gguf_file import read_gguf

    f = read_gguf(write_qwen3_gguf(tiny_qwen3, tmp_path / "qwen3.gguf"))
    del f.tensors["blk.0.attn_q_norm.weight"]  # as if the file lacked it
    with pytest.raises(ModelLoadError, match="q_norm"):
        state_dict_from_gguf(f, config_from_gguf(f), torch.float32)
