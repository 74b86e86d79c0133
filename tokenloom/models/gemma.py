"""The Gemma family (Gemma 3 text, Gemma 2): the Llama skeleton with Gemma's differences.

- Interleaved sliding-window ("local") and global layers (config.layer_types), each kind with its own RoPE
  table: rope_local_theta without scaling for the local layers, rope_theta with rope_scaling for the global ones.
- Four RMSNorms a layer, before and after attention and before and after the MLP; each scales by (1 + w),
  computed in float32 and then cast (transformers' Gemma3RMSNorm), and q/k are normed per head (Gemma 3).
- Embeddings scaled by sqrt(hidden), that factor rounded to the model dtype first (as transformers does).
- GeGLU MLP (tanh-approximated GELU), attention scale query_pre_attn_scalar**-0.5, and optionally (Gemma 2)
  the attention scores and the final logits soft-capped, cap * tanh(x / cap): the scores by the attention
  backend (its `softcap`), after scaling and before the mask and softmax.

Module paths are the Llama family's (embed_tokens, layers.{i}.self_attn.qkv_proj / o_proj,
layers.{i}.mlp.gate_up_proj / down_proj, norm, lm_head) so the GGUF kept-quantized loader (gguf_kept.py)
and the engine treat both families alike. Operates on a flat batch of tokens, (T, hidden), like llama.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.attention.base import AttentionBackend, AttentionMetadata
from tokenloom.attention.paged_kv import LayerKVCache
from tokenloom.errors import ModelLoadError
from tokenloom.models.config import ModelConfig, RopeScaling
from tokenloom.models.layers import (Linear, RMSNorm, RotaryEmbedding, SwiGLU, apply_rope, expected_slots,
                                     load_packed, packing)

CosSin = tuple[torch.Tensor, torch.Tensor]  # RoPE cos, sin per token: (T, 1, head_dim) each


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaling by (1 + w): normalized and scaled in float32, then cast (transformers' Gemma3RMSNorm;
    the checkpoint stores w, centred on 0). Not the C++ add_rms_norm, which scales by w in the model dtype:
    (1 + w) rounded to bfloat16 would lose w's low bits. With `kernels` set, the C++ scaled_rms_norm does this
    arithmetic with the float32 (1 + w) in one call (a decode step runs 6 of these a layer: the torch ops
    below dispatch ~10 aten calls each); `reference` is its oracle."""

    kernels: ModuleType | None = None  # the C++ scaled_rms_norm when set (CPU); else torch's fused rms_norm

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps)
        nn.init.zeros_(self.weight)
        # (1 + w) in float32, built on first use. Weights are written through `.data` (which bumps no version
        # counter), so whoever changes a norm's weight after that calls refresh_scale(): load_weights does.
        self._scale: torch.Tensor | None = None

    def refresh_scale(self) -> None:
        self._scale = 1.0 + self.weight.float()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self._scale is None:
            self.refresh_scale()
        scale = self._scale
        k = self.kernels
        if k is not None and x.is_cpu and x.stride(-1) == 1 \
                and (residual is None or (x.is_contiguous() and residual.is_contiguous())):
            return k.scaled_rms_norm(x, residual, scale, self.eps)  # x may be a per-head view of qkv
        # The reference's arithmetic in torch's fused rms_norm: 4 ops instead of 9 (16 -> 12 us each on
        # Zen 4), the same float32 values.
        if residual is not None:
            x = x + residual
        return F.rms_norm(x.float(), scale.shape, scale, self.eps).to(x.dtype), x

    def reference(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype), x


class GeGLU(SwiGLU):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up fused into one matmul (SwiGLU's layout and weights);
    with `kernels` set (SwiGLU's attribute), the activation is the C++ gelu_tanh_and_mul."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (T, 2 * intermediate)
        if self.kernels is not None and gate_up.is_cpu:
            return self.down_proj(self.kernels.gelu_tanh_and_mul(gate_up.contiguous()))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)  # (T, intermediate) each
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = (cfg.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.sliding_window = cfg.layer_window(layer)  # None on the global layers
        self.softcap = cfg.attn_logit_softcapping  # Gemma 2, every layer; None: off
        self.backend = backend
        self.kernels: ModuleType | None = None  # fused C++ RoPE when set (CPU)

    def forward(self, rope: CosSin, x: torch.Tensor, kv: LayerKVCache, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)[0]
            k = self.k_norm(k)[0]
        q, k = apply_rope(q, k, rope, self.kernels)
        out = self.backend.forward(q, k, v, kv, meta, self.scale, self.sliding_window, self.softcap)
        return self.o_proj(out.reshape(t, self.q_size))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = GemmaAttention(cfg, backend, layer)
        self.mlp = GeGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.local = bool(cfg.layer_types) and cfg.layer_types[layer] == "sliding_attention"  # local RoPE base

    def forward(
        self,
        rope: CosSin,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv: LayerKVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # x: what the previous block (attention or MLP) adds to the stream after its post-norm; residual: the
        # stream without it (None at layer 0, where x is the embeddings). Each pre-norm first adds the two, so
        # `residual` is then transformers' hidden_states. All (T, hidden).
        h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(rope, h, kv, meta))[0]
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h))[0], residual


class Gemma3ForCausalLM(nn.Module):
    """Gemma 3 text (and Gemma 2: no q/k norm, one RoPE table for both kinds of layer)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_position: int) -> None:
        super().__init__()
        self.config = cfg
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_position)  # global layers
        self.rotary_local = (RotaryEmbedding(cfg.head_dim, cfg.rope_local_theta, RopeScaling(), max_position)
                             if cfg.rope_local_theta is not None else None)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, backend, i) for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.requires_grad_(False)

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        kv_caches: list[LayerKVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # (T, hidden) final hidden states
        x = self.embed(input_ids)
        rope_global, rope_local = self.rope(positions, x.dtype)
        residual: torch.Tensor | None = None
        for layer, kv in zip(self.layers, kv_caches):
            x, residual = layer(rope_local if layer.local else rope_global, x, residual, kv, meta)
        return self.norm(x, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) -> (T, hidden) embeddings times sqrt(hidden), that factor rounded to the model dtype first
        (transformers does: 25.3 -> 25.25 in bfloat16)."""
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(math.sqrt(self.config.hidden_size), dtype=torch.float32).to(x.dtype)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[CosSin, CosSin]:
        """The global and the local layers' RoPE cos/sin of `positions` (the same table without a local base)."""
        rope_global = self.rotary.lookup(positions, dtype)
        return rope_global, rope_global if self.rotary_local is None else self.rotary_local.lookup(positions, dtype)

    def set_kernels(self, kernels: ModuleType | None) -> None:
        """Few-row matmuls, RoPE, the (1 + w) norms and GeGLU through the C++ kernels (None: the torch ops)."""
        skinny = kernels if kernels is not None and kernels.skinny_available() else None
        gemma_ops = kernels if kernels is not None and hasattr(kernels, "scaled_rms_norm") else None
        for m in self.modules():
            if isinstance(m, GemmaAttention):
                m.kernels = kernels
            elif isinstance(m, Linear):
                m.kernels = skinny
            elif isinstance(m, (GemmaRMSNorm, GeGLU)):
                m.kernels = gemma_ops

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) float32 logits, soft-capped in the model dtype as transformers does."""
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, packing q/k/v into qkv_proj and gate/up into gate_up_proj."""
        params = dict(self.named_parameters())
        a = self.layers[0].self_attn
        pack = packing(a.q_size, a.kv_size, self.config.intermediate_size)
        tied = self.config.tie_word_embeddings
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and tied:
                continue
            loaded |= load_packed(params, name, tensor, pack)
        expected = expected_slots((n for n in params if not (tied and n == "lm_head.weight")), pack)
        missing = sorted(expected - loaded)
        if missing:
            raise ModelLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
        for m in self.modules():
            if isinstance(m, GemmaRMSNorm):
                m.refresh_scale()
