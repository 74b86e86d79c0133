"""Weight-only INT8 / INT4 quantization: round-trip error, kernels against the dequantized reference,
the engine with quantized layers, and the perplexity command."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tokenloom import LLM, SamplingParams
from tokenloom.cli import main
from tokenloom.errors import ConfigError
from tokenloom.kernels import load_quant_kernels
from tokenloom.quant.weight_only import (
    Int4Linear, Int8Linear, QuantLinear, int4_group_size, quantize_int4, quantize_int8, weight_bytes,
)


def _linear(n: int, k: int, bias: bool = False, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    lin.weight.data = torch.randn(n, k).bfloat16()
    if bias:
        lin.bias.data = torch.randn(n).bfloat16()
    return lin.bfloat16()


def test_int8_round_trip_error_is_within_half_a_step() -> None:
    w = torch.randn(64, 576)
    q, s = quantize_int8(w)
    err = (q.float() * s.float() - w).abs()
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127 and s.dtype == torch.float16
    assert bool((err <= s.float() / 2 + 1e-6).all())  # rounding to the nearest step


def test_int4_round_trip_error_is_within_half_a_step() -> None:
    w = torch.randn(64, 576)
    q, d, m = quantize_int4(w, 64)
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    deq = (q.float().reshape(64, 9, 64) * d.float()[..., None] + m.float()[..., None]).reshape(64, 576)
    step = d.float().repeat_interleave(64, dim=1)
    # half a step, plus the float16 rounding of the group minimum (2^-11 relative)
    bound = step / 2 + m.float().abs().repeat_interleave(64, dim=1) * 2.0**-11 + 1e-6
    assert bool(((deq - w).abs() <= bound).all())


def test_int4_group_size_falls_back_where_128_does_not_divide() -> None:
    assert int4_group_size(1536, 128) == 128 and int4_group_size(576, 128) == 64
    with pytest.raises(ConfigError, match="divides"):
        int4_group_size(100, 128)


ROWS = [1, 3, 8, 9, 37, 64]  # the few-row kernels (<= 8) and the tiles of csrc/qtile.h (> 8; auto route)


def _check(lin: Int8Linear | Int4Linear, rows: int) -> None:
    x = torch.randn(rows, lin.in_features).bfloat16()
    want = lin.reference(x)
    got = lin(x).float()
    # bf16 output rounding (2^-9 relative) dominates; the expand path also rounds grouped weights to bf16.
    scale = want.abs().amax().item()
    torch.testing.assert_close(got, want, rtol=8e-3, atol=8e-3 * scale)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", [(256, 576), (37, 100), (33, 1536)])  # odd N, K not a multiple of 64
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_matches_its_dequantized_reference(rows: int, shape: tuple[int, int], bias: bool) -> None:
    _check(Int8Linear.from_linear(_linear(*shape, bias)), rows)


# K = 96: a lone 32-block at the end of each row; K = 384 = 3 x 128
INT4_CASES = [((256, 1536), g) for g in (32, 64, 128)] + [((33, 384), g) for g in (32, 64, 128)] + [((17, 96), 32)]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape,group", INT4_CASES)
def test_int4_linear_matches_its_dequantized_reference(rows: int, shape: tuple[int, int], group: int) -> None:
    n, k = shape
    _check(Int4Linear.from_linear(_linear(n, k, bias=(n % 2 == 1)), group), rows)


@pytest.mark.parametrize("kind", ["int8", "int4 g32", "int8 per 32"])
def test_many_rows_expand_a_big_layer_in_pieces(kind: str) -> None:
    """The expand route turns W to bf16 at most 16 MiB at a time for oneDNN: a 16,400 x 576 layer (18.9 MB
    in bf16, like a big LM head) goes in two pieces, the second one partial, bias included."""
    torch.manual_seed(4)
    n, k = 16_400, 576
    if kind == "int8 per 32":
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        d = (torch.rand(n, k // 32) * 0.01 + 1e-3).half()
        lin = Int8Linear.from_codes(q, d, torch.randn(n).bfloat16())
    else:
        dense = _linear(n, k, bias=True)
        lin = Int8Linear.from_linear(dense) if kind == "int8" else Int4Linear.from_linear(dense, 32)
    lin.route = "expand"
    _check(lin, 16)
    _check(lin, 40)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("k", [96, 576])
def test_int8_per_32_block_scales(rows: int, k: int) -> None:
    """GGUF Q8_0's form: one scale per 32 inputs."""
    torch.manual_seed(1)
    q = torch.randint(-127, 128, (45, k), dtype=torch.int8)
    d = (torch.rand(45, k // 32) * 0.01 + 1e-3).half()
    _check(Int8Linear.from_codes(q, d, torch.randn(45).bfloat16()), rows)


def _few_rows_int8_oracle(lin: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """float64 model of the few-row int8 kernel (quant_gemm.cpp): x in kernel order is quantized per
    64-input chunk to round(x / dx), dx = max |x| / 127, in float32 as the kernel does; the product with
    the codes is then exact up to float32 accumulation."""
    from tokenloom.quant.layout import CHUNK, CHUNK_ORDERS, LAYOUT_VERSION, padded

    m, k = x.shape
    kp = padded(k)
    order = CHUNK_ORDERS[LAYOUT_VERSION]
    xc = torch.cat([x.float(), x.new_zeros(m, kp - k).float()], dim=1).reshape(m, kp // CHUNK, CHUNK)[..., order]
    dx = xc.abs().amax(-1) / 127
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    xq = torch.round(xc * inv[..., None]).clamp(-128, 127)  # round half to even, as vcvtps2dq
    xhat = (xq * dx[..., None])[..., torch.argsort(order)].reshape(m, kp)[:, :k]
    bias = 0 if lin.bias is None else lin.bias.double()
    return xhat.double() @ lin.dequantize().double().T + bias


def _tile_min_rows(lin: QuantLinear) -> int:
    """The first row count the vnni route serves by the tiles for this layer (quant_gemm.cpp)."""
    groups = lin.scales.shape[1]
    return load_quant_kernels().quant_tile_min_rows(lin.bits, groups, lin.in_features // groups)


# 1-3 rows: weight rows one after another; from 4: interleaved. Each case up to the last row count before
# its tiles (quant_gemm.cpp int8_tile_min_rows: per channel from 4 rows, groups of 32 from 7, others from 9).
FEW_ROW_INT8 = [("per-row", r) for r in (1, 2, 3)] + [("per-32", r) for r in (1, 3, 4, 6)] + [("per-64", r) for r in (4, 8)]


@pytest.mark.skipif(load_quant_kernels() is None, reason="needs the AVX512 quantized kernels")
@pytest.mark.parametrize("case,rows", FEW_ROW_INT8)
def test_few_row_int8_kernel_quantizes_x_per_64_inputs(rows: int, case: str) -> None:
    """The few-row int8 path multiplies int8 x by int8 codes (vpdpbusd): it must match the oracle of
    that arithmetic to bf16 output rounding, tighter than it matches float x."""
    torch.manual_seed(2)
    if case == "per-row":
        lin = Int8Linear.from_linear(_linear(45, 576, bias=True))
    else:
        k = 96 if case == "per-32" else 192
        q = torch.randint(-127, 128, (45, k), dtype=torch.int8)
        groups = k // (32 if case == "per-32" else 64)
        lin = Int8Linear.from_codes(q, (torch.rand(45, groups) * 0.01 + 1e-3).half(), torch.randn(45).bfloat16())
    assert rows < _tile_min_rows(lin)  # the few-row kernel
    x = torch.randn(rows, lin.in_features).bfloat16()
    x[:, 5] = 40.0  # an outlier input: its chunk's other inputs get a coarse step
    got = lin(x).double()
    oracle, exact = _few_rows_int8_oracle(lin, x), lin.reference(x).double()
    tol = dict(rtol=2**-8, atol=1e-4 * oracle.abs().max().item())
    torch.testing.assert_close(got, oracle, **tol)
    assert not torch.allclose(got, exact, **tol)  # so the oracle, not float x, is what it computes


def _few_rows_int4_oracle(lin: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    """float64 model of the few-row int4 kernel: x quantized per 32 inputs to round(x / dx), dx = max |x|
    / 127 (float32, as the kernel), times the dequantized weight: exact up to float32 accumulation."""
    m, k = x.shape
    xg = x.float().reshape(m, k // 32, 32)
    dx = xg.abs().amax(-1) / 127
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    xhat = (torch.round(xg * inv[..., None]) * dx[..., None]).reshape(m, k)
    bias = 0 if lin.bias is None else lin.bias.double()
    return xhat.double() @ lin.dequantize().double().T + bias


@pytest.mark.skipif(load_quant_kernels() is None, reason="needs the AVX512 quantized kernels")
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("n,k,group", [(45, 576, 32), (45, 576, 64), (16, 1536, 128), (7, 96, 32)])
def test_few_row_int4_kernel_quantizes_x_per_32_inputs(rows: int, n: int, k: int, group: int) -> None:
    """The few-row int4 path multiplies int8 x by the codes (vpdpbusd, 16 output channels per vector; 45
    and 7 leave a partial block): it must match the oracle of that arithmetic to bf16 output rounding,
    tighter than it matches float x."""
    torch.manual_seed(3)
    lin = Int4Linear.from_linear(_linear(n, k, bias=True), group)
    x = torch.randn(rows, k).bfloat16()
    x[:, 5] = 40.0  # an outlier input: its 32 neighbours get a coarse step
    got = lin(x).double()
    oracle, exact = _few_rows_int4_oracle(lin, x), lin.reference(x).double()
    tol = dict(rtol=2**-8, atol=1e-4 * oracle.abs().max().item())
    torch.testing.assert_close(got, oracle, **tol)
    assert not torch.allclose(got, exact, **tol)


def test_int4_layout_puts_16_channels_of_8_inputs_in_one_64_byte_step() -> None:
    """Layout 3 (quant/layout.py), checked byte by byte against its definition, with a partial last block."""
    from tokenloom.quant.layout import int4_scales_from_kernel, int4_scales_to_kernel, int4_to_kernel

    torch.manual_seed(4)
    n, k = 37, 96  # blocks of 16, 16 and 5 channels; K padded to 128
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    qp = torch.cat([q, q.new_zeros(n, 32)], dim=1)
    flat = int4_to_kernel(q).reshape(-1).tolist()
    for b0 in range(0, n, 16):
        r = min(16, n - b0)
        for s in range(128 // 8):
            for j in range(r):
                for c in range(4):
                    want = int(qp[b0 + j, 8 * s + c]) | int(qp[b0 + j, 8 * s + 4 + c]) << 4
                    assert flat[b0 * 64 + s * 4 * r + 4 * j + c] == want
    d = torch.randn(n, 3).half()
    blocked = int4_scales_to_kernel(d)
    assert blocked.shape == (n, 3) and torch.equal(int4_scales_from_kernel(blocked), d)
    bflat = blocked.reshape(-1)
    for b0 in range(0, n, 16):
        r = min(16, n - b0)
        for t in range(3):
            assert torch.equal(bflat[b0 * 3 + t * r:b0 * 3 + (t + 1) * r], d[b0:b0 + r, t])


def test_code_layout_keeps_each_four_byte_lane_in_one_block() -> None:
    """int8: vpdpbusd sums bytes 4j..4j+3 into int32 lane j; with 32-input scale groups those four must
    be consecutive inputs of block j % 2, or one lane would mix two scales."""
    from tokenloom.quant.layout import CHUNK_ORDERS, LAYOUT_VERSION

    order = CHUNK_ORDERS[LAYOUT_VERSION]
    assert sorted(order.tolist()) == list(range(64))
    for j in range(16):
        lane = order[4 * j:4 * j + 4]
        assert (lane // 32 == j % 2).all() and lane.tolist() == list(range(int(lane[0]), int(lane[0]) + 4))


def test_kernel_layout_round_trips() -> None:
    q4 = torch.randint(0, 16, (5, 96), dtype=torch.uint8)
    q8 = torch.randint(-128, 128, (5, 100), dtype=torch.int8)
    d4, m4 = torch.rand(5, 3).half(), torch.randn(5, 3).half()
    l4 = Int4Linear.from_codes(q4, d4, m4)
    l8 = Int8Linear.from_codes(q8, torch.ones(5, 1).half())
    assert torch.equal(l4.codes_as_int(), q4) and l4.codes.shape == (5, 64)
    assert all(torch.equal(a, b) for a, b in zip(l4.group_params(), (d4, m4)))
    assert torch.equal(l8.codes_as_int(), q8) and l8.codes.shape == (5, 128)


def test_kernels_are_built_here() -> None:
    """The quantized kernels must build on this machine (the others fall back silently)."""
    import re

    flags = open("/proc/cpuinfo").read() if Path("/proc/cpuinfo").is_file() else ""
    if not (re.search(r"\bavx512_bf16\b", flags) and re.search(r"\bavx512_vnni\b", flags)):
        pytest.skip("CPU without AVX512-BF16 and AVX512-VNNI")
    assert load_quant_kernels() is not None


def test_quantized_layers_stay_close_to_float() -> None:
    base = _linear(256, 576, seed=3)
    x = torch.randn(8, 576).bfloat16()
    want = base(x).float()
    rel8 = ((Int8Linear.from_linear(base)(x).float() - want).norm() / want.norm()).item()
    rel4 = ((Int4Linear.from_linear(base, 64)(x).float() - want).norm() / want.norm()).item()
    assert rel8 < 0.01 and rel4 < 0.12 and rel8 < rel4


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_engine_with_quantized_weights(tiny_llama: Path, method: str) -> None:
    kw = dict(dtype="bfloat16", kv_cache_memory="8MiB", max_model_len=256)
    ref = LLM(str(tiny_llama), **kw)
    q = LLM(str(tiny_llama), quantization=method, quant_group_size=32, **kw)
    model = q.engine.loaded.model
    kinds = {type(m).__name__ for m in model.layers.modules()}
    assert ("Int8Linear" if method == "int8" else "Int4Linear") in kinds and "Linear" not in kinds
    assert type(model.lm_head).__name__ == "Int8Linear"  # int4 too: the head stays 8-bit (quant/weight_only.py)
    assert weight_bytes(model) < weight_bytes(ref.engine.loaded.model)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    a, b = ref.generate(["The quick brown fox"], sp)[0].outputs[0], q.generate(["The quick brown fox"], sp)[0].outputs[0]
    assert len(b.token_ids) == 16
    # The first token comes from the same prompt: its logprob under both models stays close.
    assert abs(a.logprobs[0].logprob - b.logprobs[0].logprob) < (0.2 if method == "int8" else 1.0)


def test_quantization_needs_bfloat16(tiny_llama: Path) -> None:
    with pytest.raises(ConfigError, match="bfloat16"):
        LLM(str(tiny_llama), dtype="float32", quantization="int8", kv_cache_memory="8MiB")
    with pytest.raises(ConfigError, match="int8 or int4"):
        LLM(str(tiny_llama), quantization="int3", kv_cache_memory="8MiB")


def test_eval_perplexity_command(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 60)
    rc = main(["eval", "perplexity", "--model", str(tiny_llama), "--text", str(text), "--max-tokens", "300",
               "--window", "128", "--stride", "64", "--kv-cache-memory", "8MiB", "--max-model-len", "256"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and out[-1].startswith("perplexity: ")
    ppl = float(out[-1].split(": ")[1])
    assert 1.0 < ppl < 2 * 400  # a random tiny model over its ~400-token vocabulary
    assert "299 tokens scored" in out[0]


def test_perplexity_matches_transformers(tiny_llama: Path) -> None:
    """One window over the whole text: the same number transformers' logits give."""
    import math

    import transformers

    from tokenloom.bench.perplexity import perplexity

    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB", max_model_len=256)
    ids = llm.tokenizer.encode("Once upon a time there was a small engine. " * 12, add_special_tokens=False)[:100]
    ours, n = perplexity(llm.engine, ids, 128, 128)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    want = math.exp(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item())
    assert n == len(ids) - 1 and ours == pytest.approx(want, rel=1e-4)
    # Overlapping windows score every token once too, each with less context.
    windowed, n2 = perplexity(llm.engine, ids, 64, 32)
    assert n2 == len(ids) - 1 and math.isfinite(windowed)
    # Windows run in pieces over the KV cache (token by token as decode does) score the same.
    for chunk in (1, 7):
        pieces, n3 = perplexity(llm.engine, ids, 128, 128, chunk=chunk)
        assert n3 == n and pieces == pytest.approx(ours, rel=1e-4)
    with pytest.raises(ConfigError, match="--chunk"):
        perplexity(llm.engine, ids, 128, 128, chunk=0)
    # A BOS before each window: every token is scored, the first predicted from BOS alone.
    bos = 1
    with_bos, n4 = perplexity(llm.engine, ids, 128, 127, bos=bos)  # one window: 127 text tokens + BOS
    with torch.no_grad():
        logits = hf(torch.tensor([[bos] + ids])).logits[0]
    want = math.exp(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids)).item())
    assert n4 == len(ids) and with_bos == pytest.approx(want, rel=1e-4)
    windowed_bos, n5 = perplexity(llm.engine, ids, 64, 32, bos=bos)
    assert n5 == len(ids) and math.isfinite(windowed_bos) and windowed_bos != windowed
