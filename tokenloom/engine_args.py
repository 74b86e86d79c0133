"""The engine's command-line flags, built from EngineConfig's fields, and the way back.

Each field is a --flag of the same name (underscores become dashes; `enable_prefix_caching` is
--prefix-caching): its default is the field's, its kind follows the field's type (bool: --x / --no-x;
int; a config.py vocabulary: its values are the choices), its help is in ENGINE_FLAGS below.
`tokenloom generate | serve | eval perplexity`, `bench offline` and `cluster` take these flags;
`engine_config` turns parsed flags into an EngineConfig, `engine_argv` into the flags that reproduce them.
"""

from __future__ import annotations

import argparse
import types
from dataclasses import dataclass, fields
from typing import Any, Union, get_args, get_origin, get_type_hints

from tokenloom.config import EngineConfig, vocabulary

ENGINE = "engine"
SPECULATIVE = "speculative decoding"


@dataclass(frozen=True)
class EngineFlag:
    field: str  # the EngineConfig field
    help: str | None = None
    group: str = ENGINE  # the --help section
    name: str | None = None  # the flag, when it is not --field-name

    @property
    def option(self) -> str:
        return self.name or "--" + self.field.replace("_", "-")


# Every EngineConfig field once, in the order --help lists them.
ENGINE_FLAGS: tuple[EngineFlag, ...] = (
    EngineFlag("model", "HF model folder or .gguf file (default: embedded SmolLM2-135M-Instruct)"),
    EngineFlag("dtype"),
    EngineFlag("device", "auto | cpu | cuda | cuda:N"),
    EngineFlag("block_size", "tokens per KV block"),
    EngineFlag("kv_cache_memory", "KV budget: bytes (2GiB, 512MB) or fraction of free memory (0.3)"),
    EngineFlag("max_model_len", "max prompt + output tokens per sequence"),
    EngineFlag("max_num_seqs", "max sequences per step"),
    EngineFlag("max_num_batched_tokens", "token budget per step"),
    EngineFlag("attention_backend", "auto: C++ paged kernel on CPU (sdpa if it cannot build), sdpa on CUDA"),
    EngineFlag("fused_decode", "cpu backend: run a pure decode step's layers in one C++ call (same results as the "
                               "layer-by-layer Python path, which --no-fused-decode forces)"),
    EngineFlag("prepack_weights", "cpu, bfloat16: keep a oneDNN-blocked copy of each dense linear weight for "
                                  "matmuls of 2-256 rows (batched decode, verification: AMX where the CPU has "
                                  "it); a second copy of those weights"),
    EngineFlag("huge_pages", "cpu, Linux: move the weights onto 2 MiB pages after loading (transparent huge "
                             "pages, madvise), for the memory-bound decode step; no effect where the kernel's "
                             "THP mode is never"),
    EngineFlag("quantization", "weight-only quantization of the decoder's linear layers at load (CPU, bfloat16)"),
    EngineFlag("quant_group_size", "int4 group size"),
    EngineFlag("quant_tile_max_rows", "quantized weights (cpu): the kernels that read the codes (int8 "
                                      "activations by VNNI, AMX tiles where the CPU has AMX and they measure "
                                      "faster) up to this many rows of x, the weight expanded to bf16 for oneDNN "
                                      "beyond; default: measured at start-up"),
    EngineFlag("gguf_weights", "keep: a GGUF's Q8_0/Q4_0/Q4_1 linear weights run quantized (bfloat16 on CPU); "
                               "dequantize: expand them to --dtype at load"),
    EngineFlag("kv_cache_dtype", "auto: the model's dtype; int8: int8 codes with float16 scales (see "
                                 "--kv-cache-scales)"),
    EngineFlag("kv_cache_scales", "int8 KV scales. head: one per layer and head, calibrated at start-up (exactly "
                                  "2x the tokens of a 16-bit cache; values beyond the calibrated range "
                                  "saturate); token: one per token and head, stored with the codes (never "
                                  "saturates; 1.94x the tokens at head size 64)"),
    EngineFlag("enable_prefix_caching", "reuse the K/V of full blocks across requests with a common prefix (on by "
                                        "default)", name="--prefix-caching"),
    EngineFlag("seed", "sampler seed for requests without their own"),
    EngineFlag("speculative", "ngram: prompt lookup; draft: a small model (--draft-model); self: the target's "
                              "first --draft-layers layers", SPECULATIVE),
    EngineFlag("num_speculative_tokens", "draft tokens verified per step", SPECULATIVE),
    EngineFlag("draft_model", "HF folder or .gguf of a draft sharing the tokenizer", SPECULATIVE),
    EngineFlag("draft_layers", "self-draft: layers of the target to use", SPECULATIVE),
    EngineFlag("prompt_lookup_max", "ngram: longest n-gram", SPECULATIVE),
    EngineFlag("prompt_lookup_min", "ngram: shortest n-gram", SPECULATIVE),
    EngineFlag("num_threads", "torch CPU threads"),
)


def flag_kind(hint: Any) -> dict[str, Any]:
    """The add_argument keywords a field of this type gets: its vocabulary as choices, a bool as
    --x / --no-x, an int as type=int (None allowed or not: None is only ever the default)."""
    values = vocabulary(hint)
    if values is not None:
        choices = values[0]
        return {"choices": choices, "type": int} if all(type(v) is int for v in choices) else {"choices": choices}
    if get_origin(hint) in (Union, types.UnionType):
        hint = next(a for a in get_args(hint) if a is not type(None))
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    if hint is int:
        return {"type": int}
    return {}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Every EngineConfig field as a --flag (see the module docstring)."""
    defaults = EngineConfig()
    hints = get_type_hints(EngineConfig)
    groups: dict[str, Any] = {}  # argparse's argument groups, by title, made as first needed
    for f in ENGINE_FLAGS:
        if f.group not in groups:
            groups[f.group] = p.add_argument_group(f.group)
        groups[f.group].add_argument(f.option, dest=f.field, default=getattr(defaults, f.field), help=f.help,
                                     **flag_kind(hints[f.field]))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of parsed engine flags."""
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags that reproduce `args`: those whose values differ from EngineConfig's defaults."""
    defaults = EngineConfig()
    hints = get_type_hints(EngineConfig)
    argv: list[str] = []
    for f in ENGINE_FLAGS:
        value = getattr(args, f.field)
        if value == getattr(defaults, f.field):
            continue
        if hints[f.field] is bool:
            argv.append(f.option if value else "--no-" + f.option[2:])
        else:
            argv += [f.option, str(value)]
    return argv
