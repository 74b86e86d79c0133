"""Layers shared by the model families: Linear, RMSNorm, rotary embedding (with scaling), SwiGLU MLP, and the
packing of a checkpoint's q/k/v and gate/up tensors into the fused qkv_proj / gate_up_proj parameters."""

from __future__ import annotations

import math
from collections.abc import Iterable
from types import ModuleType
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.errors import ModelLoadError
from tokenloom.kernels.limits import PACKED_MAX_ROWS, SKINNY_MAX_ROWS
from tokenloom.models.config import RopeScaling

# SKINNY_MAX_ROWS: the C++ few-row matmul serves 1..SKINNY_MAX_ROWS rows (decode, verification).
# PACKED_MAX_ROWS: prepacked weights serve 2..PACKED_MAX_ROWS rows; bigger prefill chunks go to F.linear
# (see docs/performance-notes.md#prepacked-weights). Both shared with the C++ kernels via kernels/limits.py.


def prepack_available() -> bool:
    """Whether this torch build can hold bfloat16 weights in oneDNN's blocked layout (x86 with AVX512-BF16
    or AMX; the ops live in torch's CPU library, no compiler needed)."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class Linear(nn.Linear):
    """nn.Linear with two CPU fast paths for bfloat16 beside F.linear (their reference):

    - `packed`: the weight reordered once, at load, into oneDNN's blocked layout (`prepack`), for 2 to
      PACKED_MAX_ROWS rows: batched decode and speculative verification. F.linear hands oneDNN a plain
      weight that it reorders on every call; at 64 rows that reorder costs about half as much as the
      (AMX) matmul itself. On the machines measured the packed matmul gives F.linear's values bit for bit
      at these row counts (oneDNN does not promise it; tests/test_prepack.py checks them to bf16 rounding).
    - `kernels.skinny_linear`: the C++ kernel that streams the weight once, for one row (single-stream
      decode) and, up to `skinny_rows_packed` rows (measured per CPU: models/dense_routing.py) or when there
      is no packed copy, for up to SKINNY_MAX_ROWS rows.
    Prefill chunks of more rows go to F.linear. engine/fused_decode.py's C++ FusedLinear makes the same
    choice from the same tensors.
    """

    kernels: ModuleType | None = None  # set only when the kernel has its AVX512-BF16 fast path
    packed: torch.Tensor | None = None  # oneDNN-blocked copy of `weight` (an opaque mkldnn tensor)
    # Rows up to which the skinny kernel serves a layer that has a packed copy too: process-wide, measured
    # per CPU at start-up (models/dense_routing.py, which sets the C++ stack's copy of it alongside).
    skinny_rows_packed: ClassVar[int] = 1

    def prepack(self, rows_hint: int) -> int:
        """Keep a oneDNN-blocked copy of the (frozen) bfloat16 weight; returns its bytes. `rows_hint` is the
        typical number of rows, from which oneDNN picks the blocking."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), rows_hint)
        return self.weight.numel() * self.weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else 0
        k = self.kernels
        if (k is not None and 0 < rows <= (Linear.skinny_rows_packed if self.packed is not None else SKINNY_MAX_ROWS)
                and x.dtype == torch.bfloat16 and x.is_cpu and self.weight.dtype == torch.bfloat16
                and self.weight.is_contiguous()):
            return k.skinny_linear(x, self.weight, self.bias)
        if self.packed is not None and 2 <= rows <= PACKED_MAX_ROWS and x.dtype == torch.bfloat16:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def prepackable(model: nn.Module) -> list[Linear]:
    """The layers --prepack-weights packs (engine/engine.py, once the weights are final): dense bfloat16
    `Linear`s on CPU (quantized layers have their own kernels) that have no packed copy yet."""
    return [m for m in model.modules()
            if type(m) is Linear and m.weight.dtype == torch.bfloat16 and m.weight.is_cpu and m.packed is None]


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, weight applied in the input dtype (as transformers' LlamaRMSNorm)."""

    kernels: ModuleType | None = None  # the fused C++ kernel when set (CPU); else the torch reference

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, new_residual). With `residual`, adds it first (the fused add+norm of a block)."""
        if self.kernels is not None and x.is_cpu:
            return self.kernels.add_rms_norm(x.contiguous(), residual, self.weight, self.eps)
        return self.reference(x, residual)

    def reference(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype), x


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling, max_position: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (head_dim/2,) and the cos/sin multiplier, as transformers computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = scaling.kind
    if kind in ("default", "dynamic"):
        # Dynamic NTK equals the default inside max_position_embeddings, the only range we serve for it.
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling.factor, 1.0
    if kind == "llama3":
        factor, lo, hi = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
        old_len = scaling.original_max_position_embeddings or max_position
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / hi) * ~(wavelen > old_len / lo)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling, max_position)
    if kind == "longrope":  # the short factors; RotaryEmbedding switches to the long ones past the original length
        return _longrope_inv_freq(head_dim, theta, scaling.short_factor), float(scaling.attention_factor or 1.0)
    raise ValueError(f"unknown rope scaling kind {kind!r}")


def _longrope_inv_freq(head_dim: int, theta: float, factors: tuple[float, ...]) -> torch.Tensor:
    """1 / (factor * theta^(2i/d)), as transformers' `_compute_longrope_parameters` (float32)."""
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**shape)


def _yarn_inv_freq(head_dim: int, theta: float, s: RopeScaling, max_position: int) -> tuple[torch.Tensor, float]:
    orig = s.original_max_position_embeddings or max_position
    factor = s.factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.attention_factor is not None:
        attn = float(s.attention_factor)
    elif s.mscale and s.mscale_all_dim:
        attn = mscale(factor, s.mscale) / mscale(factor, s.mscale_all_dim)
    else:
        attn = mscale(factor)

    def corr_dim(rot: float) -> float:
        return (head_dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

    low = max(math.floor(corr_dim(s.beta_fast)), 0)
    high = min(math.ceil(corr_dim(s.beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extra_factor = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extra_factor) + (1.0 / pos_freqs) * extra_factor
    return inv_freq, attn


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE with a precomputed cos/sin table indexed by position.

    `head_dim` here is the rotary dim (the table's width): partial rotary tables are narrower than the heads.
    LongRoPE: positions below original_max_position_embeddings use the short factors, positions from it on the
    long ones. That is what transformers' generate does for a prompt of at most original_max_position_embeddings
    tokens (it picks the set per forward by max(position) + 1, so decode steps past the original length use the
    long set while the cached keys keep the short one). A prompt longer than that differs: transformers re-ropes
    the whole prompt with the long factors, while here its first original_max positions keep the short ones.
    """

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling, max_position: int) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling, self.max_position = head_dim, theta, scaling, max_position
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.materialize(torch.empty(0).device)

    def materialize(self, device: torch.device) -> None:
        """(Re)compute the float32 tables on `device`: models are built on the meta device, then filled."""
        with torch.device("cpu"):  # also when called inside a `torch.device("meta")` context
            inv_freq, attn_factor = rope_inv_freq(self.head_dim, self.theta, self.scaling, self.max_position)
            t = torch.arange(self.max_position, dtype=torch.float32)
            freqs = torch.outer(t, inv_freq)  # (max_position, head_dim/2)
            if self.scaling.kind == "longrope":
                orig = int(self.scaling.original_max_position_embeddings or self.max_position)
                long_inv = _longrope_inv_freq(self.head_dim, self.theta, self.scaling.long_factor)
                freqs[orig:] = torch.outer(t[orig:], long_inv)
            emb = torch.cat((freqs, freqs), dim=-1)  # (max_position, head_dim)
        self.cos = (emb.cos() * attn_factor).to(device)
        self.sin = (emb.sin() * attn_factor).to(device)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for each token, (T, 1, D) in `dtype`; computed once per step and shared by all layers."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], kernels: ModuleType | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    # q: (T, Hq, D), k: (T, Hkv, D), cos/sin: (T, 1, R) with R = D, or R < D for partial rotary
    cos, sin = cos_sin
    rot = cos.shape[-1]
    if rot < q.shape[-1]:  # partial rotary (Phi-4-mini): rotate the first R dims, pass the rest through
        q_rot, k_rot = q[..., :rot], k[..., :rot]
        return (torch.cat((q_rot * cos + _rotate_half(q_rot) * sin, q[..., rot:]), dim=-1),
                torch.cat((k_rot * cos + _rotate_half(k_rot) * sin, k[..., rot:]), dim=-1))
    if kernels is not None and q.is_cpu:
        # In place on the fused qkv projection's q and k views: no new tensors.
        kernels.rotary_inplace(q, k, cos.view(cos.shape[0], -1), sin.view(sin.shape[0], -1))
        return q, k
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul."""

    kernels: ModuleType | None = None  # the fused C++ silu_and_mul when set (CPU)

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.intermediate_size = intermediate_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (T, 2 * intermediate)
        if self.kernels is not None and gate_up.is_cpu:
            return self.down_proj(self.kernels.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


# --- packing checkpoint tensors into fused parameters ----------------------------------------------------------

Packing = dict[str, tuple[str, int, int]]  # checkpoint part ("q_proj") -> (fused parameter part, first row, rows)


def packing(q_size: int, kv_size: int, intermediate_size: int) -> Packing:
    """q/k/v rows stacked in qkv_proj (q first), gate/up rows in gate_up_proj (gate first)."""
    return {"q_proj": ("qkv_proj", 0, q_size), "k_proj": ("qkv_proj", q_size, kv_size),
            "v_proj": ("qkv_proj", q_size + kv_size, kv_size),
            "gate_proj": ("gate_up_proj", 0, intermediate_size),
            "up_proj": ("gate_up_proj", intermediate_size, intermediate_size)}


def load_packed(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor, pack: Packing) -> set[str]:
    """Copy one checkpoint tensor (named as the model's parameters, e.g. "layers.0.self_attn.k_proj.weight") into
    its parameter, or its rows of a fused one; returns the slots it filled ("<param>" or "<param>:<first row>").
    A fused tensor the checkpoint holds whole (Phi-3's qkv_proj, gate_up_proj) fills every slot of its parameter."""
    target, rows = name, None
    for part, (fused, start, size) in pack.items():
        if f".{part}." in name:
            target, rows = name.replace(part, fused), (start, size)
    if target not in params:
        raise ModelLoadError(f"unexpected tensor {name!r} in checkpoint")
    dest = params[target].data if rows is None else params[target].data.narrow(0, *rows)
    if dest.shape != tensor.shape:
        raise ModelLoadError(f"tensor {name!r}: shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
    dest.copy_(tensor)
    return {f"{target}:{rows[0]}"} if rows is not None else packed_slots(target, pack)


def packed_slots(param: str, pack: Packing) -> set[str]:
    """The slots a parameter has: one per part packed into it, else the parameter itself."""
    starts = [start for fused, start, _ in pack.values() if f".{fused}." in param]
    return {f"{param}:{s}" for s in starts} if starts else {param}


def expected_slots(params: Iterable[str], pack: Packing) -> set[str]:
    """Every slot of `params` a checkpoint must fill (see load_packed)."""
    return {slot for name in params for slot in packed_slots(name, pack)}
