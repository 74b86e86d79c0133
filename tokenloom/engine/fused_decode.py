"""FusedDecoder: a pure decode step of the model in one C++ call (kernels/csrc/decode_stack.cpp for the Llama
family, kernels/csrc/gemma_stack.cpp for Gemma 3 / Gemma 2).

A decode step of a small model pays more for calling its kernels than for running them: ~12 kernels
per layer (~20 for Gemma), each reached through nn.Module and pybind. The C++ decode stack holds the model's
weights and KV cache tensors (shared, not copied) and calls the same kernels in the same order, so its hidden
states equal the Python model's bit for bit (tests/test_decode_stack.py, tests/test_gemma_stack.py). It serves
only steps whose every row is a decode row (plan.all_decode), on CPU, for bfloat16 models whose linears are
bfloat16 `Linear`, the C++ `QuantLinear` or `KQuantLinear` (GGUF K-quants), or a `PartsLinear` of those.
- Llama family (C++ DecodeStack): no q/k norm (Qwen3), no partial rotary (Phi-4-mini), no mixture of experts
  (Mixtral, Qwen2/3-MoE), and one window for every layer: a model mixing sliding and full layers (several KV
  groups, engine/kv_cache.py) stays on the Python model; an all-windowed one (Mistral) runs here, its kernel
  reading only the last `window` positions, never the released blocks before them
  (tests/test_sliding_window.py). LongRoPE needs nothing of it: cos/sin come from the model's table.
- Gemma (C++ GemmaDecodeStack): its four (1 + w) norms a layer, q/k norms, GeGLU, a RoPE table and a window per layer
  kind, and a KV group per layer, each group's slots and block tables passed to the stack; Gemma 2's
  attention soft-capping too.
Everything else stays on the Python model.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

import torch

from tokenloom.attention.base import AttentionBackend, AttentionMetadata
from tokenloom.attention.paged_kv import LayerKVCache
from tokenloom.attention.sdpa import DecodePlan
from tokenloom.models.gemma import Gemma3ForCausalLM
from tokenloom.models.layers import Linear
from tokenloom.models.llama import LlamaForCausalLM
from tokenloom.quant.kquant import KQuantLinear
from tokenloom.quant.linear import QuantLinear
from tokenloom.quant.parts import PartsLinear

log = logging.getLogger("tokenloom.engine")

CausalLM = LlamaForCausalLM | Gemma3ForCausalLM


class FusedDecoder:
    """The decode step of `model` through its family's C++ stack; `forward` returns what model(...) would."""

    def __init__(self, kernels: ModuleType, model: CausalLM, kv_caches: list[LayerKVCache],
                 backend: AttentionBackend) -> None:
        self.model, self.backend = model, backend
        self.gemma = isinstance(model, Gemma3ForCausalLM)
        self.stack = _gemma_stack(kernels, model, kv_caches) if self.gemma else _llama_stack(kernels, model, kv_caches)

    @staticmethod
    def supports(kernels: ModuleType | None, model: CausalLM, device: torch.device) -> str | None:
        """Why the stack cannot serve this model (None: it can)."""
        if device.type != "cpu" or kernels is None or not hasattr(kernels, "DecodeStack"):
            return "no CPU kernels"
        if not kernels.skinny_available():
            return "the CPU lacks AVX512-BF16"
        cfg = model.config
        if cfg.family == "gemma":
            if not hasattr(kernels, "GemmaDecodeStack") or not isinstance(model, Gemma3ForCausalLM):
                return f"{cfg.architecture}: no Gemma decode stack in these kernels"
        else:
            if cfg.num_experts:
                return f"{cfg.architecture} routes tokens to experts (mixture of experts), which the C++ stack does not"
            if cfg.qk_norm:
                return f"{cfg.architecture} normalizes q and k per head, which the C++ stack does not"
            if len({cfg.layer_window(i) for i in range(cfg.num_hidden_layers)}) > 1:
                return (f"{cfg.architecture} mixes sliding-window and full-attention layers (one block "
                        "table and window per layer group), which the C++ stack does not")
        if cfg.rotary_dim != cfg.head_dim:
            return (f"{cfg.architecture} rotates {cfg.rotary_dim} of {cfg.head_dim} "
                    "head dims (partial rotary), which the C++ stack does not")
        if model.norm.weight.dtype != torch.bfloat16:
            return f"model dtype {model.norm.weight.dtype} (bfloat16 only)"
        for name, m in model.named_modules():
            if name.endswith("_proj") and not _served(m):
                return f"layer {name} ({type(m).__name__}) has no C++ kernel"
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """(T,) tokens of an all-decode step -> (T, hidden) final hidden states, as model(...) returns."""
        t = input_ids.shape[0]
        if not self.gemma:
            plan: DecodePlan = meta.plan
            x = self.model.embed_tokens(input_ids)
            cos, sin = self.model.rotary.lookup(positions, x.dtype)  # (T, 1, D) each
            return self.stack.forward(x, cos.view(t, -1), sin.view(t, -1), meta.slot_mapping, plan.decode_blocks,
                                      plan.decode_lens)
        x = self.model.embed(input_ids)
        (cos_g, sin_g), (cos_l, sin_l) = self.model.rope(positions, x.dtype)  # (T, 1, D) each
        # Each KV group's slots and decode plan (its block tables); the windows only shape prefill masks.
        metas = [meta, *meta.group_metas]
        plans = [m.plan_for(self.backend, x.device, self.model.config.sliding_window) for m in metas]
        return self.stack.forward(x, cos_g.view(t, -1), sin_g.view(t, -1), cos_l.view(t, -1), sin_l.view(t, -1),
                                  [m.slot_mapping for m in metas], [p.decode_blocks for p in plans],
                                  [p.decode_lens for p in plans])


def _llama_stack(kernels: ModuleType, model: LlamaForCausalLM, kv_caches: list[LayerKVCache]) -> Any:
    cfg, attn = model.config, model.layers[0].self_attn
    stack = kernels.DecodeStack(
        num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, eps=cfg.rms_norm_eps,
        scale=attn.scale, sliding_window=cfg.sliding_window or 0, final_norm=model.norm.weight,
    )
    for layer, kv in zip(model.layers, kv_caches):
        a, mlp = layer.self_attn, layer.mlp
        lin = [_fused_linear(kernels, m) for m in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        stack.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, *lin,
                        kv.k, kv.v, kv.k_scale, kv.v_scale)
    return stack


def _gemma_stack(kernels: ModuleType, model: Gemma3ForCausalLM, kv_caches: list[LayerKVCache]) -> Any:
    """The C++ GemmaDecodeStack over `model`'s tensors: the norms' float32 (1 + w), built here as the Python
    norms build theirs (GemmaRMSNorm.refresh_scale), so both paths scale by the same values."""
    cfg, attn = model.config, model.layers[0].self_attn

    def scale(norm: Any) -> torch.Tensor:
        if norm._scale is None:
            norm.refresh_scale()
        return norm._scale

    stack = kernels.GemmaDecodeStack(
        num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, eps=cfg.rms_norm_eps,
        scale=attn.scale, softcap=attn.softcap or 0.0, final_norm=scale(model.norm),
    )
    for layer, kv in zip(model.layers, kv_caches):
        a, mlp = layer.self_attn, layer.mlp
        stack.add_layer(
            scale(layer.input_layernorm), scale(layer.post_attention_layernorm), scale(layer.pre_feedforward_layernorm),
            scale(layer.post_feedforward_layernorm), None if a.q_norm is None else scale(a.q_norm),
            None if a.k_norm is None else scale(a.k_norm),
            *[_fused_linear(kernels, m) for m in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)],
            kv.k, kv.v, kv.k_scale, kv.v_scale, a.sliding_window or 0, layer.local, kv.group,
        )
    return stack


def _served(m: torch.nn.Module) -> bool:
    """Whether a FusedLinear can run `m` as its forward does (with the same kernel and route)."""
    if isinstance(m, PartsLinear):
        return all(_served(p) for p in m.parts)
    if isinstance(m, (QuantLinear, KQuantLinear)):
        return m.kernel_module() is not None and m._route_id >= 0
    return type(m) is Linear and m.weight.dtype == torch.bfloat16 and m.weight.is_contiguous()


def _fused_linear(kernels: ModuleType, m: torch.nn.Module) -> Any:  # a kernels.FusedLinear
    if isinstance(m, PartsLinear):
        return kernels.FusedLinear.concat([_fused_linear(kernels, p) for p in m.parts])
    if isinstance(m, KQuantLinear):
        return kernels.FusedLinear.kquant(m.blocks, int(m.qtype), m._route_id, m.bias)
    if isinstance(m, QuantLinear):
        return kernels.FusedLinear(m.codes, m.scales, m.mins, m.bias, m.bits, route=m._route_id)
    return kernels.FusedLinear(m.weight, None, None, m.bias, 16, m.packed)


def build_fused_decoder(kernels: ModuleType | None, model: CausalLM, kv_caches: list[LayerKVCache],
                        device: torch.device, backend: AttentionBackend) -> FusedDecoder | None:
    """The fused decoder for this model, or None (logged) when the Python path must serve decode too."""
    why = FusedDecoder.supports(kernels, model, device)
    if why is None and not isinstance(model, Gemma3ForCausalLM) and any(kv.group for kv in kv_caches):
        why = "the KV cache has several layer groups, each with its own block tables"
    if why is not None or kernels is None:
        log.info("fused decode step off: %s", why)
        return None
    return FusedDecoder(kernels, model, kv_caches, backend)
