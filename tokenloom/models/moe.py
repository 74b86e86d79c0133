"""A sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks k of E SwiGLU experts per token.

    logits = gate(x)                          (T, E)
    weights, experts = route(logits)          (T, k) float32, (T, k) int64
    y[t] = sum_j weights[t, j] * expert_{experts[t, j]}(x[t])
         (+ sigmoid(shared_expert_gate(x[t])) * shared_expert(x[t])    Qwen2-MoE: a shared expert for every token)

Routing, by family (`ModelConfig.router`):
- "topk_softmax" (Mixtral): the k largest logits, softmax over those k.
- "softmax_topk" (Qwen2-MoE, Qwen3-MoE): softmax over all E, the k largest probabilities, renormalised to sum to 1 when
  `norm_topk_prob` (mathematically Mixtral's rule then; without it the k weights sum to less than 1).

The experts are stored stacked: `experts_gate_up` (E, 2I, H) with gate rows before up rows, `experts_down`
(E, H, I), in the model dtype. The batched path (`forward`) sorts the (T, k) assignments by expert and runs
one gate_up and one down matmul per ACTIVE expert over the rows routed to it, so a decode step reads only the
k experts its token chose: on CPU, where decode is bound by weight reads, that is what makes a MoE model as
fast as a dense model of its active size. `reference` (per token, float32) is its test oracle.

A GGUF's expert stacks can stay quantized instead (models/gguf_kept.py): `set_experts` installs a QuantExperts,
one quantized gate_up layer (n, H) -> (n, 2I) and down layer (n, I) -> (n, H) per expert, and drops the float
stacks; the batched path then runs each active expert's quantized layers on its rows (its blocks read once per
step), and the reference reads their float32 dequantization.
"""

from __future__ import annotations

import re
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.errors import ModelLoadError
from tokenloom.kernels.limits import SKINNY_MAX_ROWS
from tokenloom.models.config import ModelConfig
from tokenloom.models.layers import Linear, SwiGLU

# Checkpoint tensor names under a layer's MoE block (after "layers.N.block_sparse_moe." / "layers.N.mlp."):
# per expert (what hub checkpoints and transformers' save_pretrained hold), or stacked: gate_up_proj (E, 2I, H)
# and down_proj (E, H, I) as transformers holds them in memory, or gate_proj / up_proj (E, I, H) each, as
# models/gguf.py names a GGUF's ffn_{gate,up,down}_exps.
_PER_EXPERT = re.compile(r"experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
_HALF = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1}  # which half of gate_up; w2 / down_proj go to down
# Up to this many rows per expert the C++ skinny kernel beats F.linear on an expert's weight: measured on the
# 2-core EPYC (Zen 4, AVX512-BF16), one thread, a (28672, 4096) bf16 weight: 1 row 9.8 vs 19.4 ms, 3 rows 15.4
# vs 17.8, 4 rows 25.5 vs 18.3 (benchmarks/moe.py times the whole block). Linear's own limit (SKINNY_MAX_ROWS)
# assumes a prepacked copy takes the other row counts; expert slices have none.
_SKINNY_EXPERT_ROWS = min(3, SKINNY_MAX_ROWS)
_SHARED = re.compile(r"shared_expert\.(gate_proj|up_proj|down_proj)\.weight")


class QuantExperts(nn.Module):
    """Each expert's quantized layers (Int8Linear, Int4Linear, KQuantLinear or a PartsLinear of them): gate_up[e]
    (n, H) -> (n, 2I) with gate's outputs first, down[e] (n, I) -> (n, H); each has `dequantize()` (float32)."""

    def __init__(self, gate_up: list[nn.Module], down: list[nn.Module]) -> None:
        super().__init__()
        if not gate_up or len(gate_up) != len(down):
            raise ModelLoadError(f"quantized experts: {len(gate_up)} gate/up layers and {len(down)} down layers")
        self.gate_up, self.down = nn.ModuleList(gate_up), nn.ModuleList(down)


def _float_weight(layer: nn.Module) -> torch.Tensor:
    """A float or quantized layer's (N, K) weight in float32 on the CPU."""
    return layer.weight.float().cpu() if isinstance(layer, nn.Linear) else layer.dequantize()


def route(logits: torch.Tensor, k: int, router: str, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) router logits -> (T, k) float32 weights and (T, k) int64 expert ids, for all tokens at once."""
    if router == "topk_softmax":
        top, experts = torch.topk(logits.float(), k, dim=-1)
        return torch.softmax(top, dim=-1), experts
    weights, experts = torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class SparseMoE(nn.Module):
    """The MoE MLP of one decoder layer: (T, H) -> (T, H)."""

    kernels: ModuleType | None = None  # the C++ kernels when set (CPU): silu_and_mul, few-row skinny_linear

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts, self.top_k, self.intermediate_size = e, cfg.num_experts_per_tok, i
        self.router, self.norm_topk_prob = cfg.router, cfg.norm_topk_prob
        self.gate = Linear(h, e, bias=False)  # the router: (T, H) -> (T, E) logits
        self.experts_gate_up = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.experts_down = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        self.experts: QuantExperts | None = None  # set_experts: quantized experts in place of the two stacks
        s = cfg.shared_expert_intermediate_size
        self.shared_expert = SwiGLU(h, s, bias=False) if s else None
        self.shared_expert_gate = Linear(h, 1, bias=False) if s else None  # (T, H) -> (T, 1), through a sigmoid

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The batched path: tokens grouped by expert, one pair of matmuls per active expert."""
        t, k = x.shape[0], self.top_k
        weights, experts = route(self.gate(x), k, self.router, self.norm_topk_prob)  # (T, k) each
        flat = experts.flatten()  # (T*k,) assignment a = token a // k, its (a % k)-th choice
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert, tokens ascending within
        tokens = order // k  # (T*k,) the token of each sorted assignment
        # One host sync for the group sizes; the loop below runs over experts, never over tokens.
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        xs = x[tokens]  # (T*k, H) each token's row once per expert it chose, grouped by expert
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:
                ys[start:start + n] = self._expert(xs[start:start + n], e)
                start += n
        # Weighted rows summed into their tokens in float32, so a bfloat16 model rounds each token's sum once.
        ys = ys.float() * weights.flatten()[order].unsqueeze(1)
        out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, tokens, ys)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out += (torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)).float()
        return out.to(x.dtype)

    def set_experts(self, experts: QuantExperts) -> None:
        """Run on quantized experts: `experts` replaces the float stacks, which are dropped (never allocated
        when called on the meta-device model before loading)."""
        if len(experts.gate_up) != self.num_experts:
            raise ModelLoadError(f"{len(experts.gate_up)} quantized experts for a {self.num_experts}-expert block")
        self.experts_gate_up, self.experts_down = None, None  # type: ignore[assignment]
        self.experts = experts

    def _expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """Expert `e`'s SwiGLU on its (n, H) rows -> (n, H); reads only this expert's weights."""
        q = self.experts
        gate_up = q.gate_up[e](x) if q is not None else self._linear(x, self.experts_gate_up[e])  # (n, 2I)
        if self.kernels is not None and gate_up.is_cpu:
            h = self.kernels.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            h = F.silu(gate) * up
        return q.down[e](h) if q is not None else self._linear(h, self.experts_down[e])

    def _expert_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (2I, H) gate_up and (H, I) down weights in float32 on the CPU (the reference's)."""
        if self.experts is not None:
            return self.experts.gate_up[e].dequantize(), self.experts.down[e].dequantize()
        return self.experts_gate_up[e].float().cpu(), self.experts_down[e].float().cpu()

    def _linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # A decode step's few rows per expert: the C++ kernel streams the expert's weight once (as Linear does).
        k = self.kernels
        if (k is not None and x.shape[0] <= _SKINNY_EXPERT_ROWS and x.dtype == torch.bfloat16 and x.is_cpu
                and w.dtype == torch.bfloat16 and k.skinny_available()):
            return k.skinny_linear(x.contiguous(), w, None)
        return F.linear(x, w)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The oracle: each token on its own, in float32, routed by the rule written out per token."""
        gate = self.gate.weight.float()
        out = torch.zeros(x.shape, dtype=torch.float32)
        for t in range(x.shape[0]):
            xt = x[t].float().cpu()
            logits = gate.cpu() @ xt  # (E,)
            if self.router == "topk_softmax":
                top, ids = torch.topk(logits, self.top_k)
                weights = torch.softmax(top, dim=0)
            else:
                weights, ids = torch.topk(torch.softmax(logits, dim=0), self.top_k)
                if self.norm_topk_prob:
                    weights = weights / weights.sum()
            for w, e in zip(weights.tolist(), ids.tolist()):
                w_gate_up, w_down = self._expert_weights(e)
                gate_up = w_gate_up @ xt  # (2I,)
                h = F.silu(gate_up[: self.intermediate_size]) * gate_up[self.intermediate_size :]
                out[t] += w * (w_down @ h)
            if self.shared_expert is not None and self.shared_expert_gate is not None:
                s = self.shared_expert.intermediate_size
                gate_up = _float_weight(self.shared_expert.gate_up_proj) @ xt  # (2S,)
                h = F.silu(gate_up[:s]) * gate_up[s:]
                shared = _float_weight(self.shared_expert.down_proj) @ h
                out[t] += torch.sigmoid(self.shared_expert_gate.weight.float().cpu() @ xt) * shared
        return out.to(device=x.device, dtype=x.dtype)

    # --- checkpoint loading ------------------------------------------------------------------------------

    def load_weight(self, name: str, tensor: torch.Tensor) -> list[str]:
        """Copy one checkpoint tensor named relative to the block ("gate.weight", "experts.3.w1.weight",
        "experts.gate_up_proj", ...) into place; returns the slots it filled (see `expected_slots`)."""
        e_count, inter = self.num_experts, self.intermediate_size
        if name.startswith("experts.") and self.experts is not None:
            raise ModelLoadError(f"expert tensor {name!r} for a block whose experts are already quantized")
        if name == "gate.weight":
            dest, slots = self.gate.weight.data, ["gate"]
        elif name in ("experts.gate_up_proj", "experts.gate_up_proj.weight"):  # (E, 2I, H), gate rows first
            dest, slots = self.experts_gate_up.data, [f"{s}:{e}" for e in range(e_count) for s in ("gate", "up")]
        elif name in ("experts.gate_proj.weight", "experts.up_proj.weight"):  # (E, I, H) each (GGUF's *_exps)
            half = 0 if name == "experts.gate_proj.weight" else 1
            dest = self.experts_gate_up.data.narrow(1, half * inter, inter)
            slots = [f"{('gate', 'up')[half]}:{e}" for e in range(e_count)]
        elif name in ("experts.down_proj", "experts.down_proj.weight"):  # (E, H, I)
            dest, slots = self.experts_down.data, [f"down:{e}" for e in range(e_count)]
        elif name == "shared_expert_gate.weight" and self.shared_expert_gate is not None:
            dest, slots = self.shared_expert_gate.weight.data, ["shared_gate"]
            tensor = tensor.reshape(dest.shape) if tensor.numel() == dest.numel() else tensor  # GGUF: (H,)
        elif (m := _SHARED.fullmatch(name)) is not None and self.shared_expert is not None:
            s, part = self.shared_expert.intermediate_size, m.group(1)
            if part == "down_proj":
                dest = self.shared_expert.down_proj.weight.data
            else:
                dest = self.shared_expert.gate_up_proj.weight.data.narrow(0, 0 if part == "gate_proj" else s, s)
            slots = [f"shared:{part}"]
        elif (m := _PER_EXPERT.fullmatch(name)) is not None:
            e, part = int(m.group(1)), m.group(2)
            if e >= e_count:
                raise ModelLoadError(f"expert tensor {name!r}: expert {e} of a {e_count}-expert block")
            if part in _HALF:
                dest = self.experts_gate_up.data[e].narrow(0, _HALF[part] * inter, inter)
                slots = [f"{('gate', 'up')[_HALF[part]]}:{e}"]
            else:
                dest, slots = self.experts_down.data[e], [f"down:{e}"]
        else:
            raise ModelLoadError(f"unexpected tensor {name!r} in a mixture-of-experts block")
        if dest.shape != tensor.shape:
            raise ModelLoadError(f"tensor {name!r}: shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        dest.copy_(tensor)
        return slots

    def expected_slots(self) -> set[str]:
        """Every slot `load_weight` must fill: the router, each expert's gate, up and down (unless quantized experts
        are installed), the shared expert's."""
        shared: set[str] = set()
        if self.shared_expert is not None:  # its float layers (a quantized checkpoint stores its layers quantized)
            shared.add("shared_gate")
            if isinstance(self.shared_expert.gate_up_proj, nn.Linear):
                shared |= {"shared:gate_proj", "shared:up_proj"}
            if isinstance(self.shared_expert.down_proj, nn.Linear):
                shared.add("shared:down_proj")
        experts = ({f"{s}:{e}" for e in range(self.num_experts) for s in ("gate", "up", "down")}
                   if self.experts is None else set())
        return {"gate"} | shared | experts
