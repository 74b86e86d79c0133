"""The option vocabularies (config.py), the engine flags built from EngineConfig (engine_args.py), the KV
cache format and its one byte count, the attention backend registry."""

from __future__ import annotations

import argparse
import ast
import re
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any, get_args, get_type_hints

import pytest
import torch

import tokenloom
from tokenloom.attention.paged_kv import LayerKVCache
from tokenloom.attention.registry import get_backend
from tokenloom.cli import build_parser
from tokenloom.config import (AttentionBackendName, EngineConfig, GgufWeights, KVCacheFormat, Quantization, Role,
                              vocabulary)
from tokenloom.disagg.blocks import KVLayout, read_block
from tokenloom.engine.kv_cache import KVCacheSpec, allocate_kv_cache
from tokenloom.engine_args import ENGINE_FLAGS, add_engine_args, engine_argv, engine_config
from tokenloom.errors import ConfigError
from tokenloom.router.config import POLICIES

PACKAGE = Path(tokenloom.__file__).parent
README = PACKAGE.parent / "README.md"
HINTS = get_type_hints(EngineConfig)
VOCABULARY_FIELDS = {f: v for f in HINTS if (v := vocabulary(HINTS[f])) is not None}


def _actions(argv: list[str]) -> dict[str, argparse.Action]:
    """The options of the subcommand `argv` names, by option string."""
    parser: Any = build_parser()
    for word in argv:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return {s: a for a in parser._actions for s in a.option_strings}


def _flag(field: str) -> str:
    return next(f.option for f in ENGINE_FLAGS if f.field == field)


def test_the_vocabularies_are_typed_fields() -> None:
    assert set(VOCABULARY_FIELDS) == {"dtype", "attention_backend", "quantization", "gguf_weights", "kv_cache_dtype",
                                      "kv_cache_scales", "speculative"}
    assert VOCABULARY_FIELDS["quantization"] == (get_args(Quantization), True)
    assert VOCABULARY_FIELDS["kv_cache_dtype"] == (("auto", "int8"), False)


def test_every_field_is_one_flag() -> None:
    assert sorted(f.field for f in ENGINE_FLAGS) == sorted(f.name for f in fields(EngineConfig))
    assert _flag("enable_prefix_caching") == "--prefix-caching"


COMMANDS = [["serve"], ["generate"], ["bench", "offline"], ["cluster"], ["eval", "perplexity"]]


@pytest.mark.parametrize("command", COMMANDS)
def test_the_cli_offers_each_vocabulary_as_choices(command: list[str]) -> None:
    actions = _actions(command)
    for field, (values, _) in VOCABULARY_FIELDS.items():
        assert tuple(actions[_flag(field)].choices) == values, field
    for f in ENGINE_FLAGS:  # every engine flag is there, with the field's default (bench offline: its own)
        default = getattr(EngineConfig(), f.field) if command != ["bench", "offline"] or f.field != "gguf_weights" \
            else "dequantize"
        assert actions[f.option].dest == f.field and actions[f.option].default == default


def test_other_vocabularies_in_the_cli() -> None:
    assert tuple(_actions(["serve"])["--role"].choices) == get_args(Role)
    assert tuple(_actions(["quantize"])["--gguf-weights"].choices) == get_args(GgufWeights)
    assert tuple(_actions(["router"])["--policy"].choices) == POLICIES == ("round_robin", "least_outstanding",
                                                                          "cache_aware")


@pytest.mark.parametrize("field", sorted(VOCABULARY_FIELDS))
def test_a_value_outside_the_vocabulary_is_a_config_error_naming_the_flag(field: str) -> None:
    values, optional = VOCABULARY_FIELDS[field]
    with pytest.raises(ConfigError, match=f"^{_flag(field)} must be .*{values[-1]}, got 'bogus'$"):
        EngineConfig(**{field: "bogus"})
    if optional:
        EngineConfig(**{field: None})
    for v in values:  # every value is accepted (speculative draft / self need their companions)
        companions = {"draft": {"draft_model": "m"}, "self": {"draft_layers": 1}}
        extra = companions.get(v, {}) if field == "speculative" else {}
        EngineConfig(**{field: v}, **extra)  # type: ignore[arg-type]


def test_messages_name_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"--quantization must be int8 or int4, got 'int3'"):
        EngineConfig(quantization="int3")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"--speculative must be one of ngram, draft, self, got 'medusa'"):
        EngineConfig(speculative="medusa")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown attention backend 'fast'; choose from auto, cpu, sdpa, reference"):
        get_backend("fast", torch.device("cpu"))  # type: ignore[arg-type]
    assert get_backend("reference", torch.device("cpu")).name == "reference"


def test_parsed_flags_round_trip_to_engine_config() -> None:
    argv = ["--model", "m", "--dtype", "float32", "--kv-cache-dtype", "int8", "--kv-cache-scales", "token",
            "--no-prefix-caching", "--no-fused-decode", "--speculative", "self", "--draft-layers", "2",
            "--quantization", "int4", "--max-model-len", "512", "--attention-backend", "sdpa"]
    args = build_parser().parse_args(["generate", "hi", *argv])
    config = engine_config(args)
    assert config == EngineConfig(model="m", dtype="float32", kv_cache_dtype="int8", kv_cache_scales="token",
                                  enable_prefix_caching=False, fused_decode=False, speculative="self", draft_layers=2,
                                  quantization="int4", max_model_len=512, attention_backend="sdpa")
    assert config.kv_format is KVCacheFormat.INT8_PER_TOKEN
    assert engine_config(build_parser().parse_args(["serve"])) == EngineConfig()
    # engine_argv gives back the flags that differ from the defaults, in --help order, which parse to the same.
    back = engine_argv(args)
    assert back[:4] == ["--model", "m", "--dtype", "float32"] and "--no-prefix-caching" in back
    again = argparse.ArgumentParser()
    add_engine_args(again)
    assert engine_config(again.parse_args(back)) == config
    assert engine_argv(again.parse_args([])) == []


def test_kv_format_from_the_config() -> None:
    assert EngineConfig().kv_format is KVCacheFormat.MODEL_DTYPE
    assert EngineConfig(kv_cache_scales="token").kv_format is KVCacheFormat.MODEL_DTYPE
    assert EngineConfig(kv_cache_dtype="int8").kv_format is KVCacheFormat.INT8_PER_HEAD
    assert EngineConfig(kv_cache_dtype="int8", kv_cache_scales="token").kv_format is KVCacheFormat.INT8_PER_TOKEN
    assert [f.quantized for f in KVCacheFormat] == [False, True, True]
    assert [(f.per_head_scales, f.per_token_scales) for f in KVCacheFormat] == [(False, False), (True, False),
                                                                               (False, True)]


@pytest.mark.parametrize("fmt", list(KVCacheFormat))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_per_block_are_the_same_for_sizing_the_cache_and_the_kv_transfer(fmt: KVCacheFormat,
                                                                               dtype: torch.dtype) -> None:
    spec = KVCacheSpec(3, 2, 16, 4, dtype, fmt)
    fixed = [(torch.full((2,), 0.1), torch.full((2,), 0.2))] * 3 if fmt.per_head_scales else None
    caches = allocate_kv_cache(spec, 5, torch.device("cpu"), fixed)
    assert all(c.format is fmt for c in caches)
    engine = SimpleNamespace(model_name="tiny", runner=SimpleNamespace(kv_caches=caches))
    layout = KVLayout.of(engine)  # type: ignore[arg-type]
    assert layout.format is fmt and layout.spec.format is fmt
    # What a block's bytes are on the wire = what the cache holds per block = what sizing counts.
    assert len(read_block(caches, 2)) == layout.block_nbytes == spec.bytes_per_block
    assert sum(t[0].nbytes for c in caches for t in c.tensors()) == spec.bytes_per_block
    per_head_token = 16 * (dtype.itemsize if fmt is KVCacheFormat.MODEL_DTYPE else 1) + 2 * fmt.per_token_scales
    assert spec.bytes_per_token == 2 * 3 * 2 * per_head_token


def test_a_layer_cache_matches_its_format() -> None:
    cpu = torch.device("cpu")
    kv = LayerKVCache.allocate(2, 4, 2, 8, torch.float32, KVCacheFormat.INT8_PER_TOKEN, cpu)
    with pytest.raises(ConfigError, match="do not match"):
        LayerKVCache(kv.k, kv.v, KVCacheFormat.MODEL_DTYPE, kv.k_scale, kv.v_scale)
    with pytest.raises(ConfigError, match="do not match"):
        LayerKVCache(kv.k, kv.v, KVCacheFormat.INT8_PER_HEAD, kv.k_scale, kv.v_scale)
    with pytest.raises(ConfigError, match="per-head"):
        LayerKVCache.allocate(2, 4, 2, 8, torch.float32, KVCacheFormat.INT8_PER_HEAD, cpu)


def test_readme_flag_table_lists_every_choice() -> None:
    rows = {m.group(1): line for line in README.read_text().splitlines()
            if (m := re.match(r"\| `(--[a-z-]+)", line))}
    for field, (values, _) in VOCABULARY_FIELDS.items():
        row = rows[_flag(field)]
        assert all(f"`{v}`" in row for v in values), (field, row)


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_no_backend_import_in_the_interface_and_no_cli_import_in_its_parts() -> None:
    assert not {"tokenloom.attention.cpu", "tokenloom.attention.sdpa", "tokenloom.attention.reference",
                "tokenloom.attention.registry"} & _imports(PACKAGE / "attention" / "base.py")
    for part in ("bench/offline.py", "router/cli.py", "engine_args.py", "config.py"):
        assert "tokenloom.cli" not in _imports(PACKAGE / part), part
    assert get_args(AttentionBackendName) == ("auto", "cpu", "sdpa", "reference")
