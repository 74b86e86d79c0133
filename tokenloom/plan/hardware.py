"""Analytic step costs from a hardware spec and the model's shapes: a roofline, marked "analytic, not measured".

A step is bound by compute or by memory traffic, whichever takes longer:
  flops = 2 * dense_params * tokens + 2 * lm_head_params * rows + attention (4 * layers * heads * head_dim
          per (query, key) pair)
  bytes = weight bytes (every weight read once per step) + KV read (every key a query attends to, once per
          row) + KV written (each new token)
  time  = max(flops / (peak * mfu), bytes / (bandwidth * mbu)) + tp all-reduce + fixed overhead per step.
mfu / mbu are the fractions of peak a good engine reaches (stated in each spec; datasheet peaks are never
reached); `overhead_s` is the host's share of a step (scheduling, launches). Tensor parallelism over `tp`
devices divides flops and bytes and adds two all-reduces of (tokens, hidden) activations per layer over
the interconnect. These numbers extrapolate: nothing here was measured.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from tokenloom.errors import ConfigError
from tokenloom.models.config import ModelConfig
from tokenloom.plan.cost_model import Row

ANALYTIC = "analytic, not measured"


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    peak_flops: float  # dense bf16 FLOP/s of one device (datasheet)
    mem_bandwidth: float  # bytes/s of one device's memory (datasheet)
    mem_bytes: float  # memory of one device
    link_bandwidth: float  # bytes/s between devices / nodes (KV transfer, tensor-parallel all-reduce)
    link_latency_s: float  # one message's latency over that link
    mfu: float = 0.5  # fraction of peak_flops a step's matmuls reach
    mbu: float = 0.7  # fraction of mem_bandwidth a step's reads reach
    overhead_s: float = 0.002  # host time per step (scheduling, kernel launches)
    kv_memory_fraction: float = 0.9  # of the memory left after the weights, what the KV cache gets
    note: str = ""

    def __post_init__(self) -> None:
        for f in ("peak_flops", "mem_bandwidth", "mem_bytes", "link_bandwidth"):
            if not getattr(self, f) > 0:
                raise ConfigError(f"hardware spec {self.name!r}: {f} must be > 0")
        if not (0 < self.mfu <= 1 and 0 < self.mbu <= 1 and 0 < self.kv_memory_fraction <= 1):
            raise ConfigError(f"hardware spec {self.name!r}: mfu, mbu and kv_memory_fraction must be in (0, 1]")


# Datasheet figures (dense bf16, no sparsity). The CPU lines are estimates from the core's vector width
# and clock and from typical per-socket DDR5 bandwidth; they are marked as such.
SPECS: dict[str, HardwareSpec] = {s.name: s for s in (
    HardwareSpec("H100", 989e12, 3.35e12, 80e9, 450e9, 5e-6, note="H100 SXM5; NVLink 4 (450 GB/s each way)"),
    HardwareSpec("H200", 989e12, 4.8e12, 141e9, 450e9, 5e-6, note="H200 SXM; NVLink 4 (450 GB/s each way)"),
    HardwareSpec("L4", 121e12, 300e9, 24e9, 32e9, 10e-6, note="L4 PCIe; PCIe Gen4 x16 (32 GB/s each way)"),
    HardwareSpec("epyc-zen4-2core", 2 * 3.0e9 * 64, 20e9, 24e9, 10e9, 50e-6, mfu=0.4, mbu=0.6, overhead_s=0.004,
                 note="2 Zen 4 cores at ~3 GHz, AVX512-BF16 (64 FLOP/cycle/core); ~20 GB/s of a VM's DDR5; estimate"),
    HardwareSpec("xeon-spr-56core", 56 * 2.0e9 * 1024, 307e9, 512e9, 25e9, 20e-6, mfu=0.3, mbu=0.6, overhead_s=0.004,
                 note="Sapphire Rapids 8480+, AMX bf16 (1024 FLOP/cycle/core), 8 x DDR5-4800; estimate"),
)}

# Shapes of models the docs' extrapolations use (the public config.json values), so no download is needed.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "smollm2-135m": {"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
                     "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "max_position_embeddings": 8192, "tie_word_embeddings": True},
    "llama-3.1-8b": {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
                     "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "max_position_embeddings": 131072, "tie_word_embeddings": False},
}


def load_spec(name_or_path: str) -> HardwareSpec:
    """A shipped spec by name, or a JSON file with HardwareSpec's fields."""
    if name_or_path in SPECS:
        return SPECS[name_or_path]
    p = Path(name_or_path)
    if not p.is_file():
        raise ConfigError(f"unknown hardware {name_or_path!r}: give one of {', '.join(SPECS)} or a JSON spec file")
    try:
        return HardwareSpec(**json.loads(p.read_text()))
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{p}: not a hardware spec ({e})") from None


def load_model_shape(model: str) -> ModelConfig:
    """A preset name, an HF folder / config.json, or a GGUF file."""
    if model in MODEL_PRESETS:
        return ModelConfig.from_hf_dict(MODEL_PRESETS[model])
    p = Path(model)
    if p.suffix == ".gguf" and p.is_file():
        from tokenloom.models.gguf import config_from_gguf
        from tokenloom.models.gguf_file import read_gguf

        return config_from_gguf(read_gguf(p))
    if p.name == "config.json" and p.is_file():
        return ModelConfig.from_hf_dict(json.loads(p.read_text()))
    if p.is_dir() and (p / "config.json").is_file():
        return ModelConfig.from_hf_folder(p)
    raise ConfigError(f"unknown model {model!r}: give one of {', '.join(MODEL_PRESETS)}, an HF folder, a config.json "
                      f"or a .gguf file")


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs of a model (from its ModelConfig)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    dense_params: float  # the layers' weights (attention projections + MLP), per token's matmuls
    lm_head_params: float  # hidden x vocab, run for sampled rows only
    weight_bytes_per_param: float  # 2 for bf16
    kv_bytes_per_value: float  # 2 for bf16 K/V

    @classmethod
    def of(cls, cfg: ModelConfig, weight_bytes_per_param: float = 2.0, kv_bytes_per_value: float = 2.0) -> ModelShape:
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        attn = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size
        if cfg.num_experts:  # a MoE token runs k experts; dense layers keep intermediate_size
            mlp = 3 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.num_experts_per_tok
        else:
            mlp = 3 * cfg.hidden_size * cfg.intermediate_size
        return cls(cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                   cfg.head_dim, float(cfg.num_hidden_layers * (attn + mlp)), float(cfg.hidden_size * cfg.vocab_size),
                   weight_bytes_per_param, kv_bytes_per_value)

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes_per_value  # K and V

    @property
    def weight_bytes(self) -> float:
        return (self.dense_params + self.lm_head_params) * self.weight_bytes_per_param


@dataclass(frozen=True)
class RooflineStepCost:
    """The roofline time of a step of `rows` on `spec` (see the module docstring), `tp` devices per worker."""

    spec: HardwareSpec
    shape: ModelShape
    tp: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ConfigError(f"--tp must be >= 1, got {self.tp}")

    def step_parts(self, rows: Sequence[Row]) -> dict[str, float]:
        """flops, bytes and the seconds of each bound, for tests and reports."""
        s, m = self.spec, self.shape
        tokens = sum(n for n, _ in rows)
        # Keys each query attends to: a decode row reads c + 1, a chunk of n after c reads c + (n + 1) / 2 on average.
        pairs = sum(n * (c + (n + 1) / 2) for n, c in rows)
        keys_read = sum(c + n for n, c in rows)  # each row streams its whole context's K/V once
        flops = 2 * m.dense_params * tokens + 2 * m.lm_head_params * len(rows) + 4 * m.layers * m.heads * m.head_dim * pairs
        nbytes = m.weight_bytes + m.kv_bytes_per_token * (keys_read + tokens)
        compute = flops / (s.peak_flops * s.mfu * self.tp)
        memory = nbytes / (s.mem_bandwidth * s.mbu * self.tp)
        allreduce = 0.0
        if self.tp > 1:  # ring all-reduce of (tokens, hidden) bf16 after attention and after the MLP
            per = 2 * (self.tp - 1) / self.tp * tokens * m.hidden * 2
            allreduce = 2 * m.layers * (per / s.link_bandwidth + s.link_latency_s)
        return {"flops": flops, "bytes": nbytes, "compute_s": compute, "memory_s": memory, "allreduce_s": allreduce,
                "overhead_s": s.overhead_s}

    def step_time(self, rows: Sequence[Row]) -> float:
        p = self.step_parts(rows)
        return max(p["compute_s"], p["memory_s"]) + p["allreduce_s"] + p["overhead_s"]

    def kv_capacity_tokens(self) -> int:
        """Tokens of K/V that fit in the worker's memory after its weights."""
        free = self.spec.mem_bytes * self.tp - self.shape.weight_bytes
        if free <= 0:
            raise ConfigError(f"{self.shape.weight_bytes / 1e9:.1f} GB of weights do not fit in {self.tp} x "
                              f"{self.spec.mem_bytes / 1e9:.0f} GB of {self.spec.name}; raise --tp")
        return int(free * self.spec.kv_memory_fraction / self.shape.kv_bytes_per_token)

    def to_json(self) -> dict[str, Any]:
        return {"kind": "roofline", "spec": asdict(self.spec), "shape": asdict(self.shape), "tp": self.tp}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RooflineStepCost:
        return cls(HardwareSpec(**d["spec"]), ModelShape(**d["shape"]), int(d.get("tp", 1)))


def with_overrides(spec: HardwareSpec, **changes: float | None) -> HardwareSpec:
    """`spec` with the given fields replaced (None: kept), validated again."""
    return replace(spec, **{k: v for k, v in changes.items() if v is not None})
