"""A fused projection whose parts are stored with different quantized types.

tokenloom fuses q/k/v into one `qkv_proj` and gate/up into `gate_up_proj`; a GGUF file may store the
parts in different types (Gemma 3 Q4_K_M: attn_q/attn_k Q5_0, attn_v Q8_0). Parts of one kind are
concatenated into one layer beforehand (gguf_kept.py); PartsLinear runs each remaining layer on the same x
and concatenates their outputs along the features: (M, N1) + (M, N2) + ... -> (M, N). For a decode step the
copy is a few kilobytes; the weights are each read once, by their own kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenloom.errors import ConfigError


class PartsLinear(nn.Module):
    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        if not parts or len({p.in_features for p in parts}) != 1:
            raise ConfigError("PartsLinear needs parts with one input width")
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32, the parts' weights stacked."""
        return torch.cat([p.dequantize() for p in self.parts])

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.reference(x) for p in self.parts], dim=-1)
