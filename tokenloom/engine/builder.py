"""Engine construction: everything `LLMEngine` needs before its first step, built once from an EngineConfig.

Load the model (and a draft model), quantize, prepack weights for oneDNN, calibrate INT8 KV scales, size
the KV cache against its memory budget, allocate it, and wire the runner, sampler and speculative
proposer. The engine itself only steps; this module is the one place that knows how the parts are made.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from tokenloom.attention.base import AttentionBackend
from tokenloom.attention.cpu import CPUBackend
from tokenloom.attention.registry import get_backend
from tokenloom.config import EngineConfig
from tokenloom.engine.fused_decode import build_fused_decoder
from tokenloom.engine.huge_pages import Moved, huge_pages_usable, move_to_huge_pages
from tokenloom.engine.kv_cache import (KVCacheSpec, KVCapacity, allocate_kv_cache, free_memory_bytes, kv_groups,
                                       plan_capacity)
from tokenloom.engine.kv_cache_manager import KVCacheManager
from tokenloom.engine.kv_calibration import calibrate_kv_scales, calibration_prompts
from tokenloom.engine.runner import ModelRunner
from tokenloom.engine.sampler import Sampler
from tokenloom.errors import ConfigError
from tokenloom.models.dense_routing import DenseRouting
from tokenloom.models.dense_routing import choose as choose_dense_routing
from tokenloom.models.layers import PACKED_MAX_ROWS, prepack_available, prepackable
from tokenloom.models.llama import LlamaForCausalLM
from tokenloom.models.loader import LoadedModel, load_model
from tokenloom.quant.kquant import KQuantLinear
from tokenloom.quant.routing import QuantRouting
from tokenloom.quant.routing import choose as choose_quant_routing
from tokenloom.quant.weight_only import QuantLinear, quantize_model
from tokenloom.spec.draft import DraftModelProposer
from tokenloom.spec.ngram import NgramProposer

log = logging.getLogger("tokenloom.engine")

Proposer = NgramProposer | DraftModelProposer


@dataclass
class EngineParts:
    """What a built engine is made of (mutable objects: the cache manager and runner change every step)."""

    device: torch.device
    backend: AttentionBackend
    loaded: LoadedModel
    max_model_len: int
    capacity: KVCapacity
    kv: KVCacheManager
    runner: ModelRunner
    sampler: Sampler
    proposer: Proposer | None
    quant_routing: QuantRouting | None = None  # the quantized matmuls' start-up crossover (quantized models on CPU)
    dense_routing: DenseRouting | None = None  # where the skinny kernel hands rows to prepacked weights (CPU)
    huge_pages: Moved | None = None  # the target's weights moved onto 2 MiB pages (None: not moved)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: torch sees no CUDA device")
    return dev


def build_engine_parts(config: EngineConfig) -> EngineParts:
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    device = resolve_device(config.device)
    backend = get_backend(config.attention_backend, device)
    loaded = load_model(config.model, config.dtype, device, backend, config.max_model_len, config.gguf_weights)
    if config.quantization is not None:
        n = quantize_model(loaded.model, config.quantization, config.quant_group_size)
        log.info("quantized %d linear layers to %s", n, config.quantization)
    routing, dense = _attach_cpu_kernels(config, loaded, backend, device)  # after quantizing: quantized layers too
    moved = _huge_pages(config, loaded, device)  # before the decode stack and the KV calibration take the weights
    mcfg = loaded.config
    max_model_len = config.max_model_len or mcfg.max_position_embeddings
    if max_model_len > mcfg.max_position_embeddings and mcfg.rope_scaling.kind in ("default", "dynamic"):
        raise ConfigError(
            f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings "
            f"{mcfg.max_position_embeddings}"
        )
    draft = _load_draft(config, loaded, device, backend, max_model_len)
    kv_format = config.kv_format
    spec = KVCacheSpec.for_model(mcfg, config.block_size, loaded.dtype, kv_format)
    draft_spec = (KVCacheSpec.for_model(draft.config, config.block_size, draft.dtype, kv_format)
                  if draft is not None else None)
    # Windowed layers release the blocks behind their reach (engine/kv_cache.py), except with a draft
    # model: its K/V lives in the target's first block table, whose blocks it must keep for its own layers.
    release = config.speculative != "draft"
    groups = kv_groups(mcfg, max_model_len, release)
    if not release and kv_groups(mcfg, max_model_len) != groups:
        log.info("sliding-window layers keep every KV block: --speculative draft keeps the draft model's K/V in "
                 "the same blocks")
    capacity = plan_capacity(spec, config.kv_cache_memory, device, max_model_len,
                             draft_spec.bytes_per_block if draft_spec else 0, groups, config.max_num_batched_tokens)
    kv = KVCacheManager(capacity.num_blocks, config.block_size, config.enable_prefix_caching,
                        windows=[g.window for g in groups])

    def scales(model: LlamaForCausalLM) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        return _calibrate(config, loaded, model, backend, device) if kv_format.per_head_scales else None

    kv_tensors = allocate_kv_cache(spec, capacity.num_blocks, device, scales(loaded.model), groups)
    fused = (build_fused_decoder(backend.kernels, loaded.model, kv_tensors, device, backend)
             if config.fused_decode and isinstance(backend, CPUBackend) else None)
    runner = ModelRunner(loaded.model, kv_tensors, config.block_size, backend, device, fused)
    sampler = Sampler(config.seed, device, backend.kernels if isinstance(backend, CPUBackend) else None)
    proposer: Proposer | None = None
    if config.speculative == "ngram":
        proposer = NgramProposer(config.prompt_lookup_max, config.prompt_lookup_min)
    elif config.speculative == "self":
        proposer = DraftModelProposer(runner, loaded.model, kv_tensors[: config.draft_layers], sampler,
                                      shares_target_cache=True)
    elif draft is not None and draft_spec is not None:
        draft_kv = allocate_kv_cache(draft_spec, capacity.num_blocks, device, scales(draft.model))
        proposer = DraftModelProposer(runner, draft.model, draft_kv, sampler, shares_target_cache=False)
    log.info(
        "loaded %s (%s, %s) in %.2fs on %s; %s",
        loaded.name, mcfg.architecture, str(loaded.dtype).removeprefix("torch."),
        loaded.load_seconds, device, capacity.describe(),
    )
    return EngineParts(device, backend, loaded, max_model_len, capacity, kv, runner, sampler, proposer, routing, dense,
                       moved)


def _attach_cpu_kernels(config: EngineConfig, loaded: LoadedModel, backend: AttentionBackend,
                        device: torch.device) -> tuple[QuantRouting | None, DenseRouting | None]:
    """On the CPU backend: the C++ kernels into every layer, then the prepacked weights; the routing of the
    quantized layers' matmuls and of the prepacked dense ones (returned; None where there are none)."""
    if not isinstance(backend, CPUBackend):
        return None, None
    loaded.model.set_kernels(backend.kernels)
    dense = None
    if _prepack(config, loaded, device) and hasattr(backend.kernels, "set_skinny_packed_max_rows") \
            and backend.kernels.skinny_available():
        dense = choose_dense_routing(backend.kernels)  # where the skinny kernel hands 2..8 rows to the packed copies
    if hasattr(backend.kernels, "set_quant_tile_max_rows") and any(
            isinstance(m, (QuantLinear, KQuantLinear)) for m in loaded.model.modules()):
        return choose_quant_routing(backend.kernels, config.quant_tile_max_rows, config.max_num_batched_tokens), dense
    return None, dense


def _prepack(config: EngineConfig, loaded: LoadedModel, device: torch.device) -> bool:
    """--prepack-weights: oneDNN-blocked copies of the dense bfloat16 linears (models/layers.py Linear).
    Whether any layer was packed."""
    if not config.prepack_weights or loaded.dtype != torch.bfloat16:
        return False
    if not prepack_available():
        log.info("weight prepacking off: this torch build has no oneDNN bfloat16 matmul on this CPU")
        return False
    layers = prepackable(loaded.model)
    need = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    if need == 0:  # every linear is quantized
        return False
    free = free_memory_bytes(device)
    if need > free // 2:  # a second copy must not crowd out the KV cache (or the machine)
        log.warning("not prepacking %s's linear weights: the copy needs %.2f GiB of %.2f GiB free; prefill "
                    "and batched decode run slower (--no-prepack-weights silences this)", loaded.name,
                    need / 2**30, free / 2**30)
        return False
    # oneDNN picks its blocking for a typical row count: a step's decode rows, within what packed serves.
    for m in layers:
        m.prepack(min(config.max_num_seqs, PACKED_MAX_ROWS))
    log.info("prepacked %s's dense linear weights for oneDNN: %.1f MB more", loaded.name, need / 1e6)
    return True


def _huge_pages(config: EngineConfig, loaded: LoadedModel, device: torch.device) -> Moved | None:
    """--huge-pages (CPU): the model's weights onto 2 MiB pages (engine/huge_pages.py), logged; what moved."""
    if not config.huge_pages or device.type != "cpu":
        return None
    why = huge_pages_usable()
    if why is not None:
        log.info("weights stay on small pages: %s", why)
        return None
    t0 = time.perf_counter()
    moved = move_to_huge_pages(loaded.model)
    log.info("%s's weights on huge pages: %s (%.2fs)", loaded.name, moved.describe(), time.perf_counter() - t0)
    return moved


def _calibrate(config: EngineConfig, target: LoadedModel, model: LlamaForCausalLM, backend: AttentionBackend,
               device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-head INT8 KV scales of `model` (engine/kv_calibration.py): one prefill at start-up, on prompts
    made with the target's tokenizer (a draft shares it)."""
    t = time.monotonic()
    prompts = calibration_prompts(target.tokenizer, model.rotary.max_position)
    scales = calibrate_kv_scales(model, backend, device, prompts, config.block_size)
    log.info("calibrated per-head INT8 KV scales on %d tokens in %.2fs", sum(map(len, prompts)),
             time.monotonic() - t)
    return scales


def _load_draft(config: EngineConfig, target: LoadedModel, device: torch.device, backend: AttentionBackend,
                max_model_len: int) -> LoadedModel | None:
    """The --draft-model (it must share the target's vocabulary); checks --draft-layers for self."""
    mcfg = target.config
    if (config.speculative == "self" and config.draft_layers is not None
            and config.draft_layers >= mcfg.num_hidden_layers):
        raise ConfigError(f"--draft-layers {config.draft_layers} must be fewer than the model's "
                          f"{mcfg.num_hidden_layers} layers")
    if config.speculative != "draft" or config.draft_model is None:
        return None
    draft = load_model(config.draft_model, config.dtype, device, backend, max_model_len, config.gguf_weights)
    _attach_cpu_kernels(config, draft, backend, device)
    _huge_pages(config, draft, device)
    if draft.config.vocab_size != mcfg.vocab_size:
        raise ConfigError(f"--draft-model vocabulary ({draft.config.vocab_size}) differs from the target's "
                          f"({mcfg.vocab_size}); a draft must share the target's tokenizer")
    if draft.config.max_position_embeddings < max_model_len and draft.config.rope_scaling.kind == "default":
        raise ConfigError(f"--draft-model max_position_embeddings {draft.config.max_position_embeddings} is "
                          f"below max_model_len {max_model_len}")
    return draft
