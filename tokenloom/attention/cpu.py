"""The fast CPU backend: prefill chunks through torch SDPA, decode tokens through a C++ paged kernel.

The kernel (csrc/paged_decode.cpp) reads each sequence's K/V in place through its block table, so
decode attention needs neither the gather copy nor the padding mask of the SDPA path.
"""

from __future__ import annotations

from types import ModuleType

import torch

from tokenloom.attention.sdpa import SDPABackend, _Plan


class CPUBackend(SDPABackend):
    name = "cpu"

    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _Plan, scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        if q.device.type != "cpu":
            return super().decode(q, k_cache, v_cache, plan, scale, sliding_window)
        return self.kernels.paged_decode(
            q.contiguous(), k_cache, v_cache, plan.decode_blocks, plan.decode_lens, scale, sliding_window or 0
        )
