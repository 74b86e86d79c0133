"""The fast CPU backend: decode tokens through a C++ paged decode kernel, prefill chunks that continue a
sequence through a C++ paged prefill kernel, K/V written (and INT8-quantized) into the cache by one C++
call per layer.

The kernels (csrc/paged_decode.cpp, csrc/paged_prefill.cpp) read each sequence's K/V in place through its
block table, so attention needs neither the gather copy nor the padding mask of the SDPA path; an INT8
cache is dequantized row by row inside them. The SDPA path gathered a chunk's whole prefix, every layer,
once per chunk: a 4,000-token prompt in 512-token chunks copied (and masked) its prefix 8 times per layer.
"""

from __future__ import annotations

import functools
import logging
import time
from types import ModuleType

import torch

from tokenloom.attention.paged_kv import LayerKVCache
from tokenloom.attention.base import AttentionMetadata
from tokenloom.attention.sdpa import DecodePlan, PrefillChunk, SDPABackend

log = logging.getLogger("tokenloom.attention")

# The start-up probe of fresh chunks: (tokens, query heads, KV heads, head size): a served step's 512-token
# chunk of SmolLM2's attention (the default model), bf16.
FRESH_PROBE = (512, 9, 3, 64)
_KERNEL_HEAD_SIZES = (64, 128, 256)  # the kernel's vectorised head sizes (the bf16 route among them)


@functools.cache
def fresh_chunks_faster_in_kernel(kernels: ModuleType) -> bool:
    """Whether a fresh bf16 chunk (no cached prefix) runs faster through the paged kernel's vdpbf16ps route
    than through SDPA's causal flash kernel on this CPU: both timed once per process on FRESH_PROBE (fastest
    of 3 calls each, alternating), the choice and the timings logged. Measured rather than assumed: SDPA's
    bf16 GEMMs are oneDNN's, which run AMX tiles where the CPU has them; on a 2-core Zen 4 (no AMX) the
    kernel took 2.1 against 5.0 ms at 512 tokens and 30 against 42 ms at 2,048."""
    if not kernels.paged_prefill_bf16_route():
        return False
    n, hq, hkv, d = FRESH_PROBE
    bs = 16
    blocks = (n + bs - 1) // bs
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(blocks, bs, hkv, d, generator=g).bfloat16() for _ in range(2))
    q = torch.randn(n, hq, d, generator=g).bfloat16()
    table, lens, starts = torch.arange(blocks)[None], torch.tensor([n]), torch.tensor([0])
    out = torch.empty_like(q)
    qs = q.transpose(0, 1)[None]  # (1, Hq, n, D)
    ks, vs = (c.reshape(-1, hkv, d)[:n].transpose(0, 1)[None] for c in (k_cache, v_cache))

    def kernel() -> None:
        kernels.paged_prefill(q, k_cache, v_cache, None, None, table, starts, lens, lens, d**-0.5, 0, out)

    def sdpa() -> None:
        torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)

    best = {kernel: float("inf"), sdpa: float("inf")}
    for _ in range(4):  # the first round warms both
        for f in best:
            t = time.perf_counter()
            f()
            best[f] = min(best[f], time.perf_counter() - t)
    faster = best[kernel] < best[sdpa]
    log.info("paged prefill: fresh bf16 chunks through %s (%d tokens, %d/%d heads of %d: kernel %.2f ms, SDPA "
             "%.2f ms)", "the paged kernel" if faster else "SDPA", n, hq, hkv, d, best[kernel] * 1e3,
             best[sdpa] * 1e3)
    return faster


class CPUBackend(SDPABackend):
    name = "cpu"

    def __init__(self, kernels: ModuleType, paged_prefill: bool = True, fresh_chunks: bool | None = None) -> None:
        self.kernels = kernels
        # False: every prefill chunk through SDPA (the old path; benchmarks/long_prompt.py compares both).
        self.paged_prefill = paged_prefill
        # Fresh bf16 chunks through the kernel too; None: as measured on this CPU at start-up.
        self.fresh_chunks = fresh_chunks_faster_in_kernel(kernels) if fresh_chunks is None else fresh_chunks

    def uses_kernel(self, p: PrefillChunk, softcap: float | None = None, fresh_ok: bool = False) -> bool:
        """The routing rule, measured (docs/benchmarks.md, "Long prompts: paged prefill attention"):
        - a chunk over a cached prefix, or under a sliding window, reads the cache in place through the
          kernel: SDPA had to gather (copy) the prefix and apply an explicit (q_len, ctx) mask, every
          layer, once per chunk (benchmarks/long_prompt.py: 1,000 and 4,000-token prompts in 512-token
          chunks; the kernel's bf16 route took half SDPA's time for the last chunk of 1,000-4,000 tokens);
        - a chunk that is its sequence's whole context with no window (a fresh prompt, or the first
          chunk of one) takes the kernel where `fresh_ok` (a bf16 layer whose fresh chunks measured
          faster there on this CPU: fresh_chunks_faster_in_kernel), else SDPA's causal flash kernel over
          the fresh K/V (the float32 route lost to it at 2,048 fresh tokens);
        - a soft-capped layer's chunks (Gemma 2) all take the kernel, which caps the scores in its tiles:
          SDPA's fused kernel cannot, and its math path (sdpa.softcapped_attention) materialises every
          (q_len, ctx) score."""
        return self.paged_prefill and (softcap is not None or p.blocks is not None or p.mask is not None or fresh_ok)

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKVCache, meta: AttentionMetadata,
        plan: DecodePlan, scale: float, sliding_window: int | None, out: torch.Tensor, softcap: float | None = None,
    ) -> None:
        if q.device.type != "cpu":
            return super().prefill(q, k, v, kv, meta, plan, scale, sliding_window, out, softcap)
        fresh_ok = (self.fresh_chunks and q.dtype == kv.k.dtype == torch.bfloat16
                    and q.shape[-1] in _KERNEL_HEAD_SIZES)
        chunks = [p for p in plan.prefills if self.uses_kernel(p, softcap, fresh_ok)]
        for p in plan.prefills:
            if not self.uses_kernel(p, softcap, fresh_ok):
                self.prefill_chunk(q, k, v, kv, p, scale, out, softcap)
        if not chunks:
            return None
        # One call for every routed chunk (varlen): each chunk's rows of q and its sequence's block table.
        rows = torch.tensor([p.seq for p in chunks])
        self.kernels.paged_prefill(
            q.contiguous(), kv.k, kv.v, kv.k_scale, kv.v_scale, meta.block_tables[rows],
            torch.tensor([p.start for p in chunks]), torch.tensor([p.end - p.start for p in chunks]),
            torch.tensor([p.ctx for p in chunks]), scale, sliding_window or 0, out, softcap or 0.0,
        )
        return None

    def write_kv(self, kv: LayerKVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        if k.device.type != "cpu":
            return kv.write(k, v, slot_mapping)
        # Same values as LayerKVCache.write (the oracle, tests/test_kv_int8.py), without its ~10 torch
        # ops per layer and step: an INT8 cache cost single-stream decode a quarter of its speed.
        k, v = k.contiguous(), v.contiguous()
        if kv.format.quantized:  # per-head or per-token scales: the kernel tells them by their strides
            return self.kernels.write_kv_int8(k, v, kv.k, kv.v, kv.k_scale, kv.v_scale, slot_mapping)
        self.kernels.write_kv(k.to(kv.k.dtype), v.to(kv.v.dtype), kv.k, kv.v, slot_mapping)
        return k, v

    def decode(
        self, q: torch.Tensor, kv: LayerKVCache, plan: DecodePlan, scale: float, sliding_window: int | None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        if q.device.type != "cpu":
            return super().decode(q, kv, plan, scale, sliding_window, softcap)
        # An INT8 cache passes its scales; the kernel dequantizes each K/V row as it reads it.
        return self.kernels.paged_decode(
            q.contiguous(), kv.k, kv.v, kv.k_scale, kv.v_scale, plan.decode_blocks, plan.decode_lens, scale,
            sliding_window or 0, softcap or 0.0,  # 0: no cap (the kernels' unchanged fast path)
        )
