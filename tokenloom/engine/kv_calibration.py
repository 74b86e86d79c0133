"""Per-head INT8 KV scales (`--kv-cache-dtype int8 --kv-cache-scales head`), calibrated at start-up.

A per-head scale costs nothing per token, so the cache holds exactly twice the tokens of a 16-bit one,
but it must be fixed before the first request writes a code. The engine runs one prefill of a built-in
text (as fixed-length prompts, one batch) through the model into a temporary float cache and takes,
per layer and KV head, the largest |K| and |V| the text produced (K after RoPE, as the cache stores
it), times a headroom for inputs that reach further; values beyond saturate at +-127 codes. K and V of a head are products of fixed
projections and RMS-normalised inputs, so their range depends on the model far more than on the text.

The text mixes prose, a dialogue in the model's chat template, code, numbers and five languages besides
English. It is not the Shakespeare of `tokenloom eval perplexity`, so that perplexity measures data
the scales never saw.
On the embedded SmolLM2-135M (benchmarks/quantization.py, 2026-12-03): +0.07% perplexity on the
Shakespeare texts (+0.26% token by token) against per-token scales' +0.08% (+0.15%). Coarser steps for
a head's small values are the price: where the model hesitates between two tokens the choice can flip
(tests/test_smollm2.py). Headrooms of 1.0 to 1.5 measured alike, within noise.
"""

from __future__ import annotations

import hashlib

import torch

from tokenloom.attention.base import AttentionBackend
from tokenloom.attention.paged_kv import LayerKVCache, head_scales
from tokenloom.config import KVCacheFormat
from tokenloom.engine.runner import StepInput, build_step
from tokenloom.errors import ConfigError
from tokenloom.models.llama import LlamaForCausalLM
from tokenloom.tokenizer import Tokenizer

HEADROOM = 1.25
SEGMENT = 128  # tokens per calibration prompt
MAX_TOKENS = 2048

CALIBRATION_TEXT = """\
The committee met on Tuesday, 14 March 2023, to review the budget. Revenue rose 7.4% to $12.8 million,
while costs fell by a third. "We expected worse," the chair admitted, "but the new suppliers delivered."
Rain is forecast for the weekend; temperatures will drop from 18 C to 9 C by Sunday night.

def merge_sorted(a: list[int], b: list[int]) -> list[int]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]

SELECT name, COUNT(*) AS orders FROM customers JOIN orders USING (customer_id)
WHERE created_at >= '2024-01-01' GROUP BY name ORDER BY orders DESC LIMIT 10;

1. Preheat the oven to 200 degrees. 2. Mix 250 g flour, 2 eggs and 300 ml milk. 3. Bake for 25 minutes.
Photosynthesis converts light energy into chemical energy: 6 CO2 + 6 H2O -> C6H12O6 + 6 O2.
La ville de Lyon est connue pour sa cuisine. Der Zug nach Berlin hat zehn Minuten Verspätung.
El mercado abre a las ocho de la mañana. 東京は日本の首都です。 Москва — столица России.
{"id": 4821, "status": "shipped", "items": [{"sku": "A-17", "qty": 3}], "total": 59.97}
https://example.com/search?q=paged+attention&page=2  user@example.org  +1 (555) 010-0199
In 1905 Einstein published four papers; E = mc^2 followed from the special theory of relativity.
"""

CALIBRATION_CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Summarise the meeting in two sentences, then list three action items."},
    {"role": "assistant", "content": "Revenue grew 7.4% while costs fell. Action items: renew the supplier "
                                     "contracts, publish the report, and plan the next review."},
]


def calibration_prompts(tokenizer: Tokenizer, max_position: int) -> list[list[int]]:
    """The calibration text as prompts of SEGMENT tokens (fewer only where the model's RoPE table is
    shorter), a chat in the model's own template first when it has one. Fixed-length segments keep the
    scales of a model the same whatever --max-model-len an engine serves it with: disaggregated workers
    exchange codes, which mean the same values only under the same scales."""
    ids = tokenizer.encode_chat(CALIBRATION_CHAT, add_generation_prompt=False) if tokenizer.chat_template else []
    ids = (ids + tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False))[:MAX_TOKENS]
    seg = min(SEGMENT, max_position)
    return [ids[i : i + seg] for i in range(0, len(ids), seg)]


@torch.inference_mode()
def calibrate_kv_scales(model: LlamaForCausalLM, backend: AttentionBackend, device: torch.device,
                        prompts: list[list[int]], block_size: int, headroom: float = HEADROOM
                        ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the (Hkv,) float16 K and V scales that map headroom x the largest |value| of each head
    over one prefill of `prompts` (one batch, a sequence each) to code 127."""
    if not prompts or not all(prompts):
        raise ConfigError("KV scale calibration needs non-empty prompts")
    cfg = model.config
    entries, num_blocks = [], 0
    for p in prompts:
        n = -(-len(p) // block_size)
        entries.append(StepInput(p, 0, list(range(num_blocks, num_blocks + n)), 0))
        num_blocks += n
    dtype = model.norm.weight.dtype
    caches = [LayerKVCache.allocate(num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, dtype,
                                    KVCacheFormat.MODEL_DTYPE, device) for _ in range(cfg.num_hidden_layers)]
    input_ids, positions, meta, _, _ = build_step(entries, block_size, device)
    meta.plan = meta.plan_for(backend, device, cfg.sliding_window)
    model(input_ids, positions, caches, meta)
    # Slots no prompt token reached hold zeros, which never raise a maximum.
    return [tuple(head_scales(t.float().abs().amax(dim=(0, 1, 3)) * headroom) for t in (c.k, c.v))  # type: ignore[misc]
            for c in caches]


def scales_digest(caches: list[LayerKVCache]) -> str:
    """A short fingerprint of every layer's per-head scales: caches that disagree on it read each
    other's codes as different values (KV transfers check it)."""
    h = hashlib.sha256()
    for c in caches:
        for s in (c.k_scale, c.v_scale):
            if s is not None:
                h.update(s[0, 0].cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
