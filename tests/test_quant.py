"""Weight-only INT8 / INT4 quantization: round-trip error, kernels against the dequantized reference,
the engine with quantized layers, and the perplexity command."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tokenloom import LLM, SamplingParams
from tokenloom.cli import main
from tokenloom.errors import ConfigError
from tokenloom.quant.weight_only import (
    Int4Linear, Int8Linear, int4_group_size, quantize_int4, quantize_int8, weight_bytes,
)


def _linear(n: int, k: int, bias: bool = False, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    lin.weight.data = torch.randn(n, k).bfloat16()
    if bias:
        lin.bias.data = torch.randn(n).bfloat16()
    return lin.bfloat16()


def test_int8_round_trip_error_is_within_half_a_step() -> None:
    w = torch.randn(64, 576)
    q, s = quantize_int8(w)
    err = (q.float() * s[:, None] - w).abs()
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    assert bool((err <= s[:, None] / 2 + 1e-6).all())  # rounding to the nearest step


def test_int4_round_trip_error_is_within_half_a_step() -> None:
    w = torch.randn(64, 576)
    q, s, z = quantize_int4(w, 64)
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    deq = ((q.float().reshape(64, 9, 64) - 8) * s[..., None] + z[..., None]).reshape(64, 576)
    step = s.repeat_interleave(64, dim=1)
    assert bool(((deq - w).abs() <= step / 2 + 1e-5).all())


def test_int4_group_size_falls_back_where_128_does_not_divide() -> None:
    assert int4_group_size(1536, 128) == 128 and int4_group_size(576, 128) == 64
    with pytest.raises(ConfigError, match="divides"):
        int4_group_size(100, 128)


@pytest.mark.parametrize("rows", [1, 5, 37])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_matches_its_dequantized_reference(rows: int, bias: bool) -> None:
    lin = Int8Linear(_linear(256, 576, bias))
    x = torch.randn(rows, 576).bfloat16()
    # Outputs are ~N(0, 24^2): bf16 rounding of the result alone is up to 0.125 around 32.
    torch.testing.assert_close(lin(x).float(), lin.reference(x), rtol=1e-2, atol=0.15)


@pytest.mark.parametrize("rows", [1, 5, 37])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_linear_matches_its_dequantized_reference(rows: int, group: int) -> None:
    lin = Int4Linear(_linear(256, 1536), group)
    x = torch.randn(rows, 1536).bfloat16()
    torch.testing.assert_close(lin(x).float(), lin.reference(x), rtol=1e-2, atol=0.3)  # outputs ~N(0, 39^2)


def test_quantized_layers_stay_close_to_float() -> None:
    base = _linear(256, 576, seed=3)
    x = torch.randn(8, 576).bfloat16()
    want = base(x).float()
    rel8 = ((Int8Linear(base)(x).float() - want).norm() / want.norm()).item()
    rel4 = ((Int4Linear(base, 64)(x).float() - want).norm() / want.norm()).item()
    assert rel8 < 0.01 and rel4 < 0.12 and rel8 < rel4


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_engine_with_quantized_weights(tiny_llama: Path, method: str) -> None:
    kw = dict(dtype="bfloat16", kv_cache_memory="8MiB", max_model_len=256)
    ref = LLM(str(tiny_llama), **kw)
    q = LLM(str(tiny_llama), quantization=method, quant_group_size=32, **kw)
    model = q.engine.loaded.model
    kinds = {type(m).__name__ for m in model.layers.modules()}
    assert ("Int8Linear" if method == "int8" else "Int4Linear") in kinds and "Linear" not in kinds
    assert type(model.lm_head).__name__ == "Int8Linear"  # the tiny vocabulary (not a multiple of 16) keeps int4 out
    assert weight_bytes(model) < weight_bytes(ref.engine.loaded.model)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    a, b = ref.generate(["The quick brown fox"], sp)[0].outputs[0], q.generate(["The quick brown fox"], sp)[0].outputs[0]
    assert len(b.token_ids) == 16
    # The first token comes from the same prompt: its logprob under both models stays close.
    assert abs(a.logprobs[0].logprob - b.logprobs[0].logprob) < (0.2 if method == "int8" else 1.0)


def test_quantization_needs_bfloat16(tiny_llama: Path) -> None:
    with pytest.raises(ConfigError, match="bfloat16"):
        LLM(str(tiny_llama), dtype="float32", quantization="int8", kv_cache_memory="8MiB")
    with pytest.raises(ConfigError, match="int8 or int4"):
        LLM(str(tiny_llama), quantization="int3", kv_cache_memory="8MiB")


def test_eval_perplexity_command(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 60)
    rc = main(["eval", "perplexity", "--model", str(tiny_llama), "--text", str(text), "--max-tokens", "300",
               "--window", "128", "--stride", "64", "--kv-cache-memory", "8MiB", "--max-model-len", "256"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and out[-1].startswith("perplexity: ")
    ppl = float(out[-1].split(": ")[1])
    assert 1.0 < ppl < 2 * 400  # a random tiny model over its ~400-token vocabulary
    assert "299 tokens scored" in out[0]


def test_perplexity_matches_transformers(tiny_llama: Path) -> None:
    """One window over the whole text: the same number transformers' logits give."""
    import math

    import transformers

    from tokenloom.bench.perplexity import perplexity

    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB", max_model_len=256)
    ids = llm.tokenizer.encode("Once upon a time there was a small engine. " * 12, add_special_tokens=False)[:100]
    ours, n = perplexity(llm.engine, ids, 128, 128)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    want = math.exp(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item())
    assert n == len(ids) - 1 and ours == pytest.approx(want, rel=1e-4)
    # Overlapping windows score every token once too, each with less context.
    windowed, n2 = perplexity(llm.engine, ids, 64, 32)
    assert n2 == len(ids) - 1 and math.isfinite(windowed)
