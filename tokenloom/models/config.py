"""The model hyper-parameters every architecture file reads, from config.json or GGUF metadata."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenloom.errors import ModelLoadError, UnsupportedArchitecture

# HF `architectures[0]` -> our family file. GGUF `general.architecture` values map in gguf.py.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",  # Llama layout + per-head RMSNorm on q and k (qk_norm)
    "Phi3ForCausalLM": "llama",  # Llama layout with fused qkv/gate_up tensors, longrope, partial rotary (Phi-4-mini)
}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling as in HF ``rope_scaling`` / ``rope_parameters`` (kind "default" means none)."""

    kind: str = "default"  # default | linear | dynamic | llama3 | yarn | longrope
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    attention_factor: float | None = None  # yarn, longrope (the cos/sin multiplier)
    # longrope (Phi-3 "su"): per-frequency divisors, short below original_max_position_embeddings, long from it on
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # HF class name, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: q/k/v have bias, o does not
    mlp_bias: bool = False
    o_proj_bias: bool = False  # Qwen3: o_proj has a bias when attention_bias is set (Qwen2's does not)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k after projection, before RoPE
    partial_rotary_factor: float = 1.0  # Phi-4-mini 0.75: RoPE turns only the first rotary_dim of each head
    sliding_window: int | None = None  # Mistral; None = full attention
    # Per-layer attention kind, as HF's `layer_types` ("sliding_attention" / "full_attention"); empty means
    # every layer has `sliding_window`. Gemma 2/3 interleave windowed and global layers.
    layer_types: tuple[str, ...] = ()
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    def layer_window(self, layer: int) -> int | None:
        """The attention window of layer `layer` (None: the layer attends to the whole context)."""
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head RoPE rotates (head_dim unless partial_rotary_factor < 1)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else f"<model_type={cfg.get('model_type')}>"
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitecture(
                f"unsupported model architecture {arch!r}; tokenloom supports "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
            raise UnsupportedArchitecture(f"{arch}: unsupported hidden_act {cfg.get('hidden_act')!r}")
        n_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        # transformers v5 folds rope_theta into `rope_parameters`; v4 keeps `rope_theta` + `rope_scaling`.
        rope_params = dict(cfg.get("rope_parameters") or {})
        rope_scaling_d = dict(cfg.get("rope_scaling") or {}) or rope_params
        theta = float(cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0)))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        sliding = cfg.get("sliding_window")
        qwen3 = arch == "Qwen3ForCausalLM"
        head_dim = int(cfg.get("head_dim") or hidden // n_heads)
        partial = float(cfg.get("partial_rotary_factor", rope_params.get("partial_rotary_factor", 1.0)) or 1.0)
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        if arch == "Phi3ForCausalLM" and str(rope_scaling_d.get("rope_type") or rope_scaling_d.get("type")) == "yarn":
            rope_scaling_d["rope_type"] = "longrope"  # Phi3Config reads "su" and "yarn" as longrope
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not cfg.get("use_sliding_window", False):
            sliding = None
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=n_heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=parse_rope_scaling(rope_scaling_d, max_pos, cfg.get("original_max_position_embeddings"),
                                            int(head_dim * partial)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            o_proj_bias=qwen3 and bool(cfg.get("attention_bias", False)),
            qk_norm=qwen3,
            partial_rotary_factor=partial,
            sliding_window=int(sliding) if sliding else None,
            hidden_act=str(cfg.get("hidden_act", "silu")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_hf_folder(cls, folder: Path) -> "ModelConfig":
        path = folder / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{folder}: no config.json (not a Hugging Face model folder)")
        cfg = read_config_json(folder)
        try:
            return cls.from_hf_dict(cfg)
        except KeyError as e:
            raise ModelLoadError(f"{path}: missing field {e}") from e
        except (TypeError, ValueError, ZeroDivisionError) as e:
            raise ModelLoadError(f"{path}: invalid field value ({e})") from e


def read_config_json(folder: Path) -> dict[str, Any]:
    """`folder`/config.json as a dict; ModelLoadError (one line, naming the file) when it is not one."""
    path = folder / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e})") from e
    except (OSError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read ({e})") from e
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def parse_rope_scaling(d: dict[str, Any], max_position_embeddings: int | None = None,
                       original_max: Any = None, rotary_dim: int | None = None) -> RopeScaling:
    """`original_max`: the top-level original_max_position_embeddings (Phi-3 keeps it outside rope_scaling)."""
    kind = str(d.get("rope_type") or d.get("type") or "default")
    if kind == "su":
        kind = "longrope"
    if kind not in ("default", "linear", "dynamic", "llama3", "yarn", "longrope"):
        raise UnsupportedArchitecture(f"unsupported rope scaling type {kind!r}")
    orig = d.get("original_max_position_embeddings") or original_max
    if kind == "longrope":
        return _longrope(d, max_position_embeddings, orig, rotary_dim)
    return RopeScaling(
        kind=kind,
        factor=float(d.get("factor", 1.0)),
        original_max_position_embeddings=int(orig) if orig else None,
        low_freq_factor=float(d.get("low_freq_factor", 1.0)),
        high_freq_factor=float(d.get("high_freq_factor", 4.0)),
        beta_fast=float(d.get("beta_fast", 32.0)),
        beta_slow=float(d.get("beta_slow", 1.0)),
        mscale=d.get("mscale"),
        mscale_all_dim=d.get("mscale_all_dim"),
        attention_factor=d.get("attention_factor"),
    )


def _longrope(d: dict[str, Any], max_position_embeddings: int | None, orig: Any, rotary_dim: int | None) -> RopeScaling:
    """LongRoPE as transformers' `_compute_longrope_parameters`: the attention factor from `factor` (else the
    ratio max_position_embeddings / original_max_position_embeddings), sqrt(1 + ln f / ln original) when f > 1."""
    short, long = d.get("short_factor"), d.get("long_factor")
    if not orig or not isinstance(short, list) or not isinstance(long, list):
        raise UnsupportedArchitecture("longrope scaling needs short_factor, long_factor and original_max_position_embeddings")
    orig = int(orig)
    if rotary_dim is not None and not len(short) == len(long) == rotary_dim // 2:
        raise UnsupportedArchitecture(f"longrope factors must have rotary_dim/2 = {rotary_dim // 2} entries, "
                                      f"got {len(short)} and {len(long)}")
    factor = d.get("factor")
    if factor is None:
        factor = (max_position_embeddings or orig) / orig
    attention = d.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return RopeScaling(kind="longrope", factor=float(factor), original_max_position_embeddings=orig,
                       attention_factor=float(attention), short_factor=tuple(float(x) for x in short),
                       long_factor=tuple(float(x) for x in long))
