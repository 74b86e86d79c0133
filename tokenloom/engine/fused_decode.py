"""FusedDecoder: a pure decode step of the model in one C++ call (kernels/csrc/decode_stack.cpp).

A decode step of a small model pays more for calling its kernels than for running them: ~12 kernels
per layer, each reached through nn.Module and pybind. The C++ decode stack holds the model's weights
and KV cache tensors (shared, not copied) and calls the same kernels in the same order, so its hidden
states equal the Python model's bit for bit (tests/test_decode_stack.py). It serves only steps whose
every row is a decode row (plan.all_decode), on CPU, for bfloat16 Llama-family models whose linears
are bfloat16 `Linear` or the C++ `QuantLinear` and that have no q/k norm (Qwen3), no partial rotary
(Phi-4-mini) and no mixture of experts (Mixtral, Qwen2/3-MoE); everything else stays on the Python model.
LongRoPE needs nothing of it: cos/sin come from the model's table. One window serves every layer: a model
mixing sliding and full layers (several KV groups, engine/kv_cache.py) stays on the Python model; an
all-windowed one (Mistral) runs here, its kernel reading only the last `window` positions, never the
released blocks before them (tests/test_sliding_window.py).
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

import torch

from tokenloom.attention.base import AttentionMetadata
from tokenloom.attention.paged_kv import LayerKVCache
from tokenloom.attention.sdpa import DecodePlan
from tokenloom.models.layers import Linear
from tokenloom.models.llama import LlamaForCausalLM
from tokenloom.quant.linear import QuantLinear

log = logging.getLogger("tokenloom.engine")


class FusedDecoder:
    def __init__(self, kernels: ModuleType, model: LlamaForCausalLM, kv_caches: list[LayerKVCache]) -> None:
        cfg = model.config
        attn = model.layers[0].self_attn
        self.model = model
        self.stack = kernels.DecodeStack(
            num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, eps=cfg.rms_norm_eps,
            scale=attn.scale, sliding_window=cfg.sliding_window or 0, final_norm=model.norm.weight,
        )
        for layer, kv in zip(model.layers, kv_caches):
            a, mlp = layer.self_attn, layer.mlp
            lin = [_fused_linear(kernels, m) for m in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            self.stack.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, *lin,
                                 kv.k, kv.v, kv.k_scale, kv.v_scale)

    @staticmethod
    def supports(kernels: ModuleType | None, model: LlamaForCausalLM, device: torch.device) -> str | None:
        """Why the stack cannot serve this model (None: it can)."""
        if device.type != "cpu" or kernels is None or not hasattr(kernels, "DecodeStack"):
            return "no CPU kernels"
        if not kernels.skinny_available():
            return "the CPU lacks AVX512-BF16"
        if model.config.family == "gemma":
            return (f"{model.config.architecture} has (1 + w) RMSNorms around attention and MLP, GeGLU and a "
                    "RoPE base per layer kind (Gemma), which the C++ stack does not")
        if model.config.num_experts:
            return (f"{model.config.architecture} routes tokens to experts (mixture of experts), "
                    "which the C++ stack does not")
        if model.config.qk_norm:
            return f"{model.config.architecture} normalizes q and k per head, which the C++ stack does not"
        if len({model.config.layer_window(i) for i in range(model.config.num_hidden_layers)}) > 1:
            return (f"{model.config.architecture} mixes sliding-window and full-attention layers (one block "
                    "table and window per layer group), which the C++ stack does not")
        if model.config.rotary_dim != model.config.head_dim:
            return (f"{model.config.architecture} rotates {model.config.rotary_dim} of {model.config.head_dim} "
                    "head dims (partial rotary), which the C++ stack does not")
        if model.norm.weight.dtype != torch.bfloat16:
            return f"model dtype {model.norm.weight.dtype} (bfloat16 only)"
        for name, m in model.named_modules():
            served = _is_dense_bf16(m) or (isinstance(m, QuantLinear) and m.kernel_module() is not None)
            if name.endswith("_proj") and not served:
                return f"layer {name} ({type(m).__name__}) has no C++ kernel"
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """(T,) tokens of an all-decode step -> (T, hidden) final hidden states, as model(...) returns."""
        plan: DecodePlan = meta.plan
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary.lookup(positions, x.dtype)  # (T, 1, D) each
        t = x.shape[0]
        return self.stack.forward(x, cos.view(t, -1), sin.view(t, -1), meta.slot_mapping, plan.decode_blocks,
                                  plan.decode_lens)


def _is_dense_bf16(m: torch.nn.Module) -> bool:
    return type(m) is Linear and m.weight.dtype == torch.bfloat16 and m.weight.is_contiguous()


def _fused_linear(kernels: ModuleType, m: torch.nn.Module) -> Any:  # a kernels.FusedLinear
    if isinstance(m, QuantLinear):
        return kernels.FusedLinear(m.codes, m.scales, m.mins, m.bias, m.bits)
    return kernels.FusedLinear(m.weight, None, None, m.bias, 16, m.packed)


def build_fused_decoder(kernels: ModuleType | None, model: LlamaForCausalLM, kv_caches: list[LayerKVCache],
                        device: torch.device) -> FusedDecoder | None:
    """The fused decoder for this model, or None (logged) when the Python path must serve decode too."""
    why = FusedDecoder.supports(kernels, model, device)
    if why is None and any(kv.group for kv in kv_caches):
        why = "the KV cache has several layer groups, each with its own block tables"
    if why is not None or kernels is None:
        log.info("fused decode step off: %s", why)
        return None
    return FusedDecoder(kernels, model, kv_caches)
