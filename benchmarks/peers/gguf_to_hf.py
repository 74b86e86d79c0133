"""Write a GGUF model out as a Hugging Face folder (config.json, model.safetensors, tokenizer files).

Peers that cannot read GGUF (vLLM, transformers) then serve exactly the weights tokenloom and
llama.cpp serve: the GGUF tensors dequantized to --dtype, with llama.cpp's q/k row permutation undone.

    python benchmarks/peers/gguf_to_hf.py OUT_DIR [--gguf FILE] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tokenloom.models.config import ModelConfig
from tokenloom.models.default import default_model_path
from tokenloom.models.gguf import load_gguf


def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    rs = cfg.rope_scaling
    scaling = None if rs.kind == "default" else {
        k: v for k, v in {"rope_type": rs.kind, "factor": rs.factor,
                          "original_max_position_embeddings": rs.original_max_position_embeddings,
                          "low_freq_factor": rs.low_freq_factor, "high_freq_factor": rs.high_freq_factor}.items()
        if v is not None}
    return {
        "architectures": [cfg.architecture],
        "model_type": {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                       "Qwen2ForCausalLM": "qwen2"}[cfg.architecture],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": scaling,
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias, "hidden_act": cfg.hidden_act, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) if len(cfg.eos_token_ids) != 1 else cfg.eos_token_ids[0],
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--gguf", type=Path, default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    src = args.gguf or default_model_path()
    cfg, sd, tok = load_gguf(src, torch.float32)
    args.out.mkdir(parents=True, exist_ok=True)
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    save_file({k: v.to(dtype).contiguous() for k, v in sd.items()}, str(args.out / "model.safetensors"),
              metadata={"format": "pt"})
    (args.out / "config.json").write_text(json.dumps(hf_config(cfg, dtype), indent=2))
    tok.backend.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": tok.bos_token, "eos_token": tok.eos_token, "chat_template": tok.chat_template,
        "add_bos_token": tok.add_bos_token, "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": cfg.max_position_embeddings}, indent=2))
    if cfg.eos_token_ids:
        (args.out / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids)}, indent=2))
    print(f"{src} -> {args.out} ({len(sd)} tensors, {args.dtype})")


if __name__ == "__main__":
    main()
