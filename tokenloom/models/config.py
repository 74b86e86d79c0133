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
    "MixtralForCausalLM": "llama",  # Mistral layout, every MLP a sparse mixture of experts (models/moe.py)
    "Qwen3MoeForCausalLM": "llama",  # Qwen3 layout, MoE MLPs (dense ones where mlp_only_layers says so)
    "Qwen2MoeForCausalLM": "llama",  # Qwen2 layout, MoE MLPs with a gated shared expert
    "Gemma3ForCausalLM": "gemma",  # interleaved sliding/global layers, 4 norms a layer, q/k norm (models/gemma.py)
    "Gemma2ForCausalLM": "gemma",  # Gemma 3 without q/k norm, one RoPE base, attention and final logits soft-capped
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
    # Gemma 2/3 (models/gemma.py). The sliding-window layers' RoPE base (None: rope_theta, and no rope_scaling).
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None  # attention scale = query_pre_attn_scalar**-0.5 (None: head_dim)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    # Gemma 2: every layer's scaled attention scores -> cap * tanh(scores / cap) before the mask and softmax
    # (the attention backends' `softcap`); None: off.
    attn_logit_softcapping: float | None = None
    # Mixture of experts (models/moe.py); num_experts 0 means every layer has a dense SwiGLU MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # k: experts each token is routed to
    moe_intermediate_size: int = 0  # each expert's SwiGLU width (Mixtral: intermediate_size)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a sigmoid-gated SwiGLU every token runs (0: none)
    norm_topk_prob: bool = True  # the k routing weights are renormalised to sum to 1
    router: str = "softmax_topk"  # "topk_softmax": softmax over the k best logits (Mixtral) | "softmax_topk":
    #                               softmax over all experts, then the k best (Qwen3-MoE)
    # Per layer: True where the MLP is a MoE block; empty means every layer (when num_experts > 0).
    # Qwen3-MoE's mlp_only_layers / decoder_sparse_step make some layers dense (intermediate_size wide).
    moe_layers: tuple[bool, ...] = ()
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

    def layer_is_moe(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts (else a dense SwiGLU)."""
        return self.num_experts > 0 and (not self.moe_layers or self.moe_layers[layer])

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
        if SUPPORTED_ARCHITECTURES[arch] == "gemma":
            cfg = _gemma_flat(arch, cfg)
        if cfg.get("hidden_act", "silu") not in _ACTIVATIONS[SUPPORTED_ARCHITECTURES[arch]]:
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
        qwen3 = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        head_dim = int(cfg.get("head_dim") or hidden // n_heads)
        partial = float(cfg.get("partial_rotary_factor", rope_params.get("partial_rotary_factor", 1.0)) or 1.0)
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        if arch == "Phi3ForCausalLM" and str(rope_scaling_d.get("rope_type") or rope_scaling_d.get("type")) == "yarn":
            rope_scaling_d["rope_type"] = "longrope"  # Phi3Config reads "su" and "yarn" as longrope
        if (arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
                and not cfg.get("use_sliding_window", False)):
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
            attention_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", arch in ("Qwen2ForCausalLM",
                                                                                       "Qwen2MoeForCausalLM")))),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            o_proj_bias=qwen3 and bool(cfg.get("attention_bias", False)),
            qk_norm=qwen3 or arch == "Gemma3ForCausalLM",
            partial_rotary_factor=partial,
            sliding_window=int(sliding) if sliding else None,
            # Qwen2 (max_window_layers), Gemma 2/3: which layers the window applies to
            layer_types=tuple(str(t) for t in cfg.get("layer_types") or ()),
            hidden_act=str(cfg.get("hidden_act", "silu")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **_moe_fields(arch, cfg),
            **_gemma_fields(arch, cfg),
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


# The MLP activations each family implements (Gemma's GeGLU is tanh-approximated GELU).
_ACTIVATIONS: dict[str, tuple[str, ...]] = {"llama": ("silu", "swish"), "gemma": ("gelu_pytorch_tanh",)}


def _gemma_flat(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 2/3 config.json in the flat shape from_hf_dict reads: the global layers' RoPE (transformers 5
    nests it under rope_parameters["full_attention"], 4 writes rope_theta + rope_scaling) as rope_theta /
    rope_scaling, `hidden_activation` as hidden_act, and Gemma's defaults where the file omits a field."""
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedArchitecture(f"{arch}: use_bidirectional_attention (an embedding model) is not supported")
    out = dict(cfg)
    params = dict(cfg.get("rope_parameters") or {})
    full = dict(params.get("full_attention") or ({} if "sliding_attention" in params else params))
    out["rope_theta"] = float(full.get("rope_theta", cfg.get("rope_theta", 1e6 if arch == "Gemma3ForCausalLM" else 1e4)))
    out["rope_scaling"] = {k: v for k, v in (full or dict(cfg.get("rope_scaling") or {})).items() if k != "rope_theta"}
    out.pop("rope_parameters", None)
    local = dict(params.get("sliding_attention") or {})
    if str(local.get("rope_type", "default")) != "default":
        raise UnsupportedArchitecture(f"{arch}: rope scaling {local['rope_type']!r} on the sliding-window layers")
    if "rope_theta" in local:
        out["rope_local_base_freq"] = local["rope_theta"]
    out["hidden_act"] = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    out.setdefault("tie_word_embeddings", True)
    n_layers = int(cfg["num_hidden_layers"])
    # Gemma 3: every `sliding_window_pattern`-th layer is global (5 local : 1 global); Gemma 2 alternates.
    pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
                  or (6 if arch == "Gemma3ForCausalLM" else 2))
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                       for i in range(n_layers)]
    if len(types) != n_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ModelLoadError(f"{arch}: layer_types must name sliding_attention / full_attention for each of "
                             f"{n_layers} layers")
    out["layer_types"] = list(types)
    return out


def _gemma_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's Gemma fields from a (flattened) Gemma 2/3 config.json ({} for other families)."""
    if SUPPORTED_ARCHITECTURES.get(arch) != "gemma":
        return {}
    local = float(cfg.get("rope_local_base_freq") or 10000.0) if arch == "Gemma3ForCausalLM" else None
    return dict(rope_local_theta=local,
                query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256),
                final_logit_softcapping=softcap(cfg.get("final_logit_softcapping"), f"{arch}: final_logit_softcapping"),
                attn_logit_softcapping=softcap(cfg.get("attn_logit_softcapping"), f"{arch}: attn_logit_softcapping"))


def softcap(value: Any, what: str) -> float | None:
    """A soft-capping value from a config or GGUF file: None (off) or a positive number; anything else is an
    error naming `what` (cap * tanh(x / cap) with cap <= 0 is no cap at all)."""
    if value is None:
        return None
    try:
        cap = float(value)
    except (TypeError, ValueError):
        raise ModelLoadError(f"{what} must be a positive number or null, got {value!r}") from None
    if not cap > 0 or math.isinf(cap):
        raise ModelLoadError(f"{what} must be a positive number or null, got {value!r}")
    return cap


def _moe_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields from a Mixtral / Qwen2-MoE / Qwen3-MoE config.json ({} for dense
    models)."""
    if arch not in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return {}
    # transformers 5 writes Qwen3-MoE's num_experts under its alias num_local_experts
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    k = int(cfg.get("num_experts_per_tok") or 0)
    if not 0 < k <= experts:
        raise ModelLoadError(f"{arch}: num_experts_per_tok {k} must be in 1..num_experts ({experts})")
    n_layers = int(cfg["num_hidden_layers"])
    if arch == "MixtralForCausalLM":
        return dict(num_experts=experts, num_experts_per_tok=k, moe_intermediate_size=int(cfg["intermediate_size"]),
                    norm_topk_prob=True, router="topk_softmax")
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    return dict(num_experts=experts, num_experts_per_tok=k, moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), router="softmax_topk",
                moe_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(n_layers)),
                shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
                if arch == "Qwen2MoeForCausalLM" else 0)


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
