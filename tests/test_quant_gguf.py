"""GGUF Q8_0 / Q4_0 / Q4_1 tensors kept quantized: exact weights, the kernels against the dequantized
float32 weight, and the embedded model with kept weights (the K-quants: tests/test_kquant.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from test_smollm2 import SURE_CHAT  # a question the model is sure of on every kernel route

from tokenloom import LLM, SamplingParams
from tokenloom.models.gguf_kept import blocks_to_codes
from tokenloom.models.gguf_quants import dequantize
from tokenloom.quant.embedding import QuantEmbedding
from tokenloom.quant.linear import Int4Linear, Int8Linear
from tokenloom.quant.weight_only import weight_bytes

Q = GGMLQuantizationType


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_kept_layer_is_the_dequantized_gguf_weight(qtype: GGMLQuantizationType, rows: int) -> None:
    n, k = 75, 608  # odd N; K = 19 blocks of 32, not a multiple of 64
    rng = np.random.default_rng(0)
    raw = gguf_quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, qtype)
    want_w = dequantize(raw, qtype, (n, k), torch.float32)
    b = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8)).view(n * k // 32, -1)
    q, d, m = blocks_to_codes(b, qtype, n, k)
    layer = Int8Linear.from_codes(q, d) if m is None else Int4Linear.from_codes(q, d, m)
    assert torch.equal(layer.dequantize(), want_w)  # the same weights, bit for bit
    x = torch.randn(rows, k).bfloat16()
    want = F.linear(x.float(), want_w)
    # bf16 output rounding (2^-9 relative to the largest output); the many-row path also rounds
    # Q8_0 / Q4 weights to bf16 once.
    torch.testing.assert_close(layer(x).float(), want, rtol=8e-3, atol=8e-3 * want.abs().amax().item())


def test_default_model_keeps_its_quantized_weights() -> None:
    kw = dict(dtype="bfloat16", kv_cache_memory="64MiB", max_model_len=512)
    kept = LLM(**kw)
    model = kept.engine.loaded.model
    assert isinstance(model.layers[0].self_attn.qkv_proj, Int4Linear)  # Q4_1
    assert isinstance(model.lm_head, Int8Linear)  # tied to the Q8_0 token table
    # the lookup decodes rows of the head's blocks: one copy of the table
    assert isinstance(model.embed_tokens, QuantEmbedding) and model.embed_tokens.table is model.lm_head
    dense = LLM(gguf_weights="dequantize", **kw)
    dense_table = dense.engine.loaded.model.embed_tokens.weight
    ids = torch.tensor([0, 17, 49151, 17])
    assert torch.equal(model.embed_tokens(ids), dense_table[ids])  # d q in float32, rounded to bf16 once
    assert weight_bytes(model) < 0.45 * weight_bytes(dense.engine.loaded.model)  # ~103 MiB vs 257 MiB
    out = kept.chat(SURE_CHAT, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    assert "Tokyo" in out
