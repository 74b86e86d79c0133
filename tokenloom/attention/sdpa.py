"""Fast attention on torch's fused scaled_dot_product_attention (CPU flash kernel; also runs on CUDA).

Decode tokens (one query each) are batched into one SDPA call over their gathered, padded contexts.
So are the tokens of short chunks (at most DECODE_STYLE_MAX_QUERY, e.g. 1 + k tokens verifying k
speculative drafts): query j of such a chunk is a decode row whose context ends at its own position,
which is its causal mask (the chunk's K/V is written to the cache before attention). A longer prefill
with no earlier context attends to its own fresh K/V with the built-in causal mask; a longer chunk that
continues a sequence gathers its context from the cache with an offset causal mask; under a sliding
window it gathers only the blocks the window reaches (a windowed KV group has released the older ones).

Soft-capped layers (Gemma 2's attn_logit_softcapping) take the same routes with `softcapped_attention`, a
math path, in place of the fused kernel: torch's SDPA has no way to apply cap * tanh(s / cap) between the
scaling and the softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tokenloom.attention.base import AttentionBackend, AttentionMetadata
from tokenloom.attention.paged_kv import LayerKVCache

DECODE_STYLE_MAX_QUERY = 8  # chunks this short attend as decode rows (see the module docstring)

# On CUDA, torch may pick cuDNN's SDPA, which builds an execution graph per new shape: about 0.5 ms of host
# time per call on an H200 (benchmarks/gpu_profile.py), and decode shapes change every step. The flash and
# memory-efficient kernels have no such set-up; math stays as the fallback for what neither takes.
_CUDA_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> torch.Tensor:
    """F.scaled_dot_product_attention, steered away from cuDNN on CUDA (see _CUDA_SDPA)."""
    if q.is_cuda:
        with sdpa_kernel(_CUDA_SDPA):
            return F.scaled_dot_product_attention(q, k, v, **kw)  # type: ignore[arg-type]
    return F.scaled_dot_product_attention(q, k, v, **kw)  # type: ignore[arg-type]


@dataclass
class PrefillChunk:
    start: int
    end: int
    ctx: int
    blocks: torch.Tensor | None  # None when the chunk is the whole context (read fresh K/V)
    mask: torch.Tensor | None  # (q_len, ctx - first) bool, True = attend; None = plain causal
    first: int = 0  # position of the first gathered key (a block boundary; > 0 only under a window)
    seq: int = 0  # the chunk's sequence in the step (its row of the block tables)


@dataclass
class DecodePlan:
    """What `SDPABackend.plan` works out once per step for all layers: the decode rows' gather
    indices and the prefill chunks (CPUBackend and the fused decode stack read it too)."""

    decode_tokens: torch.Tensor | None  # (B,) token index of each decode row
    decode_blocks: torch.Tensor | None  # (B, max_blocks) the block table of each decode row's sequence
    decode_mask: torch.Tensor | None  # (B, 1, 1, max_blocks * block_size) bool; built on first use
    decode_lens: torch.Tensor | None  # (B,) int64 context length of each decode row (its position + 1)
    all_decode: bool  # every token of the batch is a decode, in order: skip the index ops
    prefills: list[PrefillChunk]


def softcapped_attention(
    q: torch.Tensor,  # (B, Hq, Lq, D)
    k: torch.Tensor,  # (B, Hkv, Lk, D), Hq a multiple of Hkv
    v: torch.Tensor,  # (B, Hkv, Lk, D)
    mask: torch.Tensor | None,  # bool, True = attend, broadcast to (B, Hq, Lq, Lk); None with `causal`
    scale: float,
    softcap: float,
    causal: bool,
) -> torch.Tensor:  # (B, Hq, Lq, D) in q's dtype
    """F.scaled_dot_product_attention's result with the scaled scores capped at softcap * tanh(s / softcap)
    before the mask (transformers' Gemma2 eager attention), in float32. `causal`: query i sees keys up to
    Lk - Lq + i (the queries are the context's last Lq tokens), SDPA's is_causal for Lq == Lk."""
    group = q.shape[1] // k.shape[1]
    keys = k.float().repeat_interleave(group, dim=1)  # (B, Hq, Lk, D)
    vals = v.float().repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), keys.transpose(-1, -2)) * scale  # (B, Hq, Lq, Lk)
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        lq, lk = scores.shape[-2:]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), vals).to(q.dtype)


class SDPABackend(AttentionBackend):
    name = "sdpa"

    def plan(self, meta: AttentionMetadata, device: torch.device, sliding_window: int | None) -> DecodePlan:
        bs = meta.block_size
        dec_tokens: list[int] = []
        dec_seqs: list[int] = []
        lens: list[int] = []
        prefills: list[PrefillChunk] = []
        for i in range(meta.num_seqs):
            start, end, ctx = meta.query_start_loc[i], meta.query_start_loc[i + 1], meta.seq_lens[i]
            q_len = end - start
            if q_len <= DECODE_STYLE_MAX_QUERY:
                for j in range(q_len):
                    dec_tokens.append(start + j)
                    dec_seqs.append(i)
                    lens.append(ctx - q_len + j + 1)
                continue
            if ctx == q_len and sliding_window is None:
                prefills.append(PrefillChunk(start, end, ctx, None, None, seq=i))
                continue
            # Keys from the first block the chunk's first query reaches (position 0 without a window).
            first_block = 0 if sliding_window is None or ctx == q_len else max(0, ctx - q_len - sliding_window + 1) // bs
            first = first_block * bs
            q_pos = torch.arange(ctx - q_len, ctx, device=device)[:, None]
            k_pos = torch.arange(first, ctx, device=device)[None, :]
            mask = k_pos <= q_pos
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
            blocks = meta.block_tables[i, first_block : (ctx + bs - 1) // bs]
            prefills.append(PrefillChunk(start, end, ctx, blocks if ctx > q_len else None, mask, first, seq=i))
        if not dec_tokens:
            return DecodePlan(None, None, None, None, False, prefills)
        rows = torch.tensor(dec_seqs, device=device)
        max_blocks = (max(lens) + bs - 1) // bs
        tokens = torch.tensor(dec_tokens, device=device)
        return DecodePlan(
            decode_tokens=tokens,
            decode_blocks=meta.block_tables[rows, :max_blocks],
            decode_mask=None,
            decode_lens=torch.tensor(lens, device=device),
            all_decode=not prefills,  # then the decode rows are every token, in order
            prefills=prefills,
        )

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
        k, v = self.write_kv(kv, k, v, meta.slot_mapping)  # as the cache holds them (INT8 round trip)
        plan: DecodePlan = meta.plan_for(self, q.device, sliding_window)
        out = q.new_empty(q.shape)
        if plan.decode_tokens is not None:
            qd = q if plan.all_decode else q[plan.decode_tokens]  # (B, Hq, D)
            od = self.decode(qd, kv, plan, scale, sliding_window, softcap)
            if plan.all_decode:
                return od
            out[plan.decode_tokens] = od
        if plan.prefills:
            self.prefill(q, k, v, kv, meta, plan, scale, sliding_window, out, softcap)
        return out

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKVCache, meta: AttentionMetadata,
        plan: DecodePlan, scale: float, sliding_window: int | None, out: torch.Tensor, softcap: float | None = None,
    ) -> None:
        """Attention of the plan's prefill chunks: q (T, Hq, D) -> their rows of out (T, Hq, D)."""
        for p in plan.prefills:  # each prompt chunk on its own
            self.prefill_chunk(q, k, v, kv, p, scale, out, softcap)

    def prefill_chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKVCache, p: PrefillChunk,
                      scale: float, out: torch.Tensor, softcap: float | None = None) -> None:
        """One chunk through SDPA: fresh K/V when the chunk is the whole context, else the context gathered
        (copied) from the cache with an explicit mask."""
        group = q.shape[1] // kv.num_kv_heads
        qp = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # (1, Hq, q_len, D)
        if p.blocks is None:
            kp, vp = k[p.start : p.end], v[p.start : p.end]  # (q_len, Hkv, D) fresh
        else:
            kp, vp = kv.gather(p.blocks, p.ctx - p.first, q.dtype)
        kp = kp.transpose(0, 1).unsqueeze(0)  # (1, Hkv, ctx, D)
        vp = vp.transpose(0, 1).unsqueeze(0)
        if softcap is not None:
            op = softcapped_attention(qp, kp, vp, p.mask, scale, softcap, causal=p.mask is None)
        else:
            op = sdpa(qp, kp, vp, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=group > 1)
        out[p.start : p.end] = op.squeeze(0).transpose(0, 1)

    def write_kv(self, kv: LayerKVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' K/V (T, Hkv, D); returns them as the cache holds them."""
        return kv.write(k, v, slot_mapping)

    def decode(
        self, q: torch.Tensor, kv: LayerKVCache, plan: DecodePlan, scale: float, sliding_window: int | None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """One query per sequence, q (B, Hq, D) -> (B, Hq, D), over gathered, padded, masked contexts."""
        batch, num_heads, head_dim = q.shape
        num_kv_heads = kv.num_kv_heads
        if plan.decode_mask is None:  # once per step, shared by the layers after the first
            ctx = plan.decode_lens[:, None]
            k_pos = torch.arange(plan.decode_blocks.shape[1] * kv.block_size, device=q.device)[None, :]
            mask = k_pos < ctx  # (B, L)
            if sliding_window is not None:
                mask &= k_pos > ctx - 1 - sliding_window
            plan.decode_mask = mask[:, None, None, :]
        # Grouped-query trick: the query heads sharing a KV head act as that many queries of it.
        qd = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
        keys, vals = kv.gather_blocks(plan.decode_blocks, q.dtype)  # (B, max_blocks, block_size, Hkv, D)
        keys = keys.flatten(1, 2).transpose(1, 2)  # (B, Hkv, L, D)
        vals = vals.flatten(1, 2).transpose(1, 2)
        if softcap is not None:
            od = softcapped_attention(qd, keys, vals, plan.decode_mask, scale, softcap, causal=False)
        else:
            od = sdpa(qd, keys, vals, attn_mask=plan.decode_mask, scale=scale)
        return od.reshape(batch, num_heads, head_dim)
