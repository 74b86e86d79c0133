"""The C++ CPU kernels against their pure-torch twins (the oracles) on random inputs."""

from __future__ import annotations

import pytest
import torch

from tokenloom.attention.base import AttentionMetadata
from tokenloom.attention.paged_kv import LayerKVCache
from tokenloom.attention.reference import ReferenceBackend
from tokenloom.config import KVCacheFormat
from tokenloom.kernels import load_cpu_kernels
from tokenloom.kernels.limits import SKINNY_MAX_ROWS
from tokenloom.models.layers import RMSNorm, apply_rope

K = load_cpu_kernels()
pytestmark = pytest.mark.skipif(K is None, reason="the C++ kernels could not be built on this machine")

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(dtype: torch.dtype, with_residual: bool) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = torch.randn(96).to(dtype)
    x = torch.randn(37, 96).to(dtype) * 3
    res = torch.randn(37, 96).to(dtype) if with_residual else None
    want, want_res = norm.reference(x, res)
    got, got_res = K.add_rms_norm(x, res, norm.weight, 1e-5)
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(got_res, want_res, rtol=0, atol=0)  # the residual sum is exact


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    x = (torch.randn(19, 2 * 200) * 4).to(dtype)
    want = torch.nn.functional.silu(x[:, :200]) * x[:, 200:]
    torch.testing.assert_close(K.silu_and_mul(x), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_scaled_rms_norm_is_gemmas_norm(dtype: torch.dtype, with_residual: bool) -> None:
    from tokenloom.models.gemma import GemmaRMSNorm

    torch.manual_seed(0)
    norm = GemmaRMSNorm(640, 1e-6)
    norm.weight.data = torch.randn(640) * 0.5  # (1 + w) in float32: the kernel gets it unrounded
    norm.refresh_scale()
    x = (torch.randn(9, 640) * 3).to(dtype)
    res = torch.randn(9, 640).to(dtype) if with_residual else None
    want, want_res = norm.reference(x, res)
    got, got_res = K.scaled_rms_norm(x, res, norm._scale, 1e-6)
    torch.testing.assert_close(got, want, **TOL.get(dtype, dict(rtol=2e-3, atol=2e-3)))
    assert torch.equal(got_res, want_res)  # the residual sum is exact
    if dtype == torch.bfloat16:  # float32 arithmetic, one rounding: all but a rare last-place tie agree
        assert (got != want).float().mean().item() < 0.01


def test_scaled_rms_norm_of_per_head_views_of_a_fused_projection() -> None:
    from tokenloom.models.gemma import GemmaRMSNorm

    torch.manual_seed(1)
    t, hq, hkv, d = 7, 4, 1, 256
    qkv = torch.randn(t, (hq + 2 * hkv) * d).bfloat16()
    q = qkv[:, : hq * d].view(t, hq, d)  # token stride (hq + 2 hkv) d: not contiguous
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    norm = GemmaRMSNorm(d, 1e-6)
    norm.weight.data = torch.randn(d) * 0.3
    norm.refresh_scale()
    for part in (q, k):
        got, _ = K.scaled_rms_norm(part, None, norm._scale, 1e-6)
        want = norm.reference(part.contiguous())[0]
        assert got.shape == part.shape and got.is_contiguous()
        torch.testing.assert_close(got, want, **TOL[torch.bfloat16])
    one = q[:1]  # a single token: its stride(0) is never used
    torch.testing.assert_close(K.scaled_rms_norm(one, None, norm._scale, 1e-6)[0], norm.reference(one.contiguous())[0],
                               **TOL[torch.bfloat16])


def test_scaled_rms_norm_rejects_bad_inputs() -> None:
    x = torch.randn(3, 8).bfloat16()
    with pytest.raises(RuntimeError, match="scale must be"):
        K.scaled_rms_norm(x, None, torch.ones(8).bfloat16(), 1e-6)  # the scale is float32
    with pytest.raises(RuntimeError, match="residual"):
        K.scaled_rms_norm(x, torch.randn(3, 4).bfloat16(), torch.ones(8), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_and_mul(dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    x = (torch.randn(13, 2 * 300) * 4).to(dtype)
    want = torch.nn.functional.gelu(x[:, :300], approximate="tanh") * x[:, 300:]
    got = K.gelu_tanh_and_mul(x)
    torch.testing.assert_close(got, want, **TOL[dtype])
    if dtype == torch.bfloat16:  # tanh by exp_fast, not torch's: a last-place difference at a rounding tie, rarely
        assert (got != want).float().mean().item() < 0.05


@pytest.mark.parametrize("vocab", [1, 5, 16, 17, 33, 1000, 262144])
def test_first_argmax_is_torchs_first_index(vocab: int) -> None:
    torch.manual_seed(4)
    x = torch.randn(4, vocab)
    if vocab > 20:
        x[1, 3] = x[1, vocab - 2] = x[1].max() + 1.0  # a tie: the first index wins, in another 16-lane group
        x[2, :] = 0.0  # every value tied
        x[3, vocab - 1] = float("inf")
    want = x.max(dim=-1).indices
    assert torch.equal(K.first_argmax(x), want)
    assert torch.equal(K.first_argmax(x[1:3]), want[1:3])  # row views of a wider tensor
    wide = torch.randn(3, vocab + 7)[:, :vocab]  # a row stride that is not the vocabulary
    assert torch.equal(K.first_argmax(wide), wide.max(dim=-1).indices)


def test_first_argmax_answers_nan_as_torch() -> None:
    x = torch.randn(2, 100)
    x[0, 40] = float("nan")
    x[0, 70] = float("nan")
    x[1, 99] = float("nan")  # in the scalar tail
    assert K.first_argmax(x).tolist() == x.max(dim=-1).indices.tolist() == [40, 99]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_rotary_inplace_on_fused_qkv_views(dtype: torch.dtype, head_dim: int) -> None:
    torch.manual_seed(2)
    t, hq, hkv = 11, 6, 2
    qkv = torch.randn(t, (hq + 2 * hkv) * head_dim).to(dtype)
    q = qkv[:, : hq * head_dim].view(t, hq, head_dim)
    k = qkv[:, hq * head_dim : (hq + hkv) * head_dim].view(t, hkv, head_dim)
    ang = torch.rand(t, 1, head_dim // 2) * 6
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(dtype)
    want_q, want_k = apply_rope(q.clone(), k.clone(), (cos, sin))
    v_before = qkv[:, (hq + hkv) * head_dim :].clone()
    got_q, got_k = apply_rope(q, k, (cos, sin), K)
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(got_k, want_k, **TOL[dtype])
    assert torch.equal(qkv[:, (hq + hkv) * head_dim :], v_before), "V must not be touched"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# Query heads per KV head G: the fast kernels take them in register-sized chunks (4 at D 64, 2 at 128, 1 at
# 256): G = 3, 1, 7 (4 + 3), 8 (4 + 4), 3 at 128 (2 + 1), 2 at 256; D = 48 is the portable kernel.
@pytest.mark.parametrize("head_dim, hq, hkv", [(64, 9, 3), (128, 4, 4), (48, 8, 2), (64, 14, 2), (64, 8, 1),
                                               (128, 6, 2), (256, 4, 2)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("cache", ["model dtype", "int8 per token", "int8 per head"])
def test_paged_decode_matches_reference(dtype: torch.dtype, head_dim: int, hq: int, hkv: int, window: int | None,
                                        cache: str) -> None:
    torch.manual_seed(3)
    block, num_blocks = 4, 64
    kv = _cache(num_blocks, block, hkv, head_dim, dtype, cache)
    # Fill every slot through the cache's own write (INT8: quantized with per-token or per-head scales).
    everything = torch.arange(num_blocks * block)
    kv.write(torch.randn(num_blocks * block, hkv, head_dim).to(dtype),
             torch.randn(num_blocks * block, hkv, head_dim).to(dtype), everything)
    lens = [1, 7, 16, 23, 5, 158]  # a remainder of 1..3 tokens after groups of four; a long one
    bt = _scattered_tables(lens, block, num_blocks - 2)  # the last two blocks are scratch, in no table
    q = torch.randn(len(lens), hq, head_dim).to(dtype)
    got = K.paged_decode(q, kv.k, kv.v, kv.k_scale, kv.v_scale, bt, torch.tensor(lens), head_dim**-0.5, window or 0)
    # The reference writes the new tokens' K/V first: send them to the scratch block, read by no one.
    scratch = torch.arange(len(lens)) + (num_blocks - 2) * block
    junk = torch.randn(len(lens), hkv, head_dim).to(dtype)
    meta = AttentionMetadata(list(range(len(lens) + 1)), lens, bt, scratch, block)
    want = ReferenceBackend().forward(q, junk, junk, kv, meta, head_dim**-0.5, window)
    torch.testing.assert_close(got, want, **TOL[dtype])


# Long contexts among fewer KV heads than threads: the kernels split those items between threads
# (csrc/paged_decode.cpp plan_pieces) and combine the pieces' partial softmaxes. Threads 1 (one run: only
# the INT8 cache's cut into pieces of at most 256 KB of widened rows, 512 tokens at D = 128), 2, 3 and 5
# (an item in up to three pieces, more with INT8), a window and Gemma 2's softcap over a split item;
# bfloat16 q over each cache kind.
@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("head_dim, hq, hkv", [(64, 9, 3), (64, 4, 1), (128, 4, 2)])
@pytest.mark.parametrize("lens, window, softcap", [([1000], 0, 0.0), ([700, 9, 300], 0, 0.0),
                                                   ([900, 40], 500, 0.0), ([600], 0, 30.0)])
@pytest.mark.parametrize("cache", ["model dtype", "int8 per token", "int8 per head"])
def test_paged_decode_splits_long_contexts_between_threads(threads: int, head_dim: int, hq: int, hkv: int,
                                                           lens: list[int], window: int, softcap: float,
                                                           cache: str) -> None:
    torch.manual_seed(7)
    block = 16
    num_blocks = sum(-(-n // block) for n in lens) + 2
    kv = _cache(num_blocks, block, hkv, head_dim, torch.bfloat16, cache)
    kv.write(torch.randn(num_blocks * block, hkv, head_dim).bfloat16(),
             torch.randn(num_blocks * block, hkv, head_dim).bfloat16(), torch.arange(num_blocks * block))
    bt = _scattered_tables(lens, block, num_blocks - 2)  # the last two blocks are in no table
    q = (torch.randn(len(lens), hq, head_dim) * 3).bfloat16()  # peaked softmaxes: the pieces' maxima differ
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = K.paged_decode(q, kv.k, kv.v, kv.k_scale, kv.v_scale, bt, torch.tensor(lens), head_dim**-0.5, window,
                             softcap)
    finally:
        torch.set_num_threads(before)
    # The reference: each sequence's attended K/V as the cache holds them, softmax in float64.
    g = hq // hkv
    for i, n in enumerate(lens):
        k, v = (t.double().repeat_interleave(g, dim=1) for t in kv.gather(bt[i], n, torch.float32))  # (n, Hq, D)
        first = max(0, n - window) if window else 0
        s = torch.einsum("hd,thd->ht", q[i].double(), k[first:]) * head_dim**-0.5
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        want = torch.einsum("ht,thd->hd", s.softmax(-1), v[first:])
        torch.testing.assert_close(got[i].double(), want, rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cache", ["model dtype", "int8 per token", "int8 per head"])
def test_write_kv_is_bit_identical_to_the_cache_write(dtype: torch.dtype, cache: str) -> None:
    torch.manual_seed(5)
    shape = (12, 4, 3, 64)  # (num_blocks, block_size, Hkv, D)
    slots = torch.randperm(48)[:21]
    # Rows of very different ranges (per head: some saturate at +-127 codes, some round to 0), an
    # all-zero head and exact ties at half a step.
    k = (torch.randn(21, 3, 64) * torch.logspace(-3, 2, 21)[:, None, None]).to(dtype)
    v = torch.randn(21, 3, 64).to(dtype)
    k[4, 1] = 0
    v[7, 0, :3] = torch.tensor([127.0, 0.5, -1.5])
    want = _cache(*shape, dtype, cache)
    got = _cache(*shape, dtype, cache)
    want_k, want_v = want.write(k, v, slots)
    if cache != "model dtype":
        got_k, got_v = K.write_kv_int8(k, v, got.k, got.v, got.k_scale, got.v_scale, slots)
        torch.testing.assert_close(got_k, want_k, rtol=0, atol=0)
        torch.testing.assert_close(got_v, want_v, rtol=0, atol=0)
    else:
        K.write_kv(k, v, got.k, got.v, slots)
    for a, b in zip(got.tensors(), want.tensors()):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="out of range"):
        K.write_kv(k[:1], v[:1], got.k, got.v, torch.tensor([48]))


def _scattered_tables(lens: list[int], block: int, usable: int) -> torch.Tensor:
    """Block tables (len(lens), max blocks), zero-padded: each sequence's blocks drawn from a random
    permutation of blocks 0..usable-1 (scattered, as a pool hands them out)."""
    perm = torch.randperm(usable).tolist()
    tables, used = [], 0
    for n in lens:
        nb = -(-n // block)
        tables.append(perm[used : used + nb])
        used += nb
    width = max(len(r) for r in tables)
    return torch.tensor([r + [0] * (width - len(r)) for r in tables])


def _cache(num_blocks: int, block: int, hkv: int, head_dim: int, dtype: torch.dtype, kind: str) -> LayerKVCache:
    """A layer cache of the model dtype, INT8 with per-token scales, or INT8 with per-head scales from
    0.02 to 1 (V's head 0 has 1: v[7, 0, 0] = 127.0 of the write test lands exactly on code 127)."""
    fixed = None
    if kind == "int8 per head":
        fixed = (torch.logspace(-1.7, 0, hkv), torch.logspace(0, -1.7, hkv))
    fmt = {"model dtype": KVCacheFormat.MODEL_DTYPE, "int8 per token": KVCacheFormat.INT8_PER_TOKEN,
           "int8 per head": KVCacheFormat.INT8_PER_HEAD}[kind]
    return LayerKVCache.allocate(num_blocks, block, hkv, head_dim, dtype, fmt, torch.device("cpu"), fixed)


def test_per_head_scales_are_read_never_written() -> None:
    kv = _cache(8, 4, 3, 64, torch.float32, "int8 per head")
    assert kv.per_head_scales and kv.k_scale.stride() == (0, 0, 1)
    assert len(kv.tensors()) == 2  # codes only travel per block
    before = kv.k_scale[0, 0].clone()
    K.write_kv_int8(torch.randn(5, 3, 64) * 100, torch.randn(5, 3, 64), kv.k, kv.v, kv.k_scale, kv.v_scale,
                    torch.arange(5))
    assert torch.equal(kv.k_scale[0, 0], before)
    assert kv.k[:1, :1, 0].abs().max() == 127  # 100x the range of head 0: saturated
    mixed = LayerKVCache.allocate(8, 4, 3, 64, torch.float32, KVCacheFormat.INT8_PER_TOKEN, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="one kind"):
        K.write_kv_int8(torch.randn(1, 3, 64), torch.randn(1, 3, 64), kv.k, kv.v, kv.k_scale, mixed.v_scale,
                        torch.arange(1))


def test_paged_decode_rejects_int8_cache_without_scales() -> None:
    kv = LayerKVCache.allocate(4, 4, 2, 64, torch.float32, KVCacheFormat.INT8_PER_TOKEN, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="scales go with an int8 cache"):
        K.paged_decode(torch.zeros(1, 2, 64), kv.k, kv.v, None, None, torch.zeros(1, 1, dtype=torch.long),
                       torch.ones(1, dtype=torch.long), 0.125, 0)


# Every row count is its own kernel (1-2 rows read weight rows one after another, 3-8 side by side in
# blocks of 4, 3 or 2); 301 weight rows leave a partial block, in each thread's share too.
@pytest.mark.parametrize("rows", range(1, SKINNY_MAX_ROWS + 1))
@pytest.mark.parametrize("k_dim", [576, 100])  # a multiple of 32 (vector path) and one with a tail
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_matches_float32_reference(rows: int, k_dim: int, bias: bool) -> None:
    torch.manual_seed(rows)
    x = torch.randn(rows, k_dim).bfloat16()
    w = torch.randn(301, k_dim).bfloat16()
    b = torch.randn(301).bfloat16() if bias else None
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())  # exact products
    got = K.skinny_linear(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 301)
    # Only the final rounding to bfloat16 (and float32 summation order) separate the two.
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=2e-2)


@pytest.mark.parametrize("k_dim", [576, 100])
def test_skinny_linear_rows_do_not_depend_on_batch(k_dim: int) -> None:
    """A token's result is the same whether it is alone (decode) or among 1 + k (verification), whichever
    route its row count takes and however the weight rows are split between threads."""
    torch.manual_seed(5)
    x = torch.randn(SKINNY_MAX_ROWS, k_dim).bfloat16()
    w = torch.randn(1001, k_dim).bfloat16()
    b = torch.randn(1001).bfloat16()
    together = K.skinny_linear(x, w, b)
    for rows in range(1, SKINNY_MAX_ROWS):
        assert torch.equal(K.skinny_linear(x[:rows], w, b), together[:rows])
    for i in range(SKINNY_MAX_ROWS):
        assert torch.equal(K.skinny_linear(x[i : i + 1], w, b), together[i : i + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(K.skinny_linear(x, w, b), together)
    finally:
        torch.set_num_threads(threads)


def test_skinny_linear_rejects_bad_shapes() -> None:
    with pytest.raises(RuntimeError, match="1..8 rows"):
        K.skinny_linear(torch.zeros(9, 32).bfloat16(), torch.zeros(4, 32).bfloat16(), None)
    with pytest.raises(RuntimeError, match="bfloat16 only"):
        K.skinny_linear(torch.zeros(2, 32), torch.zeros(4, 32), None)
