"""`tokenloom quantize`: the saved checkpoint loads back into the same layers and the same outputs as
`--quantization` at load, without re-quantizing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tokenloom import LLM, SamplingParams
from tokenloom.cli import main
from tokenloom.quant import weight_only
from tokenloom.quant.layout import (LAYOUT_VERSION, int4_from_kernel, int4_scales_from_kernel, int4_to_kernel,
                                    int8_from_kernel, int8_to_kernel)
from tokenloom.quant.linear import QuantLinear


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_saved_checkpoint_matches_on_the_fly_quantization(
    tiny_llama: Path, tmp_path: Path, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _assert_saved_matches_fly(tiny_llama, tmp_path / "q", method, monkeypatch)


def _assert_saved_matches_fly(model: Path, out: Path, method: str, monkeypatch: pytest.MonkeyPatch,
                              *extra: str) -> tuple[LLM, LLM]:
    """`tokenloom quantize` of `model`, loaded back: the same quantized layers (codes, scales, mins) as
    `--quantization` at load, none quantized again, and the same greedy ids and logprobs."""
    assert main(["quantize", "--model", str(model), "--out", str(out), "--quantization", method,
                 "--quant-group-size", "32", *extra]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "tokenloom", "bits": 4 if method == "int4" else 8,
                                          "group_size": 32, "code_layout": LAYOUT_VERSION}
    assert (out / "tokenizer.json").is_file() and (out / "model.safetensors").is_file()
    kw = dict(dtype="bfloat16", kv_cache_memory="8MiB", max_model_len=128)
    gguf_weights = extra[extra.index("--gguf-weights") + 1] if "--gguf-weights" in extra else "keep"
    fly = LLM(str(model), quantization=method, quant_group_size=32, gguf_weights=gguf_weights, **kw)

    def no_requantization(*a: object, **k: object) -> None:
        raise AssertionError("the checkpoint's layers were quantized again")

    with monkeypatch.context() as m:
        m.setattr(weight_only.Int8Linear, "from_linear", no_requantization)
        m.setattr(weight_only.Int4Linear, "from_linear", no_requantization)
        m.setattr(weight_only, "quantize_int8", no_requantization)
        m.setattr(weight_only, "quantize_int4", no_requantization)
        saved = LLM(str(out), **kw)
    a, b = fly.engine.loaded.model, saved.engine.loaded.model
    assert saved.engine.loaded.config == fly.engine.loaded.config
    fly_layers = {n: m for n, m in a.named_modules() if isinstance(m, QuantLinear)}
    saved_layers = {n: m for n, m in b.named_modules() if isinstance(m, QuantLinear)}
    assert fly_layers.keys() == saved_layers.keys() and "lm_head" in saved_layers
    for name, layer in fly_layers.items():
        assert type(layer) is type(saved_layers[name])
        other = saved_layers[name]
        assert torch.equal(layer.codes, other.codes) and torch.equal(layer.scales, other.scales)
        assert (layer.mins is None and other.mins is None) or torch.equal(layer.mins, other.mins)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    x, y = fly.generate(["The quick brown fox"], sp)[0].outputs[0], saved.generate(["The quick brown fox"], sp)[0].outputs[0]
    assert x.token_ids == y.token_ids
    assert [p.logprob for p in x.logprobs] == [p.logprob for p in y.logprobs]
    return fly, saved


@pytest.mark.parametrize("kind", ["gemma3", "mixtral", "qwen2moe"])
def test_gemma3_and_moe_checkpoints_match_on_the_fly_quantization(kind: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 3 (sliding and global layers, (1 + w) norms) and MoE models: each expert's gate_up and down are
    quantized layers of their own (stored per expert), the router stays float; Qwen2-MoE's shared expert too."""
    from test_gemma3 import make_tiny_gemma
    from test_moe import make_tiny_moe

    from tokenloom.models.moe import QuantExperts, SparseMoE

    folder = (make_tiny_gemma(tmp_path / kind, seed=51) if kind == "gemma3"
              else make_tiny_moe(tmp_path / kind, kind, seed=52))
    _, saved = _assert_saved_matches_fly(folder, tmp_path / "q", "int4", monkeypatch)
    blocks = [m for m in saved.engine.loaded.model.modules() if isinstance(m, SparseMoE)]
    assert bool(blocks) == (kind != "gemma3")
    for block in blocks:
        assert isinstance(block.experts, QuantExperts) and block.experts_gate_up is None
        assert all(isinstance(m, QuantLinear) for m in [*block.experts.gate_up, *block.experts.down])
        assert not isinstance(block.gate, QuantLinear)


@pytest.mark.parametrize("kind", ["gemma3", "phi3", "qwen3moe"])
def test_gguf_gemma3_phi3_and_moe_checkpoints(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """From a GGUF the config.json is written from its metadata (Gemma 3's layer types, local RoPE base and
    attention scale; Phi-4-mini's partial rotary and LongRoPE factors; the experts' sizes and routing) and reads back as the same config. K-quant layers kept as
    they are have no form in a checkpoint: refused by name, unless dequantized and re-quantized."""
    from test_gemma3 import make_tiny_gemma, write_gemma3_gguf
    from test_moe_gguf_kept import write_tiny_moe_gguf

    if kind == "gemma3":
        path = write_gemma3_gguf(make_tiny_gemma(tmp_path / "g", seed=53), tmp_path / "g.gguf")
        _assert_saved_matches_fly(path, tmp_path / "q", "int8", monkeypatch)
        return
    if kind == "phi3":
        from conftest import make_tiny_model
        from test_phi3 import CONFIGS, PHI3, write_phi3_gguf

        kw = {k: v for k, v in CONFIGS["partial"].items() if k != "seed"}
        folder = make_tiny_model(tmp_path / "p", arch="phi3", seed=54, **(PHI3 | kw))
        _assert_saved_matches_fly(write_phi3_gguf(folder, tmp_path / "p.gguf"), tmp_path / "q", "int8", monkeypatch)
        return
    path = write_tiny_moe_gguf(tmp_path / "m.gguf", "qwen3moe")  # Q4_K / Q5_0 / Q6_K experts
    if weight_only.Int8Linear.kernel_module() is not None:  # kept only with the kernels
        assert main(["quantize", "--model", str(path), "--out", str(tmp_path / "k"), "--quantization", "int8"]) == 2
        assert "KQuantLinear" in capsys.readouterr().err and not (tmp_path / "k").exists()
    _assert_saved_matches_fly(path, tmp_path / "q", "int8", monkeypatch, "--gguf-weights", "dequantize")


def test_quantize_rejects_a_bad_method(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["quantize", "--model", str(tiny_llama), "--out", str(tmp_path / "q"), "--quantization", "int3"])
    assert rc == 2 and "int8, int4" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()


def test_unknown_quant_method_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    import shutil

    from tokenloom.errors import ModelLoadError

    folder = tmp_path / "gptq"
    shutil.copytree(tiny_llama, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="gptq"):
        LLM(str(folder), kv_cache_memory="8MiB")


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("version", [1, 2])
def test_a_checkpoint_in_an_older_code_layout_is_relaid_on_load(tiny_llama: Path, tmp_path: Path, method: str,
                                                                 version: int) -> None:
    """Checkpoints written before "code_layout" existed hold layout 1, and those of layout 2 keep int4
    rows apart with plain scales; loading them must give the same layers as today's, not silently wrong
    products."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tokenloom.errors import ModelLoadError

    new, old = tmp_path / "new", tmp_path / "old"
    assert main(["quantize", "--model", str(tiny_llama), "--out", str(new), "--quantization", method,
                 "--quant-group-size", "32"]) == 0
    shutil.copytree(new, old)
    cfg = json.loads((old / "config.json").read_text())
    if version == 1:
        del cfg["quantization_config"]["code_layout"]
    else:
        cfg["quantization_config"]["code_layout"] = version
    (old / "config.json").write_text(json.dumps(cfg))
    kw = dict(kv_cache_memory="8MiB", max_model_len=256)
    model = LLM(str(new), **kw).engine.loaded.model
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    tensors = load_file(str(old / "model.safetensors"))
    changed = 0
    for key in [k for k in tensors if k.endswith(".codes")]:
        layer = layers[key.removesuffix(".codes").removeprefix("model.")]
        k = layer.in_features
        if tensors[key].dtype == torch.int8:
            older = int8_to_kernel(int8_from_kernel(tensors[key], k), version=version)
        else:
            older = int4_to_kernel(int4_from_kernel(tensors[key], k), version=version)
            for part in ("scales", "mins"):  # plain (N, G) before layout 3
                part_key = key.removesuffix("codes") + part
                tensors[part_key] = int4_scales_from_kernel(tensors[part_key])
        changed += int(not torch.equal(older, tensors[key]))
        tensors[key] = older
    assert changed > 0 or (method, version) == ("int8", 2)  # layout 3 changed int4 only
    save_file(tensors, str(old / "model.safetensors"), metadata={"format": "pt"})
    relaid = {n: m for n, m in LLM(str(old), **kw).engine.loaded.model.named_modules() if isinstance(m, QuantLinear)}
    assert relaid.keys() == layers.keys()
    for name, layer in layers.items():
        assert torch.equal(layer.codes, relaid[name].codes) and torch.equal(layer.scales, relaid[name].scales)
        assert (layer.mins is None and relaid[name].mins is None) or torch.equal(layer.mins, relaid[name].mins)

    cfg["quantization_config"]["code_layout"] = 99
    (old / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="code_layout 99"):
        LLM(str(old), **kw)
