"""The fast CPU backend: prefill chunks through torch SDPA, decode tokens through a C++ paged kernel,
K/V written (and INT8-quantized) into the cache by one C++ call per layer.

The kernel (csrc/paged_decode.cpp) reads each sequence's K/V in place through its block table, so
decode attention needs neither the gather copy nor the padding mask of the SDPA path; an INT8 cache is
dequantized row by row inside the kernel.
"""

from __future__ import annotations

from types import ModuleType

import torch

from tokenloom.attention.paged_kv import LayerKVCache
from tokenloom.attention.sdpa import DecodePlan, SDPABackend


class CPUBackend(SDPABackend):
    name = "cpu"

    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels

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
    ) -> torch.Tensor:
        if q.device.type != "cpu":
            return super().decode(q, kv, plan, scale, sliding_window)
        # An INT8 cache passes its scales; the kernel dequantizes each K/V row as it reads it.
        return self.kernels.paged_decode(
            q.contiguous(), kv.k, kv.v, kv.k_scale, kv.v_scale, plan.decode_blocks, plan.decode_lens, scale,
            sliding_window or 0,
        )
