"""Weight-only quantized linear layers, swapped in for every decoder Linear at load time.

- INT8: symmetric, one scale per output channel: w ~= q * s, q in [-127, 127].
- INT4: asymmetric, one (scale, zero) pair per group of `group_size` input channels:
  w ~= (q - 8) * s + z with q in [0, 15], z = min + 8 s (the layout torch's int4 kernel expects).
The matmuls are torch's packed weight-only CPU kernels (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`): activations stay in bfloat16, weights are expanded inside the kernel,
never to a full bf16 matrix in memory. `reference()` dequantizes to float32 and calls F.linear: the
test oracle.
The LM head is quantized too (a decode step reads it whole: 56 of SmolLM2's 270 MB); when it is tied
to the embeddings, the embedding table stays in the model dtype for the lookup and the head gets its
own quantized copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.errors import ConfigError

QUANTIZATIONS = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)


def quantize_int8(w: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (N, K) int8 and (N,) scales, rounded to `scale_dtype` before the codes are
    computed, so the codes fit the scales the kernel will use."""
    scale = (w.float().abs().amax(dim=1).clamp_min(1e-12) / 127.0).to(scale_dtype).float()
    q = torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4(w: torch.Tensor, group_size: int, scale_dtype: torch.dtype = torch.float32
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) float -> (N, K) int32 codes in [0, 15], (N, K/g) scales, (N, K/g) zeros; scales and
    zeros rounded to `scale_dtype` first and the codes fitted to the rounded values."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group_size, group_size)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    scale = ((hi - lo).clamp_min(1e-12) / 15.0).to(scale_dtype).float()
    zero = (lo + 8.0 * scale).to(scale_dtype).float()
    lo = zero - 8.0 * scale  # what the kernel will reconstruct for code 0
    q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    return q, scale, zero


def int4_group_size(k: int, wanted: int) -> int:
    """`wanted` if it divides the layer's input size, else the largest supported size that does
    (SmolLM2's hidden size 576 is not a multiple of 128: its layers use 64)."""
    if k % wanted == 0:
        return wanted
    for g in sorted(INT4_GROUP_SIZES, reverse=True):
        if g < wanted and k % g == 0:
            return g
    raise ConfigError(f"no INT4 group size in {INT4_GROUP_SIZES} divides the input size {k}")


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        q, scale = quantize_int8(linear.weight.data, linear.weight.dtype)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype
        self.register_buffer("qweight", q)  # (N, K) int8
        self.register_buffer("scales", scale.to(self.dtype))  # (N,)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.data.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(self.dtype).contiguous()
        y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)  # (M, N)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The weight the layer stands for, in float32."""
        return self.qweight.float() * self.scales.float()[:, None]

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """float32 oracle: the dequantized weight in F.linear."""
        return F.linear(x.float(), self.dequantize(), None if self.bias is None else self.bias.float())


class Int4Linear(nn.Module):
    def __init__(self, linear: nn.Linear, group_size: int) -> None:
        super().__init__()
        w = linear.weight.data
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group_size = int4_group_size(self.in_features, group_size)
        self.dtype = w.dtype
        q, scale, zero = quantize_int4(w, self.group_size, w.dtype)
        # (K/g, N, 2): the kernel's scales-and-zeros layout.
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(self.dtype)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2))  # (N, K/2) uint8
        self.register_buffer("scales_and_zeros", sz)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.data.clone())
        self._q_for_reference = q.to(torch.uint8)  # 1 byte per weight, for tests (dropped by compact())

    def compact(self) -> None:
        """Drop the unpacked codes kept for `reference` (the engine calls it; tests do not)."""
        self._q_for_reference = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(self.dtype).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        if self._q_for_reference is None:
            raise RuntimeError("compacted Int4Linear keeps only the packed weights")
        n, k, g = self.out_features, self.in_features, self.group_size
        sz = self.scales_and_zeros.float().transpose(0, 1)  # (N, K/g, 2)
        q = self._q_for_reference.float().reshape(n, k // g, g)
        return ((q - 8.0) * sz[..., :1] + sz[..., 1:]).reshape(n, k)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """float32 oracle: the dequantized weight in F.linear."""
        return F.linear(x.float(), self.dequantize(), None if self.bias is None else self.bias.float())


def quantize_model(model: nn.Module, method: str, group_size: int = 128) -> int:
    """Swap every Linear of the decoder layers and the LM head for its quantized twin; returns how many."""
    if method not in QUANTIZATIONS:
        raise ConfigError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {method!r}")
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ConfigError("quantization needs a model with decoder `layers`")
    targets = [(parent, name, child) for layer in layers for parent in layer.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear):
        targets.append((model, "lm_head", head))
    for parent, name, child in targets:
        if child.weight.device.type != "cpu":
            raise ConfigError("weight-only quantization kernels are CPU-only in tokenloom for now")
        if child.weight.dtype != torch.bfloat16:
            raise ConfigError(f"--quantization {method} needs --dtype bfloat16, not {child.weight.dtype}")
        # torch's int4 packing needs N % 16 == 0 and a group size dividing K; a layer that has
        # neither (an odd vocabulary size in the head, say) is quantized to int8 instead.
        int4 = method == "int4" and child.out_features % 16 == 0 and any(
            child.in_features % g == 0 for g in INT4_GROUP_SIZES)
        new = Int4Linear(child, group_size) if int4 else Int8Linear(child)
        if isinstance(new, Int4Linear):
            new.compact()
        setattr(parent, name, new)
    return len(targets)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights: its state dict (parameters and the quantized layers' buffers, not
    the RoPE cos/sin cache), tied tensors counted once."""
    seen: set[int] = set()
    total = 0
    for t in model.state_dict().values():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total
