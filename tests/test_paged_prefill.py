"""Paged prefill attention (csrc/paged_prefill.cpp, the CPU backend's prefill chunks) against the float32
reference backend on random paged caches, and chunked prefill through the engine against transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import assert_matches_reference, hf_greedy_ids
from tokenloom import LLM, SamplingParams
from tokenloom.attention.base import AttentionMetadata
from tokenloom.attention.cpu import CPUBackend
from tokenloom.attention.paged_kv import LayerKVCache
from tokenloom.attention.reference import ReferenceBackend
from tokenloom.config import KVCacheFormat
from tokenloom.kernels import load_cpu_kernels

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the CPU kernels could not be built")

BS = 16
# (prefix already cached, new tokens in this chunk) per sequence: a fresh prompt, long prefixes with
# chunks that are not multiples of the tile sizes, a chunk of one token.
CHUNKS = [(0, 45), (70, 33), (131, 64), (5, 1), (200, 17)]


def _random_step(fmt: KVCacheFormat, dtype: torch.dtype, hq: int, hkv: int, d: int, seed: int
                 ) -> tuple[LayerKVCache, LayerKVCache, AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two identical caches (one per backend) holding every sequence's prefix, the chunks' q/k/v, and the
    step's metadata. Block tables are shuffled block ids, so no sequence's blocks are contiguous."""
    g = torch.Generator().manual_seed(seed)
    need = [(p + n + BS - 1) // BS for p, n in CHUNKS]
    perm = torch.randperm(sum(need) + 4, generator=g)[: sum(need)] + 1  # block 0 stays unused
    max_blocks = max(need) + 2
    tables = torch.zeros(len(CHUNKS), max_blocks, dtype=torch.int64)
    fixed = (torch.rand(hkv, generator=g) * 0.02 + 0.01, torch.rand(hkv, generator=g) * 0.02 + 0.01)
    caches = [LayerKVCache.allocate(sum(need) + 5, BS, hkv, d, dtype, fmt, torch.device("cpu"),
                                    fixed if fmt.per_head_scales else None) for _ in range(2)]
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[at : at + n]
        at += n

    def slots(i: int, lo: int, hi: int) -> torch.Tensor:
        t = torch.arange(lo, hi)
        return tables[i, t // BS] * BS + t % BS

    for i, (prefix, _) in enumerate(CHUNKS):  # the prefixes, written as an earlier step would have
        if prefix:
            k, v = (torch.randn(prefix, hkv, d, generator=g).to(dtype) for _ in range(2))
            for c in caches:
                c.write(k, v, slots(i, 0, prefix))
    total = sum(n for _, n in CHUNKS)
    q = torch.randn(total, hq, d, generator=g).to(dtype)
    k, v = (torch.randn(total, hkv, d, generator=g).to(dtype) for _ in range(2))
    starts = [0]
    for _, n in CHUNKS:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(query_start_loc=starts, seq_lens=[p + n for p, n in CHUNKS], block_tables=tables,
                             slot_mapping=torch.cat([slots(i, p, p + n) for i, (p, n) in enumerate(CHUNKS)]),
                             block_size=BS)
    return caches[0], caches[1], meta, q, k, v


CASES = [  # (cache format, dtype, Hq, Hkv, head_dim, sliding window)
    (KVCacheFormat.MODEL_DTYPE, torch.float32, 4, 4, 64, None),
    (KVCacheFormat.MODEL_DTYPE, torch.bfloat16, 9, 3, 64, None),
    (KVCacheFormat.MODEL_DTYPE, torch.bfloat16, 8, 2, 128, 40),
    (KVCacheFormat.MODEL_DTYPE, torch.float32, 6, 2, 128, 7),
    (KVCacheFormat.INT8_PER_TOKEN, torch.bfloat16, 9, 3, 64, None),
    (KVCacheFormat.INT8_PER_HEAD, torch.float32, 8, 2, 128, 40),
    (KVCacheFormat.MODEL_DTYPE, torch.bfloat16, 8, 1, 256, None),  # Gemma's head size, eight heads per KV head
    (KVCacheFormat.MODEL_DTYPE, torch.bfloat16, 4, 4, 128, 100),  # one head per KV head, a window of 100
    (KVCacheFormat.MODEL_DTYPE, torch.float32, 2, 1, 40, None),  # a head size without an unrolled kernel
]


@pytest.mark.parametrize("fmt,dtype,hq,hkv,d,window", CASES)
def test_kernel_matches_reference(fmt: KVCacheFormat, dtype: torch.dtype, hq: int, hkv: int, d: int,
                                  window: int | None) -> None:
    kv_ref, kv_fast, meta, q, k, v = _random_step(fmt, dtype, hq, hkv, d, seed=hq * d)
    scale = d ** -0.5
    want = ReferenceBackend().forward(q, k, v, kv_ref, meta, scale, window)
    backend = CPUBackend(kernels)
    backend.write_kv(kv_fast, k, v, meta.slot_mapping)
    got = torch.full_like(q, float("nan"))  # every chunk's rows must be written
    n = meta.num_seqs
    kernels.paged_prefill(
        q, kv_fast.k, kv_fast.v, kv_fast.k_scale, kv_fast.v_scale, meta.block_tables,
        torch.tensor(meta.query_start_loc[:n]), torch.tensor([meta.query_len(i) for i in range(n)]),
        torch.tensor(meta.seq_lens), scale, window or 0, got)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4  # bf16: one rounding of the output
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [None, 40])
def test_backend_forward_routes_chunks_through_the_kernel(window: int | None) -> None:
    """The CPU backend's whole forward (decode rows, short and long chunks in one step) as the reference."""
    kv_ref, kv_fast, meta, q, k, v = _random_step(KVCacheFormat.MODEL_DTYPE, torch.bfloat16, 9, 3, 64, seed=5)
    want = ReferenceBackend().forward(q, k, v, kv_ref, meta, 0.125, window)
    got = CPUBackend(kernels).forward(q, k, v, kv_fast, meta, 0.125, window)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_bad_chunk_is_a_clear_error() -> None:
    kv, _, meta, q, _, _ = _random_step(KVCacheFormat.MODEL_DTYPE, torch.float32, 4, 4, 64, seed=1)
    one = torch.tensor([0])
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.paged_prefill(q, kv.k, kv.v, None, None, meta.block_tables[:1], one, torch.tensor([50]),
                              torch.tensor([10]), 0.125, 0, torch.empty_like(q))  # ctx < q_len


def test_chunked_prefill_matches_transformers(tiny_llama: Path) -> None:
    """A long prompt prefilled in small chunks (each attending its cached prefix through the kernel) gives
    transformers' greedy tokens and first-token logprobs, as does the same prompt in one chunk."""
    from transformers import AutoModelForCausalLM

    prompt = [(7 * i + 3) % 250 + 2 for i in range(300)]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref_ids, ref_lp = hf_greedy_ids(hf, prompt, 12)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    for budget in (64, 512):  # 5 chunks of 64 (the last shorter), or the whole prompt at once
        llm = LLM(str(tiny_llama), dtype="float32", max_num_batched_tokens=budget, max_num_seqs=4,
                  attention_backend="cpu")
        backend = llm.engine.backend
        assert isinstance(backend, CPUBackend) and backend.paged_prefill  # the chunks ran through the kernel
        outs = llm.generate([prompt], params)
        assert_matches_reference(outs, [ref_ids], [ref_lp], atol=1e-3)
