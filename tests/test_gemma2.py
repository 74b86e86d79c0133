"""Gemma 2's attention logit soft-capping (scores -> cap * tanh(scores / cap) after scaling, before the mask and
softmax): every attention backend against the reference, and tiny random-weight Gemma 2 models against
transformers' Gemma2ForCausalLM (eager attention, float32), from HF folders and from GGUF files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from conftest import PROMPTS, assert_matches_reference
from test_gemma3 import LOGITS_ATOL, LOGPROB_ATOL, WINDOW, make_tiny_gemma, write_gemma3_gguf
from test_kernels import _cache
from test_models import MAX_NEW, hf_greedy
from test_paged_prefill import _random_step
from test_qwen3 import _prefill_logits
from tokenloom import LLM, SamplingParams
from tokenloom.attention.base import AttentionMetadata
from tokenloom.attention.cpu import CPUBackend
from tokenloom.attention.reference import ReferenceBackend
from tokenloom.attention.sdpa import SDPABackend
from tokenloom.config import KVCacheFormat
from tokenloom.errors import ModelLoadError, UnsupportedArchitecture
from tokenloom.kernels import load_cpu_kernels
from tokenloom.models.config import ModelConfig

K = load_cpu_kernels()
needs_kernels = pytest.mark.skipif(K is None, reason="the C++ kernels could not be built on this machine")

# The tiny model's scaled attention scores reach about +-8 (tests/test_gemma2.py::test_the_cap_bites checks the
# logits move): a cap of 3 bends most of them, where the released models' 50 rarely bites.
ATTN_CAP = 3.0
FINAL_CAP = 3.0
KERNEL_CAP = 1.5  # random unit q, k: the scaled scores are about N(0, 1)
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # bf16: one rounding of the output


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gemma(tmp_path_factory.mktemp("gemma2"), arch="gemma2", seed=31, layer_types=None,
                           attn_logit_softcapping=ATTN_CAP, final_logit_softcapping=FINAL_CAP)


# --- the kernels and backends against the reference --------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("dtype, head_dim, hq, hkv, cache", [
    (torch.bfloat16, 64, 9, 3, "model dtype"),  # the AVX512-BF16 kernel, 4 + 4 + 1 heads at a time
    (torch.bfloat16, 256, 4, 2, "model dtype"),  # one head at a time
    (torch.bfloat16, 128, 6, 2, "int8 per token"),  # INT8 codes widened to bf16
    (torch.float32, 64, 8, 1, "int8 per head"),  # INT8 codes widened to float32
    (torch.float32, 48, 8, 2, "model dtype"),  # the portable kernel
])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_decode_softcap_matches_reference(dtype: torch.dtype, head_dim: int, hq: int, hkv: int, cache: str,
                                                window: int | None) -> None:
    torch.manual_seed(7)
    block, num_blocks = 4, 64
    kv = _cache(num_blocks, block, hkv, head_dim, dtype, cache)
    everything = torch.arange(num_blocks * block)
    kv.write(torch.randn(num_blocks * block, hkv, head_dim).to(dtype),
             torch.randn(num_blocks * block, hkv, head_dim).to(dtype), everything)
    lens = [1, 7, 23, 158]
    perm = torch.randperm(num_blocks - 2).tolist()  # the last two blocks are scratch, in no table
    tables, used = [], 0
    for n in lens:
        tables.append(perm[used : used + -(-n // block)])
        used += len(tables[-1])
    width = max(len(r) for r in tables)
    bt = torch.tensor([r + [0] * (width - len(r)) for r in tables])
    q = torch.randn(len(lens), hq, head_dim).to(dtype)
    scale = head_dim**-0.5
    got = K.paged_decode(q, kv.k, kv.v, kv.k_scale, kv.v_scale, bt, torch.tensor(lens), scale, window or 0,
                         KERNEL_CAP)
    uncapped = K.paged_decode(q, kv.k, kv.v, kv.k_scale, kv.v_scale, bt, torch.tensor(lens), scale, window or 0)
    scratch = torch.arange(len(lens)) + (num_blocks - 2) * block  # where the reference writes its junk K/V
    junk = torch.randn(len(lens), hkv, head_dim).to(dtype)
    meta = AttentionMetadata(list(range(len(lens) + 1)), lens, bt, scratch, block)
    want = ReferenceBackend().forward(q, junk, junk, kv, meta, scale, window, KERNEL_CAP)
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert (got.float() - uncapped.float()).abs().max() > 0.1  # the cap changed the result (5x the bf16 tolerance)


@needs_kernels
@pytest.mark.parametrize("fmt, dtype, hq, hkv, d, window", [
    (KVCacheFormat.MODEL_DTYPE, torch.float32, 4, 4, 64, None),
    (KVCacheFormat.MODEL_DTYPE, torch.bfloat16, 8, 2, 128, 40),
    (KVCacheFormat.INT8_PER_TOKEN, torch.bfloat16, 9, 3, 64, None),
    (KVCacheFormat.MODEL_DTYPE, torch.float32, 2, 1, 40, 7),  # the portable tile code
])
def test_paged_prefill_softcap_matches_reference(fmt: KVCacheFormat, dtype: torch.dtype, hq: int, hkv: int, d: int,
                                                 window: int | None) -> None:
    kv_ref, kv_fast, meta, q, k, v = _random_step(fmt, dtype, hq, hkv, d, seed=hq * d + 1)
    scale = d**-0.5
    want = ReferenceBackend().forward(q, k, v, kv_ref, meta, scale, window, KERNEL_CAP)
    CPUBackend(K).write_kv(kv_fast, k, v, meta.slot_mapping)
    n = meta.num_seqs
    args = (q, kv_fast.k, kv_fast.v, kv_fast.k_scale, kv_fast.v_scale, meta.block_tables,
            torch.tensor(meta.query_start_loc[:n]), torch.tensor([meta.query_len(i) for i in range(n)]),
            torch.tensor(meta.seq_lens), scale, window or 0)
    got, uncapped = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    K.paged_prefill(*args, got, KERNEL_CAP)
    K.paged_prefill(*args, uncapped)
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert (got.float() - uncapped.float()).abs().max() > 0.1


@pytest.mark.parametrize("backend", ["cpu", "sdpa"])
@pytest.mark.parametrize("window", [None, 40])
def test_backend_forward_softcap_matches_reference(backend: str, window: int | None) -> None:
    """A whole step (a fresh prompt, chunks over cached prefixes, a one-token decode row) through each fast
    backend: the CPU one's kernels, SDPA's math path (its fused kernel has no cap)."""
    if backend == "cpu" and K is None:
        pytest.skip("the C++ kernels could not be built on this machine")
    kv_ref, kv_fast, meta, q, k, v = _random_step(KVCacheFormat.MODEL_DTYPE, torch.float32, 9, 3, 64, seed=6)
    want = ReferenceBackend().forward(q, k, v, kv_ref, meta, 0.125, window, KERNEL_CAP)
    fast = CPUBackend(K) if backend == "cpu" else SDPABackend()
    got = fast.forward(q, k, v, kv_fast, meta, 0.125, window, KERNEL_CAP)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_bad_cap_in_the_kernels_is_a_clear_error() -> None:
    if K is None:
        pytest.skip("the C++ kernels could not be built on this machine")
    kv = _cache(2, 4, 1, 64, torch.float32, "model dtype")
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        K.paged_decode(torch.zeros(1, 1, 64), kv.k, kv.v, None, None, torch.zeros(1, 1, dtype=torch.long),
                       torch.tensor([1]), 0.125, 0, -1.0)


# --- the model against transformers ------------------------------------------------------------------


def test_config(tiny_gemma2: Path) -> None:
    cfg = ModelConfig.from_hf_folder(tiny_gemma2)
    assert cfg.architecture == "Gemma2ForCausalLM" and cfg.family == "gemma" and not cfg.qk_norm
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (ATTN_CAP, FINAL_CAP)
    assert [cfg.layer_window(i) for i in range(4)] == [WINDOW, None, WINDOW, None]  # Gemma 2 alternates
    assert cfg.rope_local_theta is None and cfg.query_pre_attn_scalar == 24


def test_released_gemma2_config_loads_as_transformers_reads_it() -> None:
    """google/gemma-2-2b-it's config.json (transformers 4.42's shape: no layer_types, the window on every other
    layer by Gemma 2's convention): caps 50 and 30, a 4096-token window on the even layers, scale 256**-0.5."""
    raw = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attn_logit_softcapping": 50.0,
           "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304,
           "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
           "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096, "max_position_embeddings": 8192,
           "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "vocab_size": 256000, "cache_implementation": "hybrid",
           "bos_token_id": 2, "eos_token_id": [1, 107], "pad_token_id": 0, "torch_dtype": "float32"}
    cfg = ModelConfig.from_hf_dict(raw)
    want = transformers.Gemma2Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (50.0, 30.0)
    assert cfg.layer_types == tuple(want.layer_types) and cfg.layer_types[:2] == ("sliding_attention", "full_attention")
    assert [cfg.layer_window(i) for i in range(4)] == [4096, None, 4096, None]
    assert cfg.query_pre_attn_scalar == want.query_pre_attn_scalar == 256 and cfg.rope_local_theta is None
    assert cfg.rope_theta == 10000.0 and cfg.tie_word_embeddings and cfg.eos_token_ids == (1, 107)


@pytest.mark.parametrize("bad", [0, -50.0, "fifty"])
def test_bad_cap_in_the_config_is_named(tiny_gemma2: Path, bad: object) -> None:
    raw = json.loads((tiny_gemma2 / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="attn_logit_softcapping"):
        ModelConfig.from_hf_dict({**raw, "attn_logit_softcapping": bad})


def test_what_stays_unsupported_is_named(tiny_gemma2: Path) -> None:
    raw = json.loads((tiny_gemma2 / "config.json").read_text())
    with pytest.raises(UnsupportedArchitecture, match="use_bidirectional_attention"):
        ModelConfig.from_hf_dict({**raw, "use_bidirectional_attention": True})
    with pytest.raises(UnsupportedArchitecture, match="hidden_act"):
        ModelConfig.from_hf_dict({**raw, "hidden_activation": "relu"})


@pytest.mark.parametrize("backend", ["auto", "sdpa", "reference"])
def test_prefill_logits_match_transformers_and_the_cap_bites(tiny_gemma2: Path, backend: str) -> None:
    llm = LLM(str(tiny_gemma2), dtype="float32", kv_cache_memory="16MiB", attention_backend=backend)
    ref = transformers.Gemma2ForCausalLM.from_pretrained(tiny_gemma2, dtype=torch.float32).eval()
    assert ref.config._attn_implementation == "eager"
    layers = [layer.self_attn for layer in llm.engine.loaded.model.layers]
    for prompt in PROMPTS[1:4]:
        ids = llm.tokenizer.encode(prompt)
        assert len(ids) > WINDOW
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0]
        got = _prefill_logits(llm, ids)
        torch.testing.assert_close(got, want, rtol=0, atol=LOGITS_ATOL)
        for a in layers:  # the same model without the attention cap
            a.softcap = None
        try:
            uncapped = _prefill_logits(llm, ids)
        finally:
            for a in layers:
                a.softcap = ATTN_CAP
        assert (uncapped - want).abs().max() > 100 * LOGITS_ATOL


@pytest.mark.parametrize("backend", ["auto", "sdpa", "reference"])
def test_engine_greedy_matches_transformers_with_preemption(tiny_gemma2: Path, backend: str) -> None:
    """Mixed-length prompts through the paged cache, in prefill chunks of at most 16 tokens, with a cache too small
    for the batch (requests preempted and recomputed), as tests/test_gemma3.py does for Gemma 3. Half the layers
    are global here (one in four there), so the budget is 24 blocks' worth of K/V for every layer: 48 blocks of
    each group, just over one sequence of max_model_len (46) and fewer than the batch needs."""
    cfg = ModelConfig.from_hf_folder(tiny_gemma2)
    block_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * 4  # K,V float32, 4 tokens
    llm = LLM(str(tiny_gemma2), dtype="float32", block_size=4, max_model_len=160, kv_cache_memory=str(24 * block_bytes),
              max_num_batched_tokens=16, max_num_seqs=8, enable_prefix_caching=False, attention_backend=backend)
    if backend == "auto" and K is not None:
        assert isinstance(llm.engine.backend, CPUBackend)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5))
    assert llm.engine.scheduler.num_preemptions > 0
    ref_ids, ref_lp = hf_greedy(tiny_gemma2, prompts)
    assert_matches_reference(outs, ref_ids, ref_lp, LOGPROB_ATOL)
    llm.engine.kv.pool.check_invariants()


def test_gguf_round_trip_matches_transformers(tmp_path: Path) -> None:
    """What a Gemma 2 GGUF states (llama.cpp's converter): the window and both caps; layers alternate local and
    global, one RoPE base, query_pre_attn_scalar = head_dim. The tiny HF model is made so; then both load."""
    folder = make_tiny_gemma(tmp_path / "hf", arch="gemma2", seed=32, layer_types=None, query_pre_attn_scalar=32,
                             attn_logit_softcapping=ATTN_CAP, final_logit_softcapping=FINAL_CAP)
    path = write_gemma3_gguf(folder, tmp_path / "gemma2.gguf", "gemma2")
    from tokenloom.models.gguf import load_gguf

    cfg, _, _ = load_gguf(path, torch.float32)
    want = ModelConfig.from_hf_folder(folder)
    assert cfg.architecture == "Gemma2ForCausalLM" and cfg.layer_types == want.layer_types
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (ATTN_CAP, FINAL_CAP)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (want.rope_theta, None, 32.0)
    assert cfg.sliding_window == WINDOW and not cfg.qk_norm and cfg.tie_word_embeddings
    llm = LLM(str(path), dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=16, max_num_seqs=4)
    ref_tok = transformers.AutoTokenizer.from_pretrained(folder)
    prompts = [ref_tok.encode(p) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    ref_ids, _ = hf_greedy(folder, prompts)
    assert [o.outputs[0].token_ids for o in outs] == ref_ids


def test_gguf_quantized_checkpoint_keeps_the_caps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`tokenloom quantize` of a Gemma 2 GGUF writes a config.json that reads back with both caps (the saved model
    then generates what on-the-fly quantization does)."""
    from test_quant_checkpoint import _assert_saved_matches_fly

    folder = make_tiny_gemma(tmp_path / "hf", arch="gemma2", seed=34, layer_types=None, query_pre_attn_scalar=32,
                             attn_logit_softcapping=ATTN_CAP, final_logit_softcapping=FINAL_CAP)
    path = write_gemma3_gguf(folder, tmp_path / "gemma2.gguf", "gemma2")
    _, saved = _assert_saved_matches_fly(path, tmp_path / "q", "int8", monkeypatch)
    cfg = saved.engine.loaded.config
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (ATTN_CAP, FINAL_CAP)


def test_gguf_without_caps_takes_llama_cpp_defaults(tmp_path: Path) -> None:
    """A Gemma 2 file that omits the window and caps reads as llama.cpp reads it: 4096, 50 and 30."""
    from tokenloom.models.gguf import config_from_gguf
    from tokenloom.models.gguf_file import read_gguf

    folder = make_tiny_gemma(tmp_path / "hf", arch="gemma2", seed=33, layer_types=None)
    f = read_gguf(write_gemma3_gguf(folder, tmp_path / "gemma2.gguf", "gemma2"))
    for key in ("attention.sliding_window", "attn_logit_softcapping", "final_logit_softcapping"):
        f.metadata.pop(f"gemma2.{key}", None)
    cfg = config_from_gguf(f)
    assert (cfg.sliding_window, cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (4096, 50.0, 30.0)
