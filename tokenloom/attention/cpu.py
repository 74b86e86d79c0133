"""The fast CPU backend: decode tokens through a C++ paged decode kernel, prefill chunks that continue a
sequence through a C++ paged prefill kernel, K/V written (and INT8-quantized) into the cache by one C++
call per layer.

The kernels (csrc/paged_decode.cpp, csrc/paged_prefill.cpp) read each sequence's K/V in place through its
block table, so attention needs neither the gather copy nor the padding mask of the SDPA path; an INT8
cache is dequantized row by row inside them. The SDPA path gathered a chunk's whole prefix, every layer,
once per chunk: a 4,000-token prompt in 512-token chunks copied (and masked) its prefix 8 times per layer.
"""

from __future__ import annotations

from types import ModuleType

import torch

from tokenloom.attention.paged_kv import LayerKVCache
from tokenloom.attention.base import AttentionMetadata
from tokenloom.attention.sdpa import DecodePlan, PrefillChunk, SDPABackend


class CPUBackend(SDPABackend):
    name = "cpu"

    def __init__(self, kernels: ModuleType, paged_prefill: bool = True) -> None:
        self.kernels = kernels
        # False: every prefill chunk through SDPA (the old path; benchmarks/long_prompt.py compares both).
        self.paged_prefill = paged_prefill

    def uses_kernel(self, p: PrefillChunk, softcap: float | None = None) -> bool:
        """The routing rule, measured (docs/benchmarks.md, "Long prompts: paged prefill attention"):
        - a chunk over a cached prefix, or under a sliding window, reads the cache in place through the
          kernel: SDPA had to gather (copy) the prefix and apply an explicit (q_len, ctx) mask, every
          layer, once per chunk (benchmarks/long_prompt.py: 1,000 and 4,000-token prompts in 512-token
          chunks; the kernel's bf16 route took under half SDPA's time for the last chunk of each);
        - a chunk that is its sequence's whole context with no window (a fresh prompt, or the first
          chunk of one) stays on SDPA's causal flash kernel over the fresh K/V: there is nothing to
          gather. The kernel's bf16 route measured faster there too (1.4 against 4.4 ms for 512 fresh
          tokens, Zen 4), as accurate against a float32 reference (relative error 0.00176 against SDPA's
          0.00180 per layer of SmolLM2) but not bit-equal, and the default model's greedy answers sit
          on bf16 near-ties ("What is the capital of France?" starts with "The" / "L" 0.08 nats apart
          in float32): the kernel's roundings tied them where SDPA's leave "The" ahead, so fresh prompts
          keep SDPA's (docs/performance-notes.md, "Paged prefill attention");
        - a soft-capped layer's chunks (Gemma 2) all take the kernel, which caps the scores in its tiles:
          SDPA's fused kernel cannot, and its math path (sdpa.softcapped_attention) materialises every
          (q_len, ctx) score."""
        return self.paged_prefill and (softcap is not None or p.blocks is not None or p.mask is not None)

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKVCache, meta: AttentionMetadata,
        plan: DecodePlan, scale: float, sliding_window: int | None, out: torch.Tensor, softcap: float | None = None,
    ) -> None:
        if q.device.type != "cpu":
            return super().prefill(q, k, v, kv, meta, plan, scale, sliding_window, out, softcap)
        chunks = [p for p in plan.prefills if self.uses_kernel(p, softcap)]
        for p in plan.prefills:
            if not self.uses_kernel(p, softcap):
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
