"""A quantized checkpoint in Hugging Face folder form (written by `tokenloom quantize`,
quant/write_checkpoint.py), and reading it back: the loader's side.

The folder holds config.json (with `"quantization_config": {"quant_method": "tokenloom", "bits",
"group_size", "code_layout"}`), model.safetensors, tokenizer.json + tokenizer_config.json and
generation_config.json.
A quantized layer is stored under its module path in tokenloom's model ("model.layers.0.self_attn.
qkv_proj", fused as the engine runs it; "lm_head") as `.codes` (the kernels' layout, quant/layout.py),
`.scales`, `.mins` (int4; in the kernels' layout too) and `.bias`; every other tensor under its Hugging Face name. "code_layout"
is quant/layout.py's LAYOUT_VERSION (absent: 1); codes of an older layout are re-laid out on load. The
loader builds the quantized layers from those buffers directly: no float weight, no re-quantization.
The layers are exactly the ones `--quantization` builds at load from the same model and flags. A mixture of
experts' per-expert layers are stored as "model.layers.N.mlp.experts.gate_up.E" / "...experts.down.E" and come
back as the block's QuantExperts (models/moe.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tokenloom.errors import ModelLoadError
from tokenloom.models.moe import QuantExperts, SparseMoE
from tokenloom.quant.layout import LAYOUT_VERSION, LAYOUT_VERSIONS, relayout, relayout_int4_scales
from tokenloom.quant.linear import Int4Linear, Int8Linear, QuantLinear

QUANT_METHOD = "tokenloom"  # quantization_config.quant_method
_EXPERT = re.compile(r"(layers\.\d+\.mlp)\.experts\.(gate_up|down)\.(\d+)")  # a MoE block's expert layer


def check_quantization_config(qcfg: dict[str, Any], folder: Path) -> int:
    """Validates a checkpoint's quantization_config; returns the layout version its codes are stored in."""
    if qcfg.get("quant_method") != QUANT_METHOD:
        raise ModelLoadError(f"{folder}: quantization_config.quant_method {qcfg.get('quant_method')!r} is not "
                             f"supported; tokenloom reads its own ({QUANT_METHOD!r}, from `tokenloom quantize`)")
    layout = qcfg.get("code_layout", 1)  # checkpoints from before the field stored layout 1
    if layout not in LAYOUT_VERSIONS:
        raise ModelLoadError(f"{folder}: quantization_config.code_layout {layout!r} is unknown to this tokenloom "
                             f"(it reads {', '.join(map(str, LAYOUT_VERSIONS))}); re-run `tokenloom quantize`")
    return int(layout)


def split_stored(weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[tuple[str, torch.Tensor]],
                                                                     dict[str, dict[str, torch.Tensor]]]:
    """(plain HF-named tensors, {module path: {codes, scales, mins?, bias?}}) of a quantized checkpoint."""
    items = list(weights)
    paths = {k.removesuffix(".codes") for k, _ in items if k.endswith(".codes")}
    plain: list[tuple[str, torch.Tensor]] = []
    stored: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in items:
        path, _, part = key.rpartition(".")
        if path in paths:
            stored.setdefault(path.removeprefix("model."), {})[part] = t
        else:
            plain.append((key, t))
    return plain, stored


def stored_layers(stored: dict[str, dict[str, torch.Tensor]], model: nn.Module,
                  layout: int = LAYOUT_VERSION) -> Iterator[tuple[str, nn.Module]]:
    """Quantized layers from their stored buffers (codes in `layout`); input sizes from the (meta)
    model's own layers. Expert layers come as one QuantExperts per block, at "<block>.experts"."""
    experts: dict[str, tuple[dict[int, QuantLinear], dict[int, QuantLinear]]] = {}  # block -> gate_up, down
    for path, parts in stored.items():
        if (m := _EXPERT.fullmatch(path)) is not None:
            block = _block(model, m.group(1), path)
            k = block.gate.in_features if m.group(2) == "gate_up" else block.intermediate_size
            side = experts.setdefault(m.group(1), ({}, {}))[m.group(2) == "down"]
            side[int(m.group(3))] = _layer(parts, k, layout, path)
            continue
        try:
            target = model.get_submodule(path)
        except AttributeError as e:
            raise ModelLoadError(f"quantized tensors for {path!r}, which the model lacks") from e
        yield path, _layer(parts, int(getattr(target, "in_features")), layout, path)
    for path, (gate_up, down) in experts.items():
        want = list(range(_block(model, path, path).num_experts))
        if sorted(gate_up) != want or sorted(down) != want:
            missing = sorted(set(want) - set(gate_up) | set(want) - set(down))
            raise ModelLoadError(f"{path}: quantized experts {missing[:4]} are missing their gate_up or down layer")
        yield f"{path}.experts", QuantExperts([gate_up[e] for e in want], [down[e] for e in want])


def _block(model: nn.Module, path: str, what: str) -> SparseMoE:
    try:
        block = model.get_submodule(path)
    except AttributeError as e:
        raise ModelLoadError(f"quantized tensors for {what!r}, which the model lacks") from e
    if not isinstance(block, SparseMoE):
        raise ModelLoadError(f"quantized expert tensors for {what!r}, but {path} is not a mixture-of-experts block")
    return block


def _layer(parts: dict[str, torch.Tensor], k: int, layout: int, path: str) -> QuantLinear:
    codes, scales, bias = relayout(parts["codes"], k, layout), parts["scales"], parts.get("bias")
    if codes.dtype == torch.int8:
        return Int8Linear(codes, scales, bias, k)
    if "mins" in parts:
        return Int4Linear(codes, relayout_int4_scales(scales, layout), relayout_int4_scales(parts["mins"], layout),
                          bias, k)
    raise ModelLoadError(f"{path}: uint8 codes without mins")
