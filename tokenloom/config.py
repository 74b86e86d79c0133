"""Engine configuration: one frozen dataclass, the same names as the CLI flags (--max-num-seqs, ...)."""

from __future__ import annotations

import enum
import functools
import re
import types
from dataclasses import dataclass, fields
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from tokenloom.errors import ConfigError
from tokenloom.kernels.limits import SKINNY_MAX_ROWS

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}

# The option vocabularies, each written once: EngineConfig's field types, the CLI's choices
# (engine_args.py), the validation below and the backends, caches and servers all take them from here
# (`typing.get_args` lists a vocabulary's values). Values stay plain strings: LLM(quantization="int8").
DType = Literal["auto", "float32", "bfloat16", "float16"]  # auto: bfloat16 unless the checkpoint is float32
AttentionBackendName = Literal["auto", "cpu", "sdpa", "reference"]  # attention/registry.py
Quantization = Literal["int8", "int4"]  # weight-only: per output channel | group-wise
GgufWeights = Literal["keep", "dequantize"]  # a GGUF's Q8_0/Q4_0/Q4_1 linear weights
KVCacheDtype = Literal["auto", "int8"]  # auto: the model's dtype
KVCacheScales = Literal["head", "token"]  # int8 KV: one scale per layer and head | per token and head
SpeculativeMethod = Literal["ngram", "draft", "self"]
Role = Literal["both", "prefill", "decode"]  # `serve --role`: disaggregated prefill / decode workers
INT4_GROUP_SIZES = (32, 64, 128, 256)  # --quant-group-size: inputs per int4 scale (quant/quantizers.py)


class KVCacheFormat(enum.Enum):
    """How the KV cache stores each token's K and V: derived once from --kv-cache-dtype and
    --kv-cache-scales (`EngineConfig.kv_format`), carried by the cache spec (engine/kv_cache.py, which
    also sizes it), each layer's cache (attention/paged_kv.py), the CPU kernels' choice of path and the
    KV transfer layout (disagg/blocks.py). The value is the name capacity reports print."""

    MODEL_DTYPE = "model dtype"  # K/V in the model's dtype
    INT8_PER_HEAD = "int8, per-head scales"  # int8 codes; one fixed float16 scale per layer and head
    INT8_PER_TOKEN = "int8, per-token scales"  # int8 codes; a float16 scale per token and head beside them

    @classmethod
    def of(cls, kv_cache_dtype: KVCacheDtype, kv_cache_scales: KVCacheScales) -> KVCacheFormat:
        if kv_cache_dtype == "auto":
            return cls.MODEL_DTYPE
        return cls.INT8_PER_HEAD if kv_cache_scales == "head" else cls.INT8_PER_TOKEN

    @property
    def quantized(self) -> bool:
        """INT8 codes with float16 scales."""
        return self is not KVCacheFormat.MODEL_DTYPE

    @property
    def per_head_scales(self) -> bool:
        """INT8 with fixed per-head scales: nothing but codes is stored per token."""
        return self is KVCacheFormat.INT8_PER_HEAD

    @property
    def per_token_scales(self) -> bool:
        """INT8 with a scale stored per token and head, beside the codes."""
        return self is KVCacheFormat.INT8_PER_TOKEN


def vocabulary(hint: Any) -> tuple[tuple[Any, ...], bool] | None:
    """(the values, whether None is allowed too) of a Literal type or an optional one; None for any
    other type."""
    optional = False
    if get_origin(hint) in (Union, types.UnionType):
        args = get_args(hint)
        optional = type(None) in args
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            return None
        hint = rest[0]
    if get_origin(hint) is not Literal:
        return None
    return get_args(hint), optional


def one_of(values: tuple[Any, ...]) -> str:
    """'a or b', 'one of a, b, c': the choices in a message."""
    names = [str(v) for v in values]
    return " or ".join(names) if len(names) == 2 else f"one of {', '.join(names)}"


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF folder or .gguf file; None = embedded SmolLM2-135M-Instruct
    dtype: DType = "auto"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    block_size: int = 16  # tokens per KV block
    kv_cache_memory: str = "2GiB"  # bytes ("2GiB", "512MB", "1000000") or a fraction of free memory ("0.3")
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    max_num_seqs: int = 128  # sequences in one step
    max_num_batched_tokens: int = 512  # tokens in one step: decodes + prefill chunks
    attention_backend: AttentionBackendName = "auto"
    fused_decode: bool = True  # CPU backend: a pure decode step runs the layer stack in one C++ call
    # CPU, bfloat16: also hold each dense linear weight in oneDNN's blocked layout, for matmuls of 2-256
    # rows (batched decode, verification); costs a second copy of those weights.
    prepack_weights: bool = True
    # CPU: the weights copied onto 2 MiB pages after loading (Linux transparent huge pages; engine/huge_pages.py)
    huge_pages: bool = True
    quantization: Quantization | None = None  # None: full-precision weights
    quant_group_size: int = 128  # int4 group size (a smaller supported one where it does not divide a layer)
    # Quantized matmuls (CPU): the kernels that read the codes (int8 activations by VNNI; on AMX CPUs the
    # tiles by AMX where measured faster) up to this many rows of x, the weight expanded to bf16 for oneDNN
    # beyond; None = measured at start-up (quant/routing.py).
    quant_tile_max_rows: int | None = None
    gguf_weights: GgufWeights = "keep"  # keep: GGUF Q8_0/Q4_0/Q4_1 linear weights stay quantized (bf16, CPU)
    kv_cache_dtype: KVCacheDtype = "auto"  # int8: codes and float16 scales
    # int8 scales: head (one per layer and head, calibrated at start-up: 2x the tokens of 16 bits) |
    # token (one per token and head, stored with the codes: nothing saturates, 1.94x at head_dim 64)
    kv_cache_scales: KVCacheScales = "head"
    enable_prefix_caching: bool = True  # share the K/V of full blocks between requests with a common prefix
    # Speculative decoding: None | "ngram" (prompt lookup) | "draft" (--draft-model) | "self" (first
    # --draft-layers layers of the target). k = num_speculative_tokens drafts verified per step.
    speculative: SpeculativeMethod | None = None
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
        for name, (values, optional) in _vocabularies().items():
            value = getattr(self, name)
            if value not in values and not (optional and value is None):
                raise ConfigError(f"--{name.replace('_', '-')} must be {one_of(values)}, got {value!r}")
        self._check_speculative()
        if self.quant_group_size not in INT4_GROUP_SIZES:
            raise ConfigError(f"--quant-group-size must be {one_of(INT4_GROUP_SIZES)}, got {self.quant_group_size!r}")
        if self.quant_tile_max_rows is not None and (not isinstance(self.quant_tile_max_rows, int)
                                                     or self.quant_tile_max_rows < SKINNY_MAX_ROWS):
            raise ConfigError(f"--quant-tile-max-rows must be an integer >= {SKINNY_MAX_ROWS}, got "
                              f"{self.quant_tile_max_rows!r}")

    def _check_speculative(self) -> None:
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

    @property
    def kv_format(self) -> KVCacheFormat:
        """The KV cache's storage format, from kv_cache_dtype and kv_cache_scales."""
        return KVCacheFormat.of(self.kv_cache_dtype, self.kv_cache_scales)


@functools.cache
def _vocabularies() -> dict[str, tuple[tuple[Any, ...], bool]]:
    """EngineConfig's fields typed with a vocabulary: {name: (values, None allowed)}."""
    hints = get_type_hints(EngineConfig)
    found = {f.name: vocabulary(hints[f.name]) for f in fields(EngineConfig)}
    return {name: v for name, v in found.items() if v is not None}


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
