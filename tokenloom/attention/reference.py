"""Pure-torch reference attention: one sequence at a time, float32 scores, explicit masks.

Slow and obviously correct; the test oracle for the fast backends.
"""

from __future__ import annotations

import torch

from tokenloom.attention.base import AttentionBackend, AttentionMetadata
from tokenloom.attention.paged_kv import LayerKVCache


class ReferenceBackend(AttentionBackend):
    name = "reference"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        meta = meta.for_group(kv.group)  # the layer's KV group: its block tables and slots
        kv.write(k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        num_heads, num_kv_heads = q.shape[1], kv.num_kv_heads
        group = num_heads // num_kv_heads
        bs = meta.block_size
        for i in range(meta.num_seqs):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            ctx = meta.seq_lens[i]
            blocks = meta.block_tables[i, : (ctx + bs - 1) // bs]
            keys, vals = kv.gather(blocks, ctx, torch.float32)  # (ctx, Hkv, D)
            keys = keys.repeat_interleave(group, dim=1)  # (ctx, Hq, D)
            vals = vals.repeat_interleave(group, dim=1)
            qi = q[start:end].float()  # (q_len, Hq, D)
            scores = torch.einsum("qhd,khd->hqk", qi, keys) * scale  # (Hq, q_len, ctx)
            if softcap is not None:  # Gemma 2: after the scale, before the mask (transformers' eager attention)
                scores = torch.tanh(scores / softcap) * softcap
            q_pos = torch.arange(ctx - (end - start), ctx, device=q.device)[:, None]
            k_pos = torch.arange(ctx, device=q.device)[None, :]
            allowed = k_pos <= q_pos  # causal: (q_len, ctx)
            if sliding_window is not None:
                allowed &= k_pos > q_pos - sliding_window
            scores = scores.masked_fill(~allowed, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[start:end] = torch.einsum("hqk,khd->qhd", probs, vals).to(q.dtype)
        return out
