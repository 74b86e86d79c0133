"""`tokenloom quantize`: write a quantized checkpoint in Hugging Face folder form.

The format (and the reader, which the loader uses) is in quant/checkpoint.py. This module loads the
model through the ordinary loader, quantizes it as `--quantization` would, and writes the folder.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from tokenloom.attention.reference import ReferenceBackend
from tokenloom.errors import ConfigError
from tokenloom.models.config import ModelConfig
from tokenloom.models.loader import LoadedModel, load_model
from tokenloom.quant.checkpoint import QUANT_METHOD
from tokenloom.quant.embedding import QuantEmbedding
from tokenloom.quant.kquant import KQuantLinear
from tokenloom.quant.layout import LAYOUT_VERSION
from tokenloom.quant.linear import QuantLinear
from tokenloom.quant.parts import PartsLinear
from tokenloom.quant.weight_only import QUANTIZATIONS, quantize_model

_PARTS = ("codes", "scales", "mins", "bias")  # a quantized layer's buffers, stored as `<module path>.<part>`
_HF_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
             "chat_template.jinja")


def quantize_checkpoint(model: str | None, out: Path, method: str, group_size: int, gguf_weights: str = "keep") -> int:
    """Load `model` (HF folder, .gguf, None = the embedded default) in bfloat16 on CPU, quantize it as
    `--quantization method` would, write the folder `out`; returns the number of quantized layers."""
    if method not in QUANTIZATIONS:
        raise ConfigError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {method!r}")
    loaded = load_model(model, "bfloat16", torch.device("cpu"), ReferenceBackend(), gguf_weights=gguf_weights)
    _check_storable(loaded.model)
    quantize_model(loaded.model, method, group_size)
    out.mkdir(parents=True, exist_ok=True)
    tensors = _state(loaded.model)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if loaded.path.is_dir():
        hf = json.loads((loaded.path / "config.json").read_text())
        for name in _HF_FILES:
            if (loaded.path / name).is_file():
                shutil.copyfile(loaded.path / name, out / name)
    else:
        hf = hf_config(loaded.config)
        _check_round_trip(hf, loaded.config)
        _write_tokenizer(loaded, out)
    hf["torch_dtype"] = "bfloat16"
    hf["quantization_config"] = {"quant_method": QUANT_METHOD, "bits": 4 if method == "int4" else 8,
                                 "group_size": group_size, "code_layout": LAYOUT_VERSION}
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return sum(isinstance(m, QuantLinear) for m in loaded.model.modules())


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Quantized layers' buffers by module path; other parameters by HF name (fused ones split back)."""
    out: dict[str, torch.Tensor] = {}
    for path, module in model.named_modules():
        if isinstance(module, QuantLinear):
            for part in _PARTS:
                t = getattr(module, part)
                if t is not None:
                    out[f"{_hf_prefix(path)}.{part}"] = t.contiguous()
    a = model.layers[0].self_attn
    inter = model.config.intermediate_size
    splits = {"qkv_proj": (("q_proj", a.q_size), ("k_proj", a.kv_size), ("v_proj", a.kv_size)),
              "gate_up_proj": (("gate_proj", inter), ("up_proj", inter))}
    for name, p in model.named_parameters():  # tied parameters come once, under the embedding's name
        fused = next((f for f in splits if f".{f}." in name), None)
        if fused is None:
            out[_hf_prefix(name)] = p.data.contiguous()
            continue
        start = 0
        for part, size in splits[fused]:
            out[_hf_prefix(name.replace(fused, part))] = p.data[start:start + size].contiguous()
            start += size
    return out


def _check_storable(model: nn.Module) -> None:
    """A checkpoint stores int8/int4 codes (QuantLinear); a GGUF's K-quant layers and quantized token table
    have no form in it."""
    unstorable = (KQuantLinear, PartsLinear, QuantEmbedding)
    kept = sorted({type(m).__name__ for m in model.modules() if isinstance(m, unstorable)})
    if kept:
        raise ConfigError(f"this GGUF's layers kept as {', '.join(kept)} cannot be stored in a tokenloom checkpoint; "
                          "pass --gguf-weights dequantize to re-quantize them, or serve the .gguf itself (its "
                          "K-quants stay quantized)")


def _check_round_trip(hf: dict[str, Any], cfg: ModelConfig) -> None:
    """The config.json written for a GGUF must read back as the model that was quantized."""
    back = ModelConfig.from_hf_dict(hf)
    differ = [f.name for f in fields(ModelConfig)
              if f.name != "moe_layers" and getattr(back, f.name) != getattr(cfg, f.name)]
    layers = range(cfg.num_hidden_layers)
    if [back.layer_is_moe(i) for i in layers] != [cfg.layer_is_moe(i) for i in layers]:
        differ.append("moe_layers")  # () and all-True both mean every layer
    if differ:
        raise ConfigError(f"{cfg.architecture}: this GGUF's config has no config.json form tokenloom reads back "
                          f"({', '.join(differ)} would differ)")


def _hf_prefix(name: str) -> str:
    return name if name.startswith("lm_head") else f"model.{name}"


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json transformers (and ModelConfig.from_hf_dict) read for a GGUF's model."""
    r = cfg.rope_scaling
    rope = None if r.kind == "default" else {
        "rope_type": r.kind, "factor": r.factor, "original_max_position_embeddings": r.original_max_position_embeddings,
        "low_freq_factor": r.low_freq_factor, "high_freq_factor": r.high_freq_factor,
        "beta_fast": r.beta_fast, "beta_slow": r.beta_slow}
    if r.kind == "longrope" and rope is not None:  # Phi-3
        rope |= {"short_factor": list(r.short_factor), "long_factor": list(r.long_factor),
                 "attention_factor": r.attention_factor}
    return _gemma_hf(cfg) | _moe_hf(cfg) | {
        "architectures": [cfg.architecture], "model_type": cfg.architecture.removesuffix("ForCausalLM").lower(),
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": rope, "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias, "mlp_bias": cfg.mlp_bias, "sliding_window": cfg.sliding_window,
        "use_sliding_window": cfg.sliding_window is not None, "hidden_act": cfg.hidden_act,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids),
        "partial_rotary_factor": cfg.partial_rotary_factor,
    }


def _gemma_hf(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.family != "gemma":
        return {}
    return {"layer_types": list(cfg.layer_types), "rope_local_base_freq": cfg.rope_local_theta,
            "query_pre_attn_scalar": cfg.query_pre_attn_scalar, "final_logit_softcapping": cfg.final_logit_softcapping,
            "attn_logit_softcapping": cfg.attn_logit_softcapping, "hidden_activation": cfg.hidden_act}


def _moe_hf(cfg: ModelConfig) -> dict[str, Any]:
    """Mixtral's experts are intermediate_size wide; Qwen2/3-MoE's moe_intermediate_size, with dense layers
    listed in mlp_only_layers."""
    if not cfg.num_experts:
        return {}
    out: dict[str, Any] = {"num_local_experts": cfg.num_experts, "num_experts": cfg.num_experts,
                           "num_experts_per_tok": cfg.num_experts_per_tok, "norm_topk_prob": cfg.norm_topk_prob,
                           "moe_intermediate_size": cfg.moe_intermediate_size,
                           "mlp_only_layers": [i for i in range(cfg.num_hidden_layers) if not cfg.layer_is_moe(i)],
                           "decoder_sparse_step": 1}
    if cfg.shared_expert_intermediate_size:
        out["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    return out


def _write_tokenizer(loaded: LoadedModel, out: Path) -> None:
    tok = loaded.tokenizer
    tok.backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": tok.bos_token, "eos_token": tok.eos_token, "chat_template": tok.chat_template,
        "add_bos_token": tok.add_bos_token}, indent=2) + "\n")
    eos = list(dict.fromkeys([*tok.stop_token_ids, *loaded.config.eos_token_ids]))
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": loaded.config.bos_token_id, "eos_token_id": eos}, indent=2) + "\n")
