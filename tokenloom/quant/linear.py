"""Weight-only quantized linear layers: the weight stays as int8 / int4 codes with float16 scales in
memory, the matmul runs in the C++ kernels of kernels/csrc/quant_gemm.cpp (bfloat16 activations, int8
ones for int8 weights on the few-row decode path; float32 accumulation); without them (no compiler, no
AVX512-BF16 or AVX512-VNNI) each call dequantizes to bfloat16.

One storage format covers tokenloom's own quantization and the GGUF types kept as they are:
- Int8Linear: w = d q, scales (N, G) float16: G = 1 (per output channel) or K/32 (GGUF Q8_0).
- Int4Linear: w = d q + m, q in [0, 15], scales and mins (N, G) float16, G = K/g (GGUF Q4_1; Q4_0 is
  m = -8 d).
The `codes` buffer is in the kernels' layout (quant/layout.py: (N, Kp) int8 or (N, Kp/2) uint8, K
padded to 64), and so are int4's `scales` and `mins` (blocked by 16 output channels); `from_codes` takes
plain (N, K) codes and (N, G) scales. `reference()` dequantizes to float32 and calls F.linear: the test
oracle.

Routes (`route`): "auto" lets the kernel choose from the row count and quant/routing.py's start-up choice
(VNNI up to `quant_tile_max_rows` rows, then the weight expanded to bf16 for oneDNN); "vnni" and "expand"
force one of the two at any row count, "torch" forces the Python fallback. Every route computes the same
product to the same tolerance, so tests force each on any CPU that has the kernels.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.errors import ConfigError
from tokenloom.kernels import load_quant_kernels
from tokenloom.quant.layout import (BLOCK, int4_from_kernel, int4_scales_from_kernel, int4_scales_to_kernel,
                                    int4_to_kernel, int8_from_kernel, int8_to_kernel, padded)
from tokenloom.quant.routed import RoutedLayer
from tokenloom.quant.quantizers import int4_group_size, quantize_int4, quantize_int8

class QuantLinear(RoutedLayer):
    """Shared buffers and forward of Int8Linear / Int4Linear (subclasses set `bits`)."""

    KERNEL_ROUTES = {"auto": 0, "vnni": 1, "expand": 2}  # RoutedLayer: the C++ kernel's route ids
    bits: int = 0
    kernels: ModuleType | None = None  # set on first forward: the C++ module, or None for the torch path
    _kernels_checked = False

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 bias: torch.Tensor | None, in_features: int) -> None:
        super().__init__()
        n, g_count = scales.shape
        row_bytes = padded(in_features) * self.bits // 8
        if codes.shape != (n, row_bytes) or in_features % g_count:
            raise ConfigError(f"quantized layer: codes {tuple(codes.shape)} and scales {tuple(scales.shape)} "
                              f"do not fit {in_features} inputs")
        self.in_features, self.out_features = in_features, n
        self.group_size = in_features // g_count
        self.dtype = torch.bfloat16  # activations and outputs
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", scales.to(torch.float16).contiguous())
        self.register_buffer("mins", None if mins is None else mins.to(torch.float16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.to(torch.bfloat16).contiguous())
        self.route = "auto"

    @classmethod
    def kernel_module(cls) -> ModuleType | None:
        """The C++ module with the quantized matmuls (loaded on first use), or None: the torch path."""
        if not QuantLinear._kernels_checked:
            QuantLinear.kernels = load_quant_kernels()
            QuantLinear._kernels_checked = True
        return QuantLinear.kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The common case first and lean: a decode step calls this ~120 times.
        if x.dim() == 2 and x.dtype == torch.bfloat16 and x.is_cpu and self._route_id >= 0:
            k = self.kernel_module()
            if k is not None:
                return k.quant_linear(x, self.codes, self.scales, self.mins, self.bits, self.bias, self._route_id)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(self.dtype)
        k = self.kernel_module() if x2.is_cpu and self._route_id >= 0 else None
        if k is not None:
            y = k.quant_linear(x2, self.codes, self.scales, self.mins, self.bits, self.bias, self._route_id)
        else:
            y = F.linear(x2, self.dequantize().to(self.dtype), self.bias)
        return y.reshape(*shape[:-1], self.out_features)

    def codes_as_int(self) -> torch.Tensor:
        """(N, K) codes as stored values (int8) or nibbles (int4)."""
        raise NotImplementedError

    def group_params(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(N, G) scales and mins (None for int8) in plain row order."""
        return self.scales, self.mins

    def dequantize(self) -> torch.Tensor:
        """The weight the layer stands for, (N, K) float32."""
        n, k, g = self.out_features, self.in_features, self.group_size
        scales, mins = self.group_params()
        q = self.codes_as_int().float().reshape(n, k // g, g)
        w = q * scales.float()[..., None]
        if mins is not None:
            w = w + mins.float()[..., None]
        return w.reshape(n, k)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """float32 oracle: the dequantized weight in F.linear."""
        return F.linear(x.float(), self.dequantize(), None if self.bias is None else self.bias.float())

    def rows_params(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(T, K) codes and (T, G) scales and mins of the output channels `rows` (T,)."""
        raise NotImplementedError

    def dequantize_rows(self, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `rows` (T,) of the weight, (T, K) in `dtype`, decoding only those rows (a quantized
        embedding's lookup: quant/embedding.py); equal to dequantize()[rows]."""
        rows = rows.reshape(-1)
        q, scales, mins = self.rows_params(rows)
        g = self.group_size
        w = q.float().reshape(rows.numel(), -1, g) * scales.float()[..., None]
        if mins is not None:
            w = w + mins.float()[..., None]
        return w.reshape(rows.numel(), self.in_features).to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


class Int8Linear(QuantLinear):
    bits = 8

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, in_features: int) -> None:
        """`codes`: (N, Kp) int8 in kernel layout; `scales`: (N, 1) or (N, K/g) with g a multiple of 32."""
        if codes.dtype != torch.int8:
            raise ConfigError(f"Int8Linear needs int8 codes, got {codes.dtype}")
        groups = scales.shape[1]
        if groups != 1 and (in_features % groups or (in_features // groups) % 32):
            raise ConfigError(f"Int8Linear: {groups} scale groups do not split {in_features} inputs into "
                              f"multiples of 32")
        super().__init__(codes, scales, None, bias, in_features)

    @classmethod
    def from_codes(cls, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        """`q`: (N, K) int8; w = scales[:, k // g] q."""
        return cls(int8_to_kernel(q), scales, bias, q.shape[1])

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        q, s = quantize_int8(linear.weight.data)
        return cls.from_codes(q, s, None if linear.bias is None else linear.bias.data)

    def codes_as_int(self) -> torch.Tensor:
        return int8_from_kernel(self.codes, self.in_features)

    def rows_params(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return (int8_from_kernel(self.codes.index_select(0, rows), self.in_features),
                self.scales.index_select(0, rows), None)


class Int4Linear(QuantLinear):
    bits = 4

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bias: torch.Tensor | None,
                 in_features: int) -> None:
        """`codes`: (N, Kp/2) uint8, `scales`, `mins`: (N, K/g) float16, all in kernel layout (blocks of
        16 output channels); g is 32 or a multiple of 64."""
        if codes.dtype != torch.uint8:
            raise ConfigError(f"Int4Linear needs uint8 codes, got {codes.dtype}")
        groups = scales.shape[1]
        g = in_features // groups if in_features % groups == 0 else 0
        if in_features % 32 or not (g == 32 or (g and g % 64 == 0)):
            raise ConfigError(f"Int4Linear: {in_features} inputs in {groups} groups; groups must be 32 or a "
                              f"multiple of 64 inputs")
        if mins.shape != scales.shape:
            raise ConfigError(f"Int4Linear: mins {tuple(mins.shape)} differ from scales {tuple(scales.shape)}")
        super().__init__(codes, scales, mins, bias, in_features)

    @classmethod
    def from_codes(cls, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                   bias: torch.Tensor | None = None) -> Int4Linear:
        """`q`: (N, K) codes in [0, 15]; w = scales[:, k // g] q + mins[:, k // g]."""
        return cls(int4_to_kernel(q), int4_scales_to_kernel(scales.half()), int4_scales_to_kernel(mins.half()), bias,
                   q.shape[1])

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int) -> Int4Linear:
        g = int4_group_size(linear.in_features, group_size)
        q, d, m = quantize_int4(linear.weight.data, g)
        return cls.from_codes(q, d, m, None if linear.bias is None else linear.bias.data)

    def codes_as_int(self) -> torch.Tensor:
        return int4_from_kernel(self.codes, self.in_features)

    def group_params(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        mins = self.mins
        return int4_scales_from_kernel(self.scales), None if mins is None else int4_scales_from_kernel(mins)

    def rows_params(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        # Layout version 3 (quant/layout.py): channel c is channel j = c % 16 of block c // 16, whose r
        # channels (16, or fewer in a last partial block) own r * Kp / 2 bytes: step s (inputs 8s..8s+7)
        # at 4 r s, channel j's 4 bytes at 4 r s + 4 j; its scales and mins: group t at r t + j.
        n, kp, groups = self.out_features, self.codes.shape[1] * 2, self.scales.shape[1]
        full = n // BLOCK * BLOCK
        r = torch.where(rows < full, BLOCK, n - full)  # (T,) channels in each row's block
        start = rows - rows % BLOCK  # first channel of the block
        j = rows - start
        steps = torch.arange(kp // 8)
        byte = (start * kp // 2)[:, None, None] + 4 * r[:, None, None] * steps[None, :, None] \
            + 4 * j[:, None, None] + torch.arange(4)[None, None, :]  # (T, Kp/8, 4)
        b = self.codes.reshape(-1)[byte]
        q = torch.stack([b & 0x0F, b >> 4], dim=2).reshape(rows.numel(), kp)[:, :self.in_features]
        at = (start * groups)[:, None] + r[:, None] * torch.arange(groups)[None, :] + j[:, None]  # (T, G)
        mins = self.mins
        return q, self.scales.reshape(-1)[at], None if mins is None else mins.reshape(-1)[at]
