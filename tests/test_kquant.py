"""GGUF K-quants (Q4_K, Q5_K, Q6_K) and Q5_0 kept quantized: the kernels against gguf.quants' float
dequantization on random blocks (every row-count path, odd shapes, each route forced), rows decoded for the
quantized embedding, mixed-type fused layers, and a tiny GGUF model whose weights stay at their file size."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from test_gguf import byte_vocab, random_blocks

from tokenloom import LLM, SamplingParams
from tokenloom.kernels.limits import PACKED_MAX_ROWS, SKINNY_MAX_ROWS
from tokenloom.models.gguf import config_from_gguf
from tokenloom.models.gguf_file import read_gguf
from tokenloom.models.gguf_kept import kept_layers
from tokenloom.quant.embedding import QuantEmbedding
from tokenloom.quant.kquant import KQUANT_TYPES, KQuantLinear
from tokenloom.quant.linear import Int4Linear, Int8Linear
from tokenloom.quant.parts import PartsLinear
from tokenloom.quant.weight_only import weight_bytes

Q = GGMLQuantizationType
pytestmark = pytest.mark.usefixtures("vnni_tiles")  # the int8-x arithmetic (AMX dots: test_quant_amx.py)
# The few-row kernel's row counts, then more rows (vnni: the tiles of csrc/qtile.h; auto: those up to the
# start-up crossover, quant/routing.py, then the weight expanded to bf16)
ROWS = [*range(1, SKINNY_MAX_ROWS + 2), 16, 33, PACKED_MAX_ROWS, 300]
# (N, K): odd N; K one superblock, several, and for Q5_0 an odd number of 32-blocks (a lone last one)
SHAPES = {Q.Q4_K: [(37, 256), (19, 768)], Q.Q5_K: [(37, 256), (19, 768)], Q.Q6_K: [(37, 256), (19, 768)],
          Q.Q5_0: [(37, 96), (19, 608)]}


def _layer(qtype: Q, n: int, k: int, bias: bool = False, seed: int = 0) -> tuple[KQuantLinear, torch.Tensor]:
    """A layer over random blocks (valid float16 scales) and its weight by gguf.quants, (N, K) float32."""
    qk = GGML_QUANT_SIZES[qtype][0]
    raw = random_blocks(qtype, n, k // qk, seed)
    want_w = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32)).reshape(n, k)
    b = torch.randn(n, generator=torch.Generator().manual_seed(seed)).bfloat16() if bias else None
    return KQuantLinear(torch.from_numpy(raw), qtype, k, b), want_w


def _assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    # As the Q8_0 / Q4_1 kernels (tests/test_quant_gguf.py): bf16 output rounding (2^-9 relative to the
    # largest output), the few-row path's int8 x, the many-row path's weight rounded to bf16 once.
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=8e-3 * want.abs().amax().item())


def _routes() -> list[str]:
    """The kernel routes of this build."""
    return [r for r in ("vnni", "avx512", "portable") if r in KQuantLinear.kernel_routes()]


@pytest.mark.parametrize("qtype", KQUANT_TYPES, ids=lambda q: q.name)
def test_layer_weight_is_the_gguf_dequantization(qtype: Q) -> None:
    layer, want_w = _layer(qtype, 37, SHAPES[qtype][1][1])
    assert torch.equal(layer.dequantize(), want_w)
    raw = torch.from_numpy(random_blocks(qtype, 37, SHAPES[qtype][1][1] // GGML_QUANT_SIZES[qtype][0], 0))
    assert torch.equal(layer.gguf_blocks(), raw)  # the file's bytes, whatever the layout in memory
    assert layer.blocks.numel() == 37 * layer.in_features // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("qtype", KQUANT_TYPES, ids=lambda q: q.name)
def test_each_route_matches_the_dequantized_weight(qtype: Q, rows: int) -> None:
    """Every route against gguf.quants' weight in F.linear. The vnni route (int8 x) is held to that at the
    few-row counts, as the Q8_0 / Q4_1 few-row kernels are; beyond them (the tiles) to the same bound in
    norm, and elementwise to its exact model below (with more outputs, the int8 x's error tail reaches
    the elementwise bound)."""
    routes = _routes()
    if not routes:
        pytest.skip("no compiled kernels")
    for n, k in SHAPES[qtype]:
        layer, want_w = _layer(qtype, n, k, bias=rows % 2 == 0, seed=rows)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        want = F.linear(x.float(), want_w, None if layer.bias is None else layer.bias.float())
        got = {}
        for route in routes:
            layer.route = route
            got[route] = layer(x)
            if route != "vnni" or rows <= SKINNY_MAX_ROWS:
                _assert_matches(got[route], want)
            else:
                assert (got[route].float() - want).norm() <= 8e-3 * want.norm()
        layer.route = "auto"  # the route the kernel picks from the row count (this CPU has them all here)
        tile_max = KQuantLinear.kernel_module().quant_tile_max_rows()
        picked = "vnni" if rows <= tile_max and "vnni" in got else "avx512" if "avx512" in got else "portable"
        assert torch.equal(layer(x), got[picked])


def _int8_x_oracle(layer: KQuantLinear, x: torch.Tensor) -> torch.Tensor:
    """float64 model of the vnni route: x quantized per 32 inputs to round(x / dx), dx = max |x| / 127 (in
    float32, as the kernel), times the dequantized weight: exact up to float32 accumulation."""
    m, k = x.shape
    xg = x.float().reshape(m, k // 32, 32)
    dx = xg.abs().amax(-1) / 127
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    xhat = (torch.round(xg * inv[..., None]) * dx[..., None]).reshape(m, k)  # round half to even, as vcvtps2dq
    bias = 0 if layer.bias is None else layer.bias.double()
    return xhat.double() @ layer.dequantize().double().T + bias


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 6, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, 16, 19, 64])
@pytest.mark.parametrize("qtype", KQUANT_TYPES, ids=lambda q: q.name)
def test_vnni_route_is_its_int8_activation_arithmetic(qtype: Q, rows: int) -> None:
    """The vnni route multiplies int8 x by the codes (vpdpbusd), per row of W for 1 to 3 rows of x
    and in 16-channel tiles beyond (kquant.cpp tile_min_rows; 19: a last pass of 3 rows; N = 37 and
    19: partial tiles): it must match
    the model of that arithmetic to bf16 output rounding, tighter than it matches float x."""
    if "vnni" not in KQuantLinear.kernel_routes():
        pytest.skip("needs the AVX512-VNNI kernels")
    for n, k in SHAPES[qtype]:
        layer, _ = _layer(qtype, n, k, bias=True, seed=rows)
        layer.route = "vnni"
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        x[:, 5] = 40.0  # an outlier input: its 32 neighbours get a coarse step
        got = layer(x).double()
        oracle, exact = _int8_x_oracle(layer, x), layer.reference(x).double()
        tol = dict(rtol=2**-8, atol=1e-4 * oracle.abs().max().item())
        torch.testing.assert_close(got, oracle, **tol)
        assert not torch.allclose(got, exact, **tol)


@pytest.mark.parametrize("rows", [2, 16])
def test_q6k_integer_sub_scales_at_their_extremes(rows: int) -> None:
    """Q6_K's tiles keep sc (q - 32) x in int32 (qtile.h dot_isub): sub-scales -128 and 127, codes all 0 or
    all 63, x at +-127 steps, are the sums' largest magnitudes; they must still be the int8-x arithmetic."""
    if "vnni" not in KQuantLinear.kernel_routes():
        pytest.skip("needs the AVX512-VNNI kernels")
    n, nb = 19, 3
    raw = np.zeros((n, nb, 210), dtype=np.uint8)
    raw[:, :, :192] = np.where(np.arange(n) % 2 == 0, 0, 0xFF)[:, None, None]  # q = 0 or 63 everywhere
    raw[:, :, 192:208] = np.where(np.arange(16) % 2 == 0, -128, 127).astype(np.int8).view(np.uint8)
    raw[:, :, 208:210] = np.array([1e-3], dtype=np.float16).view(np.uint8)
    layer = KQuantLinear(torch.from_numpy(raw.reshape(n, -1)), Q.Q6_K, nb * 256, route="vnni")
    x = torch.where(torch.arange(nb * 256) % 3 == 0, -3.0, 3.0).repeat(rows, 1).bfloat16()
    got, oracle = layer(x).double(), _int8_x_oracle(layer, x)
    torch.testing.assert_close(got, oracle, rtol=2**-8, atol=1e-4 * oracle.abs().max().item())


@pytest.mark.parametrize("qtype", KQUANT_TYPES, ids=lambda q: q.name)
def test_torch_fallback_and_batched_input(qtype: Q) -> None:
    n, k = SHAPES[qtype][0]
    layer, want_w = _layer(qtype, n, k)
    x = torch.randn(2, 3, k, generator=torch.Generator().manual_seed(0)).bfloat16()  # (batch, seq, K)
    want = F.linear(x.float(), want_w)
    layer.route = "torch"
    torch.testing.assert_close(layer(x).float(), F.linear(x, want_w.bfloat16()).float())
    layer.route = "auto"
    _assert_matches(layer(x), want)
    assert layer(x).shape == (2, 3, n)


def test_zero_rows_and_zero_input() -> None:
    layer, _ = _layer(Q.Q4_K, 5, 256)
    assert layer(torch.zeros(0, 256).bfloat16()).shape == (0, 5)
    assert torch.equal(layer(torch.zeros(1, 256).bfloat16()), torch.zeros(1, 5).bfloat16())


@pytest.mark.parametrize("qtype", KQUANT_TYPES, ids=lambda q: q.name)
def test_embedding_rows_equal_the_table(qtype: Q) -> None:
    n, k = SHAPES[qtype][1]
    layer, want_w = _layer(qtype, n, k)
    emb = QuantEmbedding(layer)
    ids = torch.tensor([[3, 0, 18], [18, 7, 1]])
    assert torch.equal(emb(ids), want_w[ids].bfloat16())


@pytest.mark.parametrize("n", [37, 64])  # a partial last int4 block of 16 channels, and none
def test_legacy_layers_decode_single_rows(n: int) -> None:
    w = torch.randn(n, 96, generator=torch.Generator().manual_seed(n))
    rows = torch.tensor([0, n - 1, 17, 5, n - 1])
    for layer in (Int8Linear.from_linear(_dense(w)), Int4Linear.from_linear(_dense(w), 32)):
        assert torch.equal(layer.dequantize_rows(rows), layer.dequantize()[rows])


def _dense(w: torch.Tensor) -> torch.nn.Linear:
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data = w.bfloat16()
    return lin.bfloat16()


def test_parts_of_different_types_fill_their_slices() -> None:
    q, want_q = _layer(Q.Q5_0, 24, 640, seed=1)
    v = Int8Linear.from_linear(_dense(torch.randn(8, 640, generator=torch.Generator().manual_seed(0))))
    fused = PartsLinear([q, v])
    for rows in (3, 40):  # few-row and many-row kernels: each part's own output, in its slice
        x = torch.randn(rows, 640, generator=torch.Generator().manual_seed(rows)).bfloat16()
        assert torch.equal(fused(x), torch.cat([q(x), v(x)], dim=-1))
        _assert_matches(fused(x)[:, :24], F.linear(x.float(), want_q))
    assert fused.out_features == 32 and torch.equal(fused.dequantize()[:24], want_q)


# --- a tiny GGUF model: every linear kept, at the file's size ---------------------------------------------


def _raw_tensor(qtype: Q, rows: int, k: int, seed: int) -> tuple[np.ndarray, Q]:
    """Blocks for `qtype` as GGUFWriter takes them: quantized from floats where gguf.quants can, else random
    blocks with valid float16 scales (gguf.quants has no K-quant quantizer)."""
    if qtype in (Q.Q8_0, Q.Q5_0, Q.Q5_1):
        w = np.random.default_rng(seed).normal(0, 0.05, size=(rows, k)).astype(np.float32)
        return gguf.quants.quantize(w, qtype), qtype
    raw = random_blocks(qtype, rows, k // GGML_QUANT_SIZES[qtype][0], seed)
    # tame d (and dmin): with random 6- or 8-bit sub-block scales the weights would reach ~10 to ~100
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    if qtype in (Q.Q4_K, Q.Q5_K):
        blocks[:, :4] = np.array([0.002, 0.001], np.float16).view(np.uint8)
    else:  # Q6_K: d last
        blocks[:, 208:] = np.array([0.0005], np.float16).view(np.uint8)
    return raw, qtype


def _tiny_gemma_like_gguf(path: Path, up: Q = Q.Q5_0) -> Path:
    """Llama-shaped, with Gemma 3 Q4_K_M's mix: q/k Q5_0 + v Q8_0, gate/up Q5_0 (up: `up`), o Q4_K, down
    Q6_K / Q5_K, a tied Q8_0 token table."""
    h, ff, vocab, heads, kv_heads, d = 256, 512, 256, 4, 2, 64
    rng = np.random.default_rng(0)
    t: dict[str, tuple[np.ndarray, Q]] = {
        "token_embd.weight": _raw_tensor(Q.Q8_0, vocab, h, 1),
        "output_norm.weight": ((1 + rng.normal(0, 0.1, h)).astype(np.float32), Q.F32),
    }
    for i, down in enumerate((Q.Q6_K, Q.Q5_K)):
        t |= {
            f"blk.{i}.attn_norm.weight": ((1 + rng.normal(0, 0.1, h)).astype(np.float32), Q.F32),
            f"blk.{i}.attn_q.weight": _raw_tensor(Q.Q5_0, heads * d, h, 10 * i + 2),
            f"blk.{i}.attn_k.weight": _raw_tensor(Q.Q5_0, kv_heads * d, h, 10 * i + 3),
            f"blk.{i}.attn_v.weight": _raw_tensor(Q.Q8_0, kv_heads * d, h, 10 * i + 4),
            f"blk.{i}.attn_output.weight": _raw_tensor(Q.Q4_K, h, heads * d, 10 * i + 5),
            f"blk.{i}.ffn_norm.weight": ((1 + rng.normal(0, 0.1, h)).astype(np.float32), Q.F32),
            f"blk.{i}.ffn_gate.weight": _raw_tensor(Q.Q5_0, ff, h, 10 * i + 6),
            f"blk.{i}.ffn_up.weight": _raw_tensor(up, ff, h, 10 * i + 7),
            f"blk.{i}.ffn_down.weight": _raw_tensor(down, h, ff, 10 * i + 8),
        }
    tok = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": byte_vocab(),
           "tokenizer.ggml.token_type": [int(gguf.TokenType.NORMAL)] * vocab, "tokenizer.ggml.eos_token_id": 1}
    w = gguf.GGUFWriter(path, "llama")
    hp = {"block_count": 2, "context_length": 128, "embedding_length": h, "feed_forward_length": ff,
          "attention.head_count": heads, "attention.head_count_kv": kv_heads,
          "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 10000.0}
    for key, v in hp.items():
        (w.add_float32 if isinstance(v, float) else w.add_uint32)(f"llama.{key}", v)
    for key, v in tok.items():
        if isinstance(v, int):
            w.add_uint32(key, v)
        elif isinstance(v, str):
            w.add_string(key, v)
        else:
            w.add_array(key, v)
    for name, (arr, qtype) in t.items():  # quantized: (rows, bytes per row) uint8, the writer infers the shape
        w.add_tensor(name, arr, raw_dtype=None if qtype == Q.F32 else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_tiny_model_keeps_every_linear_at_the_file_size(tmp_path: Path) -> None:
    if not KQuantLinear.kernel_routes():
        pytest.skip("GGUF weights are kept only with the compiled kernels")
    path = _tiny_gemma_like_gguf(tmp_path / "tiny.gguf")
    f = read_gguf(path)
    file_bytes = sum(int(np.asarray(f.raw(n)).nbytes) for n in f.tensors)
    kw = dict(model=str(path), dtype="bfloat16", kv_cache_memory="16MiB", max_model_len=128)
    kept = LLM(**kw)
    model = kept.engine.loaded.model
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, PartsLinear) and [type(p) for p in qkv.parts] == [KQuantLinear, Int8Linear]
    assert isinstance(model.layers[0].mlp.gate_up_proj, KQuantLinear)  # Q5_0 + Q5_0: one layer
    assert isinstance(model.layers[1].mlp.down_proj, KQuantLinear) and model.layers[1].mlp.down_proj.qtype == Q.Q5_K
    assert isinstance(model.embed_tokens, QuantEmbedding) and model.embed_tokens.table is model.lm_head
    # The file's tensor bytes, plus the int8 layers' padding of K to 64 (none here) and nothing else.
    assert abs(weight_bytes(model) - file_bytes) <= 0.01 * file_bytes
    dense = LLM(gguf_weights="dequantize", **kw)
    want = dense.generate(["hello world"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].token_ids
    got = kept.generate(["hello world"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].token_ids
    assert len(got) == len(want) == 8
    # the same weights, computed in another order: the first tokens agree
    assert got[:2] == want[:2]


def test_types_not_kept_are_dequantized_and_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    f = read_gguf(_tiny_gemma_like_gguf(tmp_path / "q51.gguf", up=Q.Q5_1))  # Q5_1: no kernel of its own
    with caplog.at_level(logging.INFO, logger="tokenloom.models"):
        layers, consumed = kept_layers(f, config_from_gguf(f))
    assert "layers.0.mlp.gate_up_proj" not in layers and "blk.0.ffn_up.weight" not in consumed
    assert "layers.0.mlp.down_proj" in layers
    lines = [r.getMessage() for r in caplog.records if "dequantized" in r.getMessage()]
    assert len(lines) == 1 and "2 x Q5_0" in lines[0] and "2 x Q5_1" in lines[0]  # gate (its pair) and up
