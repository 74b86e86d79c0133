"""Mixture of experts (Mixtral, Qwen3-MoE, Qwen2-MoE) against transformers' MixtralForCausalLM / Qwen3MoeForCausalLM /
Qwen2MoeForCausalLM on tiny random-weight models, the batched expert path against its per-token reference, and GGUF
round trips."""

from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from conftest import PROMPTS, assert_matches_reference, build_tokenizer
from test_models import LOGPROB_ATOL, MAX_NEW, hf_greedy
from test_qwen3 import _prefill_logits
from tokenloom import LLM, SamplingParams
from tokenloom.engine.fused_decode import FusedDecoder
from tokenloom.models.config import ModelConfig
from tokenloom.models.moe import SparseMoE

LOGITS_ATOL = 2e-4  # float32 end to end, as the dense families' parity tests

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False, num_experts_per_tok=2)
MODELS: dict[str, tuple[str, dict[str, object]]] = {
    "mixtral": ("mixtral", dict(intermediate_size=64, num_local_experts=4)),
    # Qwen3-MoE as released: renormalised top-k, every layer sparse
    "qwen3moe": ("qwen3_moe", dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                   norm_topk_prob=True, head_dim=32, rope_theta=1000000.0)),
    # top-k weights not renormalised, and layer 0 a dense MLP (mlp_only_layers)
    "qwen3moe-mixed": ("qwen3_moe", dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                         norm_topk_prob=False, mlp_only_layers=[0])),
    # qkv bias, a sigmoid-gated shared expert, top-k weights not renormalised, and decoder_sparse_step 2: layer 0
    # dense, layer 1 sparse
    "qwen2moe": ("qwen2_moe", dict(intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                   shared_expert_intermediate_size=48, decoder_sparse_step=2)),
}
HF_CLASSES = {"mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
              "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
              "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM)}


def make_tiny_moe(folder: Path, kind: str, seed: int) -> Path:
    """A random-weight MoE model saved with transformers' save_pretrained (float32). Every expert gets its own
    weights and the router a wide spread, so which experts a token picks changes its output."""
    model_type, extra = MODELS[kind]
    folder.mkdir(parents=True, exist_ok=True)
    cfg_cls, model_cls = HF_CLASSES[model_type]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(vocab_size=build_tokenizer(folder), **(COMMON | extra))).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1 + 0.5 * torch.randn_like(p))
            elif p.dim() > 1 or name.endswith("_proj.bias"):
                p.normal_(0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module", params=list(MODELS))
def tiny_moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    kind = str(request.param)
    return kind, make_tiny_moe(tmp_path_factory.mktemp(kind), kind, seed=31 + list(MODELS).index(kind))


def _hf_model(folder: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_checkpoint_holds_per_expert_tensors(tiny_moe: tuple[str, Path]) -> None:
    """What save_pretrained writes (and hub checkpoints hold): one tensor per expert and projection."""
    from safetensors import safe_open

    kind, folder = tiny_moe
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    want = ("model.layers.1.block_sparse_moe.experts.3.w2.weight" if kind == "mixtral"
            else "model.layers.1.mlp.experts.3.up_proj.weight")
    assert want in keys


def test_config(tiny_moe: tuple[str, Path]) -> None:
    kind, folder = tiny_moe
    cfg = ModelConfig.from_hf_folder(folder)
    assert cfg.family == "llama" and cfg.num_experts_per_tok == 2
    if kind == "mixtral":
        assert (cfg.architecture, cfg.num_experts, cfg.moe_intermediate_size) == ("MixtralForCausalLM", 4, 64)
        assert cfg.router == "topk_softmax" and not cfg.qk_norm
    elif kind == "qwen2moe":
        assert (cfg.architecture, cfg.num_experts, cfg.shared_expert_intermediate_size) == (
            "Qwen2MoeForCausalLM", 4, 48)
        assert cfg.router == "softmax_topk" and cfg.attention_bias and not cfg.norm_topk_prob and not cfg.qk_norm
    else:
        assert (cfg.architecture, cfg.num_experts, cfg.moe_intermediate_size) == ("Qwen3MoeForCausalLM", 8, 32)
        assert cfg.router == "softmax_topk" and cfg.qk_norm and cfg.intermediate_size == 96
        assert cfg.norm_topk_prob == (kind == "qwen3moe")
    mixed = kind in ("qwen3moe-mixed", "qwen2moe")
    assert [cfg.layer_is_moe(i) for i in range(2)] == ([False, True] if mixed else [True, True])


def test_prefill_logits_match_transformers(tiny_moe: tuple[str, Path]) -> None:
    kind, folder = tiny_moe
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB", attention_backend="reference")
    model = llm.engine.loaded.model
    assert [type(layer.mlp).__name__ for layer in model.layers] == (
        ["SwiGLU", "SparseMoE"] if kind in ("qwen3moe-mixed", "qwen2moe") else ["SparseMoE", "SparseMoE"])
    ref = _hf_model(folder)
    for prompt in PROMPTS[1:4]:
        ids = llm.tokenizer.encode(prompt)
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(_prefill_logits(llm, ids), want, rtol=0, atol=LOGITS_ATOL)


def test_engine_greedy_matches_transformers_with_preemption(tiny_moe: tuple[str, Path]) -> None:
    """A batch of mixed-length prompts through the paged cache: prefill in chunks of at most 16 tokens, and a
    cache of 48 blocks of 4 tokens, too small for the batch, so requests are preempted and recomputed."""
    _, folder = tiny_moe
    cfg = ModelConfig.from_hf_folder(folder)
    block_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * 4  # K,V float32, 4 tokens
    llm = LLM(str(folder), dtype="float32", block_size=4, max_model_len=160, kv_cache_memory=str(48 * block_bytes),
              max_num_batched_tokens=16, max_num_seqs=8, enable_prefix_caching=False)
    assert llm.engine.capacity.num_blocks == 48
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5))
    assert llm.engine.scheduler.num_preemptions > 0
    ref_ids, ref_lp = hf_greedy(folder, prompts)
    assert_matches_reference(outs, ref_ids, ref_lp, LOGPROB_ATOL)
    llm.engine.kv.pool.check_invariants()


def test_fused_decode_refuses_moe_and_bfloat16_runs(tiny_moe: tuple[str, Path]) -> None:
    """The C++ decode stack has no experts: a MoE model decodes on the Python model (C++ kernels inside the
    experts where built), in bfloat16, and its greedy ids stay those of float32 on these peaked logits."""
    _, folder = tiny_moe
    llm = LLM(str(folder), dtype="bfloat16", kv_cache_memory="16MiB")
    model = llm.engine.loaded.model
    able_kernels = types.SimpleNamespace(DecodeStack=object, skinny_available=lambda: True)
    why = FusedDecoder.supports(able_kernels, model, torch.device("cpu"))  # type: ignore[arg-type]
    assert why is not None and model.config.architecture in why and "experts" in why
    out = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)


def test_stacked_expert_tensors_load_too(tiny_moe: tuple[str, Path], tmp_path: Path) -> None:
    """A checkpoint with transformers' in-memory stacked layout (experts.gate_up_proj (E, 2I, H), experts.down_proj
    (E, H, I)) loads to the same model as the per-expert one."""
    from safetensors.torch import save_file

    _, folder = tiny_moe
    hf = _hf_model(folder)
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            (stacked / f.name).write_bytes(f.read_bytes())
    sd = hf.state_dict()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in sd)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(stacked / "model.safetensors"))
    a = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB").engine.loaded.model.state_dict()
    b = LLM(str(stacked), dtype="float32", kv_cache_memory="16MiB").engine.loaded.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_missing_expert_tensor_is_named(tiny_moe: tuple[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from tokenloom.errors import ModelLoadError

    kind, folder = tiny_moe
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    sd = load_file(str(folder / "model.safetensors"))
    gone = next(k for k in sd if ".experts.1." in k and k.endswith(("w3.weight", "up_proj.weight")))
    del sd[gone]
    save_file(sd, str(broken / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="up:1"):
        LLM(str(broken), dtype="float32", kv_cache_memory="16MiB")


# --- the batched expert path against the per-token reference ------------------------------------------------


def _block(router: str, norm: bool, dtype: torch.dtype, experts: int = 8, k: int = 2, seed: int = 0,
           shared: int = 0) -> SparseMoE:
    cfg = ModelConfig(architecture="MixtralForCausalLM", vocab_size=8, hidden_size=48, intermediate_size=40,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, head_dim=12,
                      max_position_embeddings=64, num_experts=experts, num_experts_per_tok=k,
                      moe_intermediate_size=40, norm_topk_prob=norm, router=router,
                      shared_expert_intermediate_size=shared)
    g = torch.Generator().manual_seed(seed)
    block = SparseMoE(cfg)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if name in ("gate.weight", "shared_expert_gate.weight")
                                                         else 0.2))
    return block.to(dtype).requires_grad_(False)


@pytest.mark.parametrize("router,norm,shared", [("topk_softmax", True, 0), ("softmax_topk", True, 0),
                                                ("softmax_topk", False, 0), ("softmax_topk", False, 24)])
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_batched_path_equals_reference(router: str, norm: bool, shared: int, tokens: int) -> None:
    block = _block(router, norm, torch.float32, shared=shared)
    x = torch.randn(tokens, 48, generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        torch.testing.assert_close(block(x), block.reference(x), rtol=0, atol=1e-5)


@pytest.mark.parametrize("tokens", [3, 33])  # 3: few rows per expert, the C++ skinny kernel's; 33: F.linear's
@pytest.mark.parametrize("cpp", [False, True], ids=["torch", "cpp"])
def test_batched_path_bfloat16_within_rounding_of_reference(tokens: int, cpp: bool) -> None:
    """bfloat16 weights and activations: the batched path rounds its matmuls' outputs to bfloat16 (8 bits of
    mantissa, a relative step of 2^-8 = 0.4%), the reference computes the same bfloat16 weights in float32. The
    error, relative to the output's norm, stays within 2% (0.5% measured): a few bfloat16 roundings, not a routing
    difference (one token routed to another expert moves it by the size of the output itself)."""
    block = _block("softmax_topk", True, torch.bfloat16, experts=16, k=4, seed=1)
    if cpp:
        from tokenloom.kernels import load_cpu_kernels

        block.kernels = load_cpu_kernels()
        if block.kernels is None:
            pytest.skip("the C++ kernels do not build here")
    x = torch.randn(tokens, 48, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.no_grad():
        got, want = block(x).float(), block.reference(x).float()
    assert torch.linalg.norm(got - want) / torch.linalg.norm(want) < 2e-2
    assert torch.equal(got.isfinite(), torch.ones_like(got, dtype=torch.bool))


def test_only_the_chosen_experts_are_read() -> None:
    """Experts no token chose are never touched: poisoning their weights with NaN changes nothing."""
    block = _block("topk_softmax", True, torch.float32, experts=8, k=2, seed=3)
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = block(x)
        _, chosen = torch.topk(block.gate(x), 2, dim=-1)
        unused = sorted(set(range(8)) - set(chosen.flatten().tolist()))
        assert unused, "3 tokens x 2 experts leave some of 8 unused"
        block.experts_gate_up[unused] = float("nan")
        block.experts_down[unused] = float("nan")
        torch.testing.assert_close(block(x), want, rtol=0, atol=0)


# --- GGUF --------------------------------------------------------------------------------------------------


def _llama_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter (LlamaModel.permute): q/k rows reordered for GGML's interleaved RoPE."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(folder: Path, arch: str) -> dict[str, np.ndarray]:
    """The HF checkpoint's tensors under llama.cpp's names, experts stacked as its converter writes them."""
    from safetensors.torch import load_file

    hf = json.loads((folder / "config.json").read_text())
    sd = {k: v.float().numpy() for k, v in load_file(str(folder / "model.safetensors")).items()}
    out = {"token_embd.weight": sd.pop("model.embed_tokens.weight"), "output_norm.weight": sd.pop("model.norm.weight"),
           "output.weight": sd.pop("lm_head.weight")}
    per = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
           "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
           "self_attn.v_proj.bias": "attn_v.bias", "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp",
           "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp", "mlp.shared_expert.up_proj.weight": "ffn_up_shexp",
           "mlp.shared_expert.down_proj.weight": "ffn_down_shexp",
           "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k",
           "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
           "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm",
           "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up", "mlp.down_proj.weight": "ffn_down",
           "block_sparse_moe.gate.weight": "ffn_gate_inp", "mlp.gate.weight": "ffn_gate_inp"}
    experts = int(hf.get("num_local_experts") or hf.get("num_experts"))
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for hf_name, name in per.items():
            if p + hf_name in sd:
                w = sd.pop(p + hf_name)
                if arch == "llama" and name in ("attn_q", "attn_k"):
                    w = _llama_permute(w, hf["num_attention_heads" if name == "attn_q" else "num_key_value_heads"])
                out[f"blk.{i}.{name}" if name.endswith(".bias") else f"blk.{i}.{name}.weight"] = w
        for name, parts in (("ffn_gate_exps", ("w1", "gate_proj")), ("ffn_up_exps", ("w3", "up_proj")),
                            ("ffn_down_exps", ("w2", "down_proj"))):
            keys = [f"{p}{blk}.experts.{e}.{part}.weight" for e in range(experts)
                    for blk, part in (("block_sparse_moe", parts[0]), ("mlp", parts[1])) if
                    f"{p}{blk}.experts.{e}.{part}.weight" in sd]
            if keys:
                out[f"blk.{i}.{name}.weight"] = np.stack([sd.pop(k) for k in keys])  # (E, rows, cols)
    assert not sd, f"unmapped tensors {sorted(sd)[:3]}"
    return out


def hf_tokenizer_kv(folder: Path) -> dict[str, object]:
    """The tiny model's byte-level BPE tokenizer (conftest.build_tokenizer) as GGUF tokenizer metadata."""
    hf = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
            "tokenizer.ggml.tokens": [t for t, _ in vocab], "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.eos_token_id": int(hf["eos_token_id"])}


def write_moe_gguf(folder: Path, path: Path, arch: str, expert_type: object = None) -> Path:
    """The tiny HF model as a float32 GGUF: Mixtral as "llama" with experts, Qwen3-MoE as "qwen3moe", Qwen2-MoE
    as "qwen2moe"."""
    from gguf import GGMLQuantizationType as Q

    from test_gguf import write_gguf

    hf = json.loads((folder / "config.json").read_text())
    tokenizer = hf_tokenizer_kv(folder)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    hp = {"block_count": hf["num_hidden_layers"], "context_length": hf["max_position_embeddings"],
          "embedding_length": hf["hidden_size"], "feed_forward_length": hf["intermediate_size"],
          "attention.head_count": hf["num_attention_heads"], "attention.head_count_kv": hf["num_key_value_heads"],
          "attention.key_length": head_dim, "attention.value_length": head_dim,
          "attention.layer_norm_rms_epsilon": float(hf["rms_norm_eps"]),
          "rope.freq_base": float(hf.get("rope_theta") or hf["rope_parameters"]["rope_theta"]),
          "expert_count": int(hf.get("num_local_experts") or hf.get("num_experts")),
          "expert_used_count": hf["num_experts_per_tok"]}
    if arch in ("qwen3moe", "qwen2moe"):
        hp["expert_feed_forward_length"] = hf["moe_intermediate_size"]
    if arch == "qwen2moe":
        hp["expert_shared_feed_forward_length"] = hf["shared_expert_intermediate_size"]
    tensors = {k: (v, expert_type if expert_type is not None and "_exps." in k else Q.F32)
               for k, v in _gguf_tensors(folder, arch).items()}
    return write_gguf(path, arch, tokenizer, tensors, **hp)


@pytest.mark.parametrize("kind,arch", [("mixtral", "llama"), ("qwen3moe", "qwen3moe"), ("qwen2moe", "qwen2moe")])
def test_gguf_round_trip_matches_transformers(kind: str, arch: str, tmp_path: Path) -> None:
    from tokenloom.models.gguf import load_gguf

    folder = make_tiny_moe(tmp_path / kind, kind, seed=41)
    path = write_moe_gguf(folder, tmp_path / f"{kind}.gguf", arch)
    cfg, sd, _ = load_gguf(path, torch.float32)
    want = ModelConfig.from_hf_folder(folder)
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.router) == (
        want.architecture, want.num_experts, want.num_experts_per_tok, want.moe_intermediate_size, want.router)
    assert (cfg.norm_topk_prob, cfg.qk_norm, cfg.attention_bias, cfg.shared_expert_intermediate_size) == (
        want.norm_topk_prob, want.qk_norm, want.attention_bias, want.shared_expert_intermediate_size)
    assert [cfg.layer_is_moe(i) for i in range(2)] == [want.layer_is_moe(i) for i in range(2)]
    assert sd["model.layers.1.mlp.experts.gate_proj.weight"].shape == (cfg.num_experts, cfg.moe_intermediate_size, 64)
    llm = LLM(str(path), dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=16, max_num_seqs=4)
    # The HF tokenizer's ids (the GGUF's split regex may differ); the parity checked here is the model's.
    ref_tok = transformers.AutoTokenizer.from_pretrained(folder)
    prompts = [ref_tok.encode(p) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    ref_ids, _ = hf_greedy(folder, prompts)
    assert [o.outputs[0].token_ids for o in outs] == ref_ids


def test_gguf_missing_expert_tensor_is_named(tmp_path: Path) -> None:
    from tokenloom.errors import ModelLoadError
    from tokenloom.models.gguf import config_from_gguf, state_dict_from_gguf
    from tokenloom.models.gguf_file import read_gguf

    folder = make_tiny_moe(tmp_path / "q", "qwen3moe", seed=42)
    f = read_gguf(write_moe_gguf(folder, tmp_path / "q.gguf", "qwen3moe"))
    del f.tensors["blk.1.ffn_up_exps.weight"]
    with pytest.raises(ModelLoadError, match="up_proj"):
        state_dict_from_gguf(f, config_from_gguf(f), torch.float32)


def test_gguf_quantized_experts_dequantize_as_gguf_does(tmp_path: Path) -> None:
    """Q8_0 expert stacks (3-D) load dequantized to the model dtype, equal to gguf.quants' dequantization."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    from tokenloom.models.gguf import load_gguf
    from tokenloom.models.gguf_file import read_gguf

    folder = make_tiny_moe(tmp_path / "m", "mixtral", seed=43)
    path = write_moe_gguf(folder, tmp_path / "m.gguf", "llama", expert_type=Q.Q8_0)
    f = read_gguf(path)
    assert f.tensors["blk.0.ffn_down_exps.weight"].qtype == Q.Q8_0
    _, sd, _ = load_gguf(path, torch.float32)
    for name, hf_name in (("ffn_gate_exps", "gate_proj"), ("ffn_down_exps", "down_proj")):
        got = sd[f"model.layers.1.mlp.experts.{hf_name}.weight"]  # (E, rows, cols)
        raw = np.asarray(f.raw(f"blk.1.{name}.weight")).reshape(got.shape[0] * got.shape[1], -1)  # Q8_0 rows
        want = torch.from_numpy(gguf.quants.dequantize(raw, Q.Q8_0)).reshape(got.shape)
        assert torch.equal(got, want)
    llm = LLM(str(path), dtype="bfloat16", kv_cache_memory="16MiB")
    out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
