"""Engine configuration: one frozen dataclass, the same names as the CLI flags (--max-num-seqs, ...)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tokenloom.errors import ConfigError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


SPECULATIVE_METHODS = (None, "ngram", "draft", "self")
KV_CACHE_SCALES = ("head", "token")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF folder or .gguf file; None = embedded SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    block_size: int = 16  # tokens per KV block
    kv_cache_memory: str = "2GiB"  # bytes ("2GiB", "512MB", "1000000") or a fraction of free memory ("0.3")
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    max_num_seqs: int = 128  # sequences in one step
    max_num_batched_tokens: int = 512  # tokens in one step: decodes + prefill chunks
    attention_backend: str = "auto"  # auto | cpu | sdpa | reference
    fused_decode: bool = True  # CPU backend: a pure decode step runs the layer stack in one C++ call
    # CPU, bfloat16: also hold each dense linear weight in oneDNN's blocked layout, for matmuls of 2-256
    # rows (batched decode, verification); costs a second copy of those weights.
    prepack_weights: bool = True
    quantization: str | None = None  # None | "int8" (per channel) | "int4" (group-wise): weight-only
    quant_group_size: int = 128  # int4 group size (a smaller supported one where it does not divide a layer)
    gguf_weights: str = "keep"  # keep | dequantize: GGUF Q8_0/Q4_0/Q4_1 linear weights stay quantized (bf16, CPU)
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | int8 (codes and float16 scales)
    # int8 scales: head (one per layer and head, calibrated at start-up: 2x the tokens of 16 bits) |
    # token (one per token and head, stored with the codes: nothing saturates, 1.94x at head_dim 64)
    kv_cache_scales: str = "head"
    enable_prefix_caching: bool = True  # share the K/V of full blocks between requests with a common prefix
    # Speculative decoding: None | "ngram" (prompt lookup) | "draft" (--draft-model) | "self" (first
    # --draft-layers layers of the target). k = num_speculative_tokens drafts verified per step.
    speculative: str | None = None
    num_speculative_tokens: int = 4
    draft_model: str | None = None
    draft_layers: int | None = None
    prompt_lookup_max: int = 4  # ngram: longest suffix n-gram to match
    prompt_lookup_min: int = 2  # ngram: shortest (a lone matching token predicts poorly)
    seed: int = 0  # seeds the sampler of requests that bring no seed of their own
    num_threads: int | None = None  # torch intra-op threads on CPU; None = torch's default

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be >= --max-num-seqs "
                f"({self.max_num_seqs}) so that every running sequence can decode each step"
            )
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ConfigError(f"--max-model-len must be an integer >= 2, got {self.max_model_len!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"--num-threads must be >= 1, got {self.num_threads!r}")
        parse_memory(self.kv_cache_memory)  # validates early
        self._check_speculative()
        if self.quantization not in (None, "int8", "int4"):
            raise ConfigError(f"--quantization must be int8 or int4, got {self.quantization!r}")
        if self.kv_cache_dtype not in ("auto", "int8"):
            raise ConfigError(f"--kv-cache-dtype must be auto or int8, got {self.kv_cache_dtype!r}")
        if self.kv_cache_scales not in KV_CACHE_SCALES:
            raise ConfigError(f"--kv-cache-scales must be head or token, got {self.kv_cache_scales!r}")
        if self.gguf_weights not in ("keep", "dequantize"):
            raise ConfigError(f"--gguf-weights must be keep or dequantize, got {self.gguf_weights!r}")
        if self.quant_group_size not in (32, 64, 128, 256):
            raise ConfigError(f"--quant-group-size must be 32, 64, 128 or 256, got {self.quant_group_size!r}")

    def _check_speculative(self) -> None:
        if self.speculative not in SPECULATIVE_METHODS:
            raise ConfigError(f"--speculative must be one of {', '.join(m for m in SPECULATIVE_METHODS if m)}, "
                              f"got {self.speculative!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError(f"--num-speculative-tokens must be in [1, 16], got {self.num_speculative_tokens!r}")
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ConfigError("--draft-model goes with --speculative draft, and --speculative draft needs it")
        if (self.speculative == "self") != (self.draft_layers is not None):
            raise ConfigError("--draft-layers goes with --speculative self, and --speculative self needs it")
        if self.draft_layers is not None and self.draft_layers < 1:
            raise ConfigError(f"--draft-layers must be >= 1, got {self.draft_layers}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(f"need 1 <= --prompt-lookup-min ({self.prompt_lookup_min}) <= --prompt-lookup-max "
                              f"({self.prompt_lookup_max})")


def parse_memory(spec: str | int | float) -> tuple[int | None, float | None]:
    """'2GiB' -> (2147483648, None); '0.3' -> (None, 0.3). Exactly one of the two is set."""
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        spec = str(spec)
    if not isinstance(spec, str):
        raise ConfigError(f"--kv-cache-memory must be bytes or a fraction, got {spec!r}")
    m = _SIZE.match(spec)
    if m is None:
        raise ConfigError(f"--kv-cache-memory: cannot parse {spec!r} (try 2GiB, 512MB or 0.3)")
    number, unit = float(m.group(1)), (m.group(2) or "").upper().rstrip("B")
    if not unit and number < 1.0:
        if number <= 0:
            raise ConfigError(f"--kv-cache-memory fraction must be in (0, 1), got {spec!r}")
        return None, number
    if unit not in _UNITS:
        raise ConfigError(f"--kv-cache-memory: unknown unit in {spec!r}")
    return int(number * _UNITS[unit]), None
