"""Roofline lines for `tokenloom bench offline`: how close each phase runs to what this machine can do.

A phase (single-stream decode, batched decode, prefill) is bounded by two ceilings: the matmul FLOP rate
(measured here as the best of a few large bf16 GEMMs, and int8 GEMMs where torch has them) and the memory
bandwidth (a large copy's bytes read + written per second). For each phase we count, per output token,
- matmul FLOPs: 2 x the model's linear weights (in x out) per computed token, plus 2 x hidden x vocab for
  each row that samples (the LM head runs only on those); attention's own arithmetic is not counted (it is
  small beside the weights at these context lengths, and grows with the context in prefill);
- bytes moved: the weights once per step (shared by every row of the step) plus each row's K/V context
  (layers x 2 x kv_heads x head_dim x the cache's element size, per token of context);
and divide the measured rate by the ceilings. A fraction near 1 of one ceiling says that ceiling is the
limit; both far below 1 says time goes elsewhere (Python, attention's own arithmetic, thread barriers).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class MachinePeaks:
    bf16_gflops: float  # the best large bf16 GEMM rate
    int8_gops: float | None  # the best large int8 GEMM rate (torch._int_mm), None where torch lacks it
    copy_gbs: float  # bytes read + written per second by a large copy

    def describe(self) -> str:
        int8 = f"{self.int8_gops:.0f} GOP/s int8" if self.int8_gops else "no int8 GEMM in this torch"
        return (f"machine ceilings: {self.bf16_gflops:.0f} GFLOP/s bf16 GEMM, {int8}, "
                f"{self.copy_gbs:.1f} GB/s copy bandwidth")


def _best_rate(fn: Callable[[], object], ops: float, device: torch.device, repeats: int = 5) -> float:
    fn()  # the first call builds the kernel
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return ops / best / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_peaks(copy_gbs: float, device: torch.device | None = None, size: int | None = None) -> MachinePeaks:
    """GEMM peaks from (size x size) @ (size x size) products on `device` (CPU: 1024, enough for 2 cores;
    CUDA: 8192, enough to fill a GPU); `copy_gbs` from bench/offline.py's copy on the same device."""
    device = device or torch.device("cpu")
    size = size or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(size, size, device=device).bfloat16()
    b = torch.randn(size, size, device=device).bfloat16()
    flops = 2.0 * size**3
    bf16 = _best_rate(lambda: torch.mm(a, b), flops, device)
    int8: float | None
    try:
        ai = torch.randint(-127, 127, (size, size), dtype=torch.int8, device=device)
        bi = torch.randint(-127, 127, (size, size), dtype=torch.int8, device=device)
        int8 = _best_rate(lambda: torch._int_mm(ai, bi), flops, device)
    except (RuntimeError, AttributeError, NotImplementedError):
        int8 = None
    return MachinePeaks(bf16, int8, copy_gbs)


@dataclass(frozen=True)
class ModelCosts:
    linear_flops_per_token: float  # 2 x sum(in x out) over every linear but the LM head
    lm_head_flops_per_row: float  # 2 x hidden x vocab
    weight_bytes: int  # what one step reads of the weights (shared by all its rows)
    kv_bytes_per_context_token: int  # what one row reads of the cache per token of its context

    @classmethod
    def of(cls, model: nn.Module, weight_bytes: int, kv_bytes_per_token: int) -> "ModelCosts":
        linear = 0.0
        head = 0.0
        for name, m in model.named_modules():
            # Leaf matmul layers: dense Linear, every quantized kind (a fused layer of parts counts its parts).
            if hasattr(m, "in_features") and hasattr(m, "out_features") and not any(True for _ in m.children()):
                flops = 2.0 * m.in_features * m.out_features
                if name.endswith("lm_head"):
                    head += flops
                else:
                    linear += flops
        return cls(linear, head, weight_bytes, kv_bytes_per_token)


@dataclass(frozen=True)
class Phase:
    """One measured phase: `tok_s` output (or prompt) tokens per second with `rows` rows per step, each row
    computing `tokens_per_row` tokens of which one samples (prefill: the chunk, sampling once at its end),
    over `context` tokens of K/V on average."""

    name: str
    tok_s: float
    rows: int
    tokens_per_row: int
    context: float

    def line(self, costs: ModelCosts, peaks: MachinePeaks, quantized: bool) -> str:
        steps_s = self.tok_s / (self.rows * self.tokens_per_row)
        flops_per_step = self.rows * (self.tokens_per_row * costs.linear_flops_per_token + costs.lm_head_flops_per_row)
        gflops = flops_per_step * steps_s / 1e9
        bytes_per_step = costs.weight_bytes + self.rows * self.context * costs.kv_bytes_per_context_token
        gbs = bytes_per_step * steps_s / 1e9
        # Quantized weights with int8 activations run on the int8 units; bf16 compares with the bf16 GEMM.
        peak, unit = ((peaks.int8_gops, "int8") if quantized and peaks.int8_gops else (peaks.bf16_gflops, "bf16"))
        return (f"roofline {self.name}: matmul {gflops:.1f} GFLOP/s = {gflops / peak:.0%} of the {unit} GEMM peak; "
                f"weights + K/V {gbs:.1f} GB/s = {gbs / peaks.copy_gbs:.0%} of copy bandwidth")
