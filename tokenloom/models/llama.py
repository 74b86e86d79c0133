"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3/Phi-4-mini, SmolLM2): GQA, RoPE, RMSNorm, SwiGLU,
optional qkv bias, optional per-head q/k RMSNorm (Qwen3), partial rotary and LongRoPE (Phi-3/Phi-4-mini, whose
checkpoints hold qkv_proj and gate_up_proj already fused), and mixture-of-experts MLPs (Mixtral, Qwen2-MoE,
Qwen3-MoE: models/moe.py).

Operates on a flat batch of tokens from many sequences, (T, hidden); attention reads and writes the
paged KV cache through `AttentionMetadata`. q/k/v and gate/up are fused into single matmuls at load time.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from types import ModuleType

import torch
from torch import nn

from tokenloom.attention.base import AttentionBackend, AttentionMetadata
from tokenloom.attention.paged_kv import LayerKVCache
from tokenloom.errors import ModelLoadError
from tokenloom.models.config import ModelConfig
from tokenloom.models.layers import (Linear, Packing, RMSNorm, RotaryEmbedding, SwiGLU, apply_rope, expected_slots,
                                     load_packed, packing)
from tokenloom.models.moe import SparseMoE

KVCache = LayerKVCache  # one per layer
CosSin = tuple[torch.Tensor, torch.Tensor]  # RoPE cos, sin per token: (T, 1, head_dim) each


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, layer: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        # Qwen3: RMSNorm over each head's head_dim on q and k, after projection, before RoPE.
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = self.head_dim**-0.5
        self.sliding_window = cfg.layer_window(layer)  # None: this layer attends to the whole context
        self.backend = backend
        self.kernels: ModuleType | None = None  # fused C++ RoPE when set (CPU)

    def forward(self, rope: CosSin, x: torch.Tensor, kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim))[0].view(t, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim))[0].view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, k, rope, self.kernels)
        out = self.backend.forward(q, k, v, kv, meta, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(t, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, backend, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Mixtral / Qwen2-MoE / Qwen3-MoE: a mixture of experts where the config says so (models/moe.py)
        self.mlp: SwiGLU | SparseMoE = (SparseMoE(cfg) if cfg.layer_is_moe(layer)
                                        else SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias))

    def forward(
        self,
        rope: CosSin,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried separately so each norm fuses the preceding add.
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(rope, h, kv, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_position: int) -> None:
        super().__init__()
        self.config = cfg
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, max_position)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, backend, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.requires_grad_(False)

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # (T, hidden) final hidden states
        x = self.embed_tokens(input_ids)
        rope = self.rotary.lookup(positions, x.dtype)
        residual: torch.Tensor | None = None
        for layer, kv in zip(self.layers, kv_caches):
            x, residual = layer(rope, x, residual, kv, meta)
        return self.norm(x, residual)[0]

    def set_kernels(self, kernels: ModuleType | None) -> None:
        """Route norms, RoPE, SwiGLU and few-row matmuls through the C++ kernels (None: the torch ops)."""
        skinny = kernels if kernels is not None and kernels.skinny_available() else None
        for m in self.modules():
            if isinstance(m, (RMSNorm, SwiGLU, SparseMoE, LlamaAttention)):
                m.kernels = kernels
            elif isinstance(m, Linear):
                m.kernels = skinny

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) float32 logits, for the rows that get sampled only."""
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, packing q/k/v into qkv_proj and gate/up into gate_up_proj."""
        params = dict(self.named_parameters())
        a = self.layers[0].self_attn
        pack = packing(a.q_size, a.kv_size, self.config.intermediate_size)
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith("model."):
                name = name[len("model.") :]
            if "rotary_emb.inv_freq" in name:
                continue
            moe = _MOE_TENSOR.fullmatch(name)  # Mixtral's block_sparse_moe.*, Qwen's mlp.gate/experts/shared_expert
            if moe is not None and isinstance(self.layers[int(moe.group(1))].mlp, SparseMoE):
                block = self.layers[int(moe.group(1))].mlp
                loaded.update(f"layers.{moe.group(1)}.mlp:{s}" for s in block.load_weight(moe.group(2), tensor))
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            loaded |= load_packed(params, name, tensor, pack)  # Phi-3: qkv_proj / gate_up_proj come whole
        expected = _expected_keys(self, pack)
        missing = sorted(expected - loaded)
        if missing:
            raise ModelLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")


_MOE_TENSOR = re.compile(r"layers\.(\d+)\.(?:block_sparse_moe|mlp)\."
                         r"((?:gate|experts|shared_expert|shared_expert_gate)\..+)")


def _expected_keys(model: LlamaForCausalLM, pack: Packing) -> set[str]:
    keys: set[str] = set()
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp, SparseMoE):
            keys.update(f"layers.{i}.mlp:{s}" for s in layer.mlp.expected_slots())
    # a MoE block's parameters are counted in its slots above
    moe = re.compile(r"layers\.\d+\.mlp\.(gate\.weight|experts_gate_up|experts_down|shared_expert.*)")
    names = [n for n, _ in model.named_parameters()
             if not (n == "lm_head.weight" and model.config.tie_word_embeddings) and not moe.fullmatch(n)]
    return keys | expected_slots(names, pack)
