"""GGUF K-quant (Q4_K, Q5_K, Q6_K) and Q5_0 linear layers, kept as the file's blocks.

The weight is the tensor's GGUF blocks, (N, K / QK * type_size) uint8 (QK = 256 for the K-quants, 32 for
Q5_0): a layer costs exactly its file bytes, and the quantized embedding (quant/embedding.py) gathers rows
of the same storage. K-quant blocks are kept as they are; Q5_0 rows are repacked, same bytes, into planes
(q50_to_planar; why: kernels/csrc/kquant.cpp). The matmul runs in kernels/csrc/kquant.cpp; without the
compiled kernels each call dequantizes to bfloat16 and calls F.linear. `reference()` (the dequantized float32 weight in F.linear) is the test oracle; the
dequantization is models/gguf_quants.py, bit-identical to gguf.quants.

Routes (`route`): "auto" lets the kernel choose from the CPU's features, the row count and quant/routing.py's
start-up choice; "vnni" (int8 activations: the weight read once per call, dotted with up to 8 rows of x
per row of W, or decoded 16 rows of W at a time into cache-resident tiles for more rows of x), "avx512" and
"portable" (the weight expanded to bf16, then oneDNN) force one, and "torch" forces the Python fallback. `kernel_routes()` lists those this build
has; every route computes the same product, so tests force each on any row count.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from tokenloom.errors import ConfigError
from tokenloom.kernels import load_cpu_kernels
from tokenloom.models.gguf_quants import dequantize
from tokenloom.quant.routed import RoutedLayer

Q = GGMLQuantizationType
KQUANT_TYPES = (Q.Q5_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
def q50_to_planar(blocks: torch.Tensor) -> torch.Tensor:
    """(N, nb * 22) Q5_0 rows of blocks (d f16 | qh u32 | qs[16]) -> (N, nb * 22) rows of planes: the nb
    d, then the nb qh, then the nb qs."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, 22)
    return torch.cat([b[..., :2].reshape(n, -1), b[..., 2:6].reshape(n, -1), b[..., 6:].reshape(n, -1)], dim=1)


def q50_from_planar(planes: torch.Tensor) -> torch.Tensor:
    """Inverse of q50_to_planar."""
    n, nb = planes.shape[0], planes.shape[1] // 22
    d, qh, qs = planes[:, :2 * nb], planes[:, 2 * nb:6 * nb], planes[:, 6 * nb:]
    return torch.cat([d.reshape(n, nb, 2), qh.reshape(n, nb, 4), qs.reshape(n, nb, 16)], dim=2).reshape(n, -1)


class KQuantLinear(RoutedLayer):
    KERNEL_ROUTES = {"auto": 0, "vnni": 1, "avx512": 2, "portable": 3}  # RoutedLayer: the C++ kernel's route ids
    ROUTE_LABEL = "KQuantLinear"
    kernels: ModuleType | None = None  # the C++ module with kquant_linear, or None: the torch path
    _kernels_checked = False

    def __init__(self, blocks: torch.Tensor, qtype: GGMLQuantizationType, in_features: int,
                 bias: torch.Tensor | None = None, route: str = "auto") -> None:
        """`blocks`: (N, K / QK * type_size) uint8, each row the GGUF blocks of one output channel (as in the
        file; Q5_0 rows are repacked here)."""
        super().__init__()
        if qtype not in KQUANT_TYPES:
            raise ConfigError(f"KQuantLinear: GGUF type {qtype.name} is not one of "
                              f"{', '.join(t.name for t in KQUANT_TYPES)}")
        qk, type_size = GGML_QUANT_SIZES[qtype]
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or in_features % qk \
                or blocks.shape[1] != in_features // qk * type_size:
            raise ConfigError(f"KQuantLinear: {qtype.name} blocks {tuple(blocks.shape)} {blocks.dtype} do not hold "
                              f"{in_features} inputs per row")
        self.qtype = GGMLQuantizationType(qtype)
        self.in_features, self.out_features = in_features, blocks.shape[0]
        self.route = route
        self.dtype = torch.bfloat16  # activations and outputs
        # (N, row bytes): the GGUF blocks; Q5_0: their planes
        self.register_buffer("blocks", q50_to_planar(blocks) if self.qtype == Q.Q5_0 else blocks.contiguous())
        self.register_buffer("bias", None if bias is None else bias.to(torch.bfloat16).contiguous())

    @classmethod
    def kernel_module(cls) -> ModuleType | None:
        if not KQuantLinear._kernels_checked:
            mod = load_cpu_kernels()
            KQuantLinear.kernels = mod if mod is not None and hasattr(mod, "kquant_linear") else None
            KQuantLinear._kernels_checked = True
        return KQuantLinear.kernels

    @classmethod
    def kernel_routes(cls) -> tuple[str, ...]:
        """The kernel routes this build has ("vnni", "avx512", "portable"; none without the kernels)."""
        k = cls.kernel_module()
        return () if k is None else tuple(k.kquant_routes())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(self.dtype)
        k = self.kernel_module() if x2.is_cpu and self._route_id >= 0 else None
        if k is not None:
            y = k.kquant_linear(x2, self.blocks, int(self.qtype), self._route_id, self.bias)
        else:
            y = F.linear(x2, self.dequantize().to(self.dtype), self.bias)
        return y.reshape(*shape[:-1], self.out_features)

    def gguf_blocks(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """(N, row bytes) rows as the GGUF file stores them (all, or `rows` (T,))."""
        b = self.blocks if rows is None else self.blocks.index_select(0, rows)
        return q50_from_planar(b) if self.qtype == Q.Q5_0 else b

    def dequantize(self) -> torch.Tensor:
        """The weight the layer stands for, (N, K) float32."""
        return dequantize(self.gguf_blocks(), self.qtype, (self.out_features, self.in_features), torch.float32)

    def dequantize_rows(self, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `rows` (T,) of the weight, (T, K) in `dtype`: only their blocks are decoded."""
        picked = self.gguf_blocks(rows.reshape(-1))
        return dequantize(picked, self.qtype, (picked.shape[0], self.in_features), dtype)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """float32 oracle: the dequantized weight in F.linear."""
        return F.linear(x.float(), self.dequantize(), None if self.bias is None else self.bias.float())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, type={self.qtype.name}"
