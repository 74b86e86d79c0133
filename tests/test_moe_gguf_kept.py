"""Mixture-of-experts GGUF expert stacks kept quantized (models/gguf_kept.py -> moe.QuantExperts): a tiny Mixtral-style
("llama" with experts; Q4_0 gate, Q4_1 up, Q8_0 down) and Qwen3-MoE ("qwen3moe"; Q4_K gate, Q5_0 up, Q6_K / Q5_K
down) load with their weights at about the file's size, compute what the same file loaded dequantized computes, and
the batched expert path on quantized experts matches its per-token float32 reference."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from test_gguf import byte_vocab
from test_kquant import _raw_tensor
from test_qwen3 import _prefill_logits

from tokenloom import LLM, SamplingParams
from tokenloom.engine.fused_decode import FusedDecoder
from tokenloom.kernels import load_cpu_kernels
from tokenloom.kernels.limits import SKINNY_MAX_ROWS
from tokenloom.models.config import ModelConfig
from tokenloom.models.gguf import config_from_gguf
from tokenloom.models.gguf_file import read_gguf
from tokenloom.models.gguf_kept import kept_layers
from tokenloom.models.moe import QuantExperts, SparseMoE
from tokenloom.quant.kquant import KQuantLinear
from tokenloom.quant.linear import Int4Linear, Int8Linear
from tokenloom.quant.parts import PartsLinear
from tokenloom.quant.weight_only import weight_bytes

Q = GGMLQuantizationType
H, FF, EXPERTS, HEADS, KV_HEADS, D, VOCAB = 256, 256, 4, 4, 2, 64, 256
# per arch: (gate, up, down per layer) expert stack types
EXPERT_TYPES = {"llama": (Q.Q4_0, Q.Q4_1, (Q.Q8_0, Q.Q8_0)), "qwen3moe": (Q.Q4_K, Q.Q5_0, (Q.Q6_K, Q.Q5_K)),
                "qwen2moe": (Q.Q8_0, Q.Q8_0, (Q.Q4_0, Q.Q4_0))}  # and a Q8_0 shared expert
# Kept (bfloat16, quantized kernels) against the same file dequantized to bfloat16: the logits' error relative to
# their norm (0.13% Mixtral-style, 0.10% Qwen3-MoE measured) is a few bfloat16 roundings of the matmuls, which sum
# in another order. Both are ~1.6% / ~4.8% from float32 (bfloat16 activations flip a few near-tied routing choices),
# and the kept model may add no more than this to that.
LOGITS_RTOL = 1e-2
TILES_RTOL = 0.12  # int8 activations: see the test


def _quantized(qtype: Q, rows: int, k: int, seed: int) -> np.ndarray:
    """(rows, row bytes) blocks: gguf.quants' quantization of normal floats where it has one, else random K-quant
    blocks with tame scales (test_kquant's)."""
    if qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0):
        w = np.random.default_rng(seed).normal(0, 0.05, size=(rows, k)).astype(np.float32)
        return gguf.quants.quantize(w, qtype)
    return _raw_tensor(qtype, rows, k, seed)[0]


def write_tiny_moe_gguf(path: Path, arch: str) -> Path:
    """Two MoE layers of 4 experts (top 2), attention Q8_0, a tied Q8_0 token table, F32 norms and router."""
    gate_t, up_t, downs = EXPERT_TYPES[arch]
    rng = np.random.default_rng(5)
    t: dict[str, tuple[np.ndarray, Q]] = {
        "token_embd.weight": (_quantized(Q.Q8_0, VOCAB, H, 1), Q.Q8_0),
        "output_norm.weight": ((1 + rng.normal(0, 0.1, H)).astype(np.float32), Q.F32),
    }
    for i, down_t in enumerate(downs):
        s = 100 * (i + 1)
        t |= {
            f"blk.{i}.attn_norm.weight": ((1 + rng.normal(0, 0.1, H)).astype(np.float32), Q.F32),
            f"blk.{i}.attn_q.weight": (_quantized(Q.Q8_0, HEADS * D, H, s + 1), Q.Q8_0),
            f"blk.{i}.attn_k.weight": (_quantized(Q.Q8_0, KV_HEADS * D, H, s + 2), Q.Q8_0),
            f"blk.{i}.attn_v.weight": (_quantized(Q.Q8_0, KV_HEADS * D, H, s + 3), Q.Q8_0),
            f"blk.{i}.attn_output.weight": (_quantized(Q.Q8_0, H, HEADS * D, s + 4), Q.Q8_0),
            f"blk.{i}.ffn_norm.weight": ((1 + rng.normal(0, 0.1, H)).astype(np.float32), Q.F32),
            # a wide router spread, so which experts a token picks matters
            f"blk.{i}.ffn_gate_inp.weight": (rng.normal(0, 0.5, (EXPERTS, H)).astype(np.float32), Q.F32),
            # (E, rows, row bytes): the writer reads the stack's shape from the bytes
            f"blk.{i}.ffn_gate_exps.weight": (_quantized(gate_t, EXPERTS * FF, H, s + 5).reshape(EXPERTS, FF, -1),
                                              gate_t),
            f"blk.{i}.ffn_up_exps.weight": (_quantized(up_t, EXPERTS * FF, H, s + 6).reshape(EXPERTS, FF, -1), up_t),
            f"blk.{i}.ffn_down_exps.weight": (_quantized(down_t, EXPERTS * H, FF, s + 7).reshape(EXPERTS, H, -1),
                                              down_t),
        }
        if arch == "qwen2moe":
            t |= {f"blk.{i}.ffn_gate_inp_shexp.weight": (rng.normal(0, 0.5, H).astype(np.float32), Q.F32),
                  f"blk.{i}.ffn_gate_shexp.weight": (_quantized(Q.Q8_0, FF, H, s + 8), Q.Q8_0),
                  f"blk.{i}.ffn_up_shexp.weight": (_quantized(Q.Q8_0, FF, H, s + 9), Q.Q8_0),
                  f"blk.{i}.ffn_down_shexp.weight": (_quantized(Q.Q8_0, H, FF, s + 10), Q.Q8_0)}
        if arch == "qwen3moe":
            t[f"blk.{i}.attn_q_norm.weight"] = ((1 + rng.normal(0, 0.1, D)).astype(np.float32), Q.F32)
            t[f"blk.{i}.attn_k_norm.weight"] = ((1 + rng.normal(0, 0.1, D)).astype(np.float32), Q.F32)
    w = gguf.GGUFWriter(path, arch)
    hp = {"block_count": 2, "context_length": 128, "embedding_length": H, "feed_forward_length": FF,
          "attention.head_count": HEADS, "attention.head_count_kv": KV_HEADS, "attention.key_length": D,
          "attention.value_length": D, "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 10000.0,
          "expert_count": EXPERTS, "expert_used_count": 2}
    if arch in ("qwen3moe", "qwen2moe"):
        hp["expert_feed_forward_length"] = FF
    if arch == "qwen2moe":
        hp["expert_shared_feed_forward_length"] = FF
    for key, v in hp.items():
        (w.add_float32 if isinstance(v, float) else w.add_uint32)(f"{arch}.{key}", v)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "qwen2")
    w.add_array("tokenizer.ggml.tokens", byte_vocab())
    w.add_array("tokenizer.ggml.token_type", [int(gguf.TokenType.NORMAL)] * VOCAB)
    w.add_uint32("tokenizer.ggml.eos_token_id", 1)
    for name, (arr, qtype) in t.items():
        w.add_tensor(name, arr, raw_dtype=None if qtype == Q.F32 else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _needs_kernels() -> None:
    if not KQuantLinear.kernel_routes() or Int8Linear.kernel_module() is None:
        pytest.skip("GGUF weights are kept only with the compiled kernels")


@pytest.mark.parametrize("arch", list(EXPERT_TYPES))
def test_experts_kept_at_file_size_and_compute_the_dequantized_model(arch: str, tmp_path: Path) -> None:
    _needs_kernels()
    path = write_tiny_moe_gguf(tmp_path / f"{arch}.gguf", arch)
    f = read_gguf(path)
    file_bytes = sum(int(np.asarray(f.raw(n)).nbytes) for n in f.tensors)
    kw = dict(model=str(path), kv_cache_memory="16MiB", max_model_len=128)
    # Prompts through the bf16 expansion (--quant-tile-max-rows 8): the dequantized model's products, exactly
    # rounded; the int8-activation tiles are checked on the same layers below.
    kept = LLM(dtype="bfloat16", quant_tile_max_rows=SKINNY_MAX_ROWS, **kw)
    model = kept.engine.loaded.model
    gate_t, up_t, downs = EXPERT_TYPES[arch]
    for i, down_t in enumerate(downs):
        block = model.layers[i].mlp
        assert isinstance(block, SparseMoE) and isinstance(block.experts, QuantExperts)
        assert block.experts_gate_up is None and block.experts_down is None  # the float stacks are gone
        gate_up, down = block.experts.gate_up[3], block.experts.down[3]
        if arch == "llama":  # Q4_0 + Q4_1: one int4 layer; Q8_0 down
            assert isinstance(gate_up, Int4Linear) and isinstance(down, Int8Linear)
        elif arch == "qwen2moe":  # Q8_0 gate/up, Q4_0 down; the shared expert kept too, its gate float
            assert isinstance(gate_up, Int8Linear) and isinstance(down, Int4Linear)
            assert block.shared_expert is not None and isinstance(block.shared_expert.gate_up_proj, Int8Linear)
            assert isinstance(block.shared_expert.down_proj, Int8Linear)
            assert isinstance(block.shared_expert_gate, torch.nn.Linear)
        else:  # Q4_K + Q5_0: two K-quant layers side by side
            assert isinstance(gate_up, PartsLinear) and [p.qtype for p in gate_up.parts] == [gate_t, up_t]
            assert isinstance(down, KQuantLinear) and down.qtype == down_t
        # expert 3's layers are its slice of the stacks: their dequantization is the file's
        for layer, name, rows in ((gate_up, "gate", FF), (down, "down", H)):
            stack = f.tensor(f"blk.{i}.ffn_{name}_exps.weight")  # (E, rows, K) float32
            assert torch.equal(layer.dequantize()[:rows], stack[3])
    # The file's tensor bytes; the router and norms (float32 in the file) are held in bfloat16.
    assert abs(weight_bytes(model) - file_bytes) <= 0.02 * file_bytes
    dense = LLM(dtype="bfloat16", gguf_weights="dequantize", **kw)
    assert weight_bytes(dense.engine.loaded.model) > 2 * weight_bytes(model)  # bf16: 2 bytes a weight; Q8_0 1.06
    oracle = LLM(dtype="float32", **kw)  # float32 loads dequantized
    ids = kept.tokenizer.encode("the quick brown fox jumps over the lazy dog")
    got, bf16, f32 = (_prefill_logits(llm, ids).float() for llm in (kept, dense, oracle))

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))

    assert err(got, bf16) < LOGITS_RTOL and err(got, f32) < err(bf16, f32) + LOGITS_RTOL
    # Greedy decoding through the engine. Random weights give near-flat logits, and bfloat16 alone (dequantized
    # vs float32) changes later tokens; the first tokens of these prompts (top-2 gaps 0.06 to 0.47) agree.
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = ["a b c d e f", "the quick brown fox"]
    got_ids = [o.outputs[0].token_ids for o in kept.generate(prompts, params)]
    want_ids = [o.outputs[0].token_ids for o in dense.generate(prompts, params)]
    assert [len(g) for g in got_ids] == [8, 8] and [g[0] for g in got_ids] == [w[0] for w in want_ids]
    # The same layers through the int8-activation tiles (the auto route up to the crossover quant/routing.py
    # measures, 256 rows on the CPUs measured): x quantized per 32 inputs moved these random models' logits
    # 3-7% from bf16's (bf16 itself: 1.6-4.8% from float32), hence the looser bound; and they did run.
    kernels = load_cpu_kernels()
    before = kernels.quant_tile_max_rows()
    try:
        kernels.set_quant_tile_max_rows(256)
        tiled = _prefill_logits(kept, ids).float()
    finally:
        kernels.set_quant_tile_max_rows(before)
    assert err(tiled, bf16) < TILES_RTOL and err(tiled, got) > 1e-3
    # The C++ decode stack has no experts, quantized or not: decode stays on the Python model.
    why = FusedDecoder.supports(load_cpu_kernels(), model, torch.device("cpu"))
    assert why is not None and "experts" in why


def test_experts_not_all_kept_types_are_dequantized(tmp_path: Path) -> None:
    """A stack of a type with no kernel (Q5_1) leaves the layer's experts float; the other layer stays quantized."""
    f = read_gguf(write_tiny_moe_gguf(tmp_path / "m.gguf", "llama"))
    cfg = config_from_gguf(f)
    info = f.tensors["blk.0.ffn_up_exps.weight"]
    f.tensors["blk.0.ffn_up_exps.weight"] = type(info)(info.name, info.shape, Q.Q5_1, info.offset, info.nbytes)
    layers, consumed = kept_layers(f, cfg)
    assert "layers.0.mlp.experts" not in layers and "blk.0.ffn_gate_exps.weight" not in consumed
    assert isinstance(layers["layers.1.mlp.experts"], QuantExperts) and "blk.1.ffn_down_exps.weight" in consumed


# --- the batched path on quantized experts against the per-token reference ---------------------------------


def _quant_block(seed: int) -> SparseMoE:
    cfg = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=8, hidden_size=H, intermediate_size=FF,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
                      max_position_embeddings=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=FF,
                      norm_topk_prob=True, router="softmax_topk")
    with torch.device("meta"):
        block = SparseMoE(cfg)
    block.gate.weight = torch.nn.Parameter(torch.randn(8, H, generator=torch.Generator().manual_seed(seed)) * 0.5,
                                           requires_grad=False)
    gate_up = [PartsLinear([KQuantLinear(torch.from_numpy(_quantized(Q.Q4_K, FF, H, 10 * e + seed)), Q.Q4_K, H),
                            KQuantLinear(torch.from_numpy(_quantized(Q.Q5_0, FF, H, 10 * e + seed + 1)), Q.Q5_0, H)])
               for e in range(8)]
    down = [KQuantLinear(torch.from_numpy(_quantized(Q.Q6_K, H, FF, 10 * e + seed + 2)), Q.Q6_K, FF)
            for e in range(8)]
    block.set_experts(QuantExperts(gate_up, down))
    return block.to(torch.bfloat16).requires_grad_(False)


class _Untouchable(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("an expert no token chose was read")


@pytest.mark.parametrize("tokens", [1, 3, 33])
@pytest.mark.parametrize("cpp", [False, True], ids=["torch", "cpp"])
def test_batched_quantized_experts_match_reference(tokens: int, cpp: bool) -> None:
    """Within bfloat16 rounding of the float32 per-token reference on the same dequantized weights (as
    test_moe's bfloat16 test: 2% of the output's norm), and experts no token chose are never called."""
    block = _quant_block(seed=tokens)
    if cpp:
        block.kernels = load_cpu_kernels()
        if block.kernels is None or not KQuantLinear.kernel_routes():
            pytest.skip("the C++ kernels do not build here")
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.no_grad():
        got, want = block(x).float(), block.reference(x).float()
        assert torch.linalg.norm(got - want) / torch.linalg.norm(want) < 2e-2
        assert block.experts is not None
        chosen = set(torch.topk(block.gate(x).float(), 2, dim=-1).indices.flatten().tolist())
        for e in set(range(8)) - chosen:
            block.experts.gate_up[e] = _Untouchable()
            block.experts.down[e] = _Untouchable()
        torch.testing.assert_close(block(x).float(), got, rtol=0, atol=0)
