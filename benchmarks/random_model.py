"""A random-weight Hugging Face model folder of a real model's shape, for timing where its weights cannot travel.

Speed does not depend on weight values (the benchmarks decode with ignore_eos), so a model of the same shape,
dtype and tokenizer times like the real one. The device machine gets only the working tree (64 MiB), not the
model files, so benchmarks/gpu_check.sh builds its models there with this script.

    python benchmarks/random_model.py --like FOLDER --out DIR [--set hidden_size=2048 --set num_hidden_layers=16 ...]

FOLDER holds config.json and the tokenizer files (tokenizer.json, tokenizer_config.json); --set overrides
config fields (ints, floats, true/false, null), e.g. to build a 1B-class Llama with the same tokenizer.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")


def _value(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--like", type=Path, required=True, help="folder with config.json and tokenizer files")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="cpu", help="where to draw the weights (cuda is faster for big models)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import transformers

    cfg_dict = json.loads((args.like / "config.json").read_text())
    for item in args.set:
        key, sep, text = item.partition("=")
        if not sep:
            print(f"--set {item!r}: expected KEY=VALUE", file=sys.stderr)
            return 2
        cfg_dict[key] = _value(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(json.dumps(cfg_dict, indent=2))
    for name in TOKENIZER_FILES:
        if (args.like / name).exists():
            shutil.copy(args.like / name, args.out / name)
    cfg = transformers.AutoConfig.from_pretrained(args.out)
    t = time.perf_counter()
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, args.dtype))
    model.save_pretrained(args.out, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.out}: {cfg_dict.get('model_type')} with {params / 1e9:.2f}B parameters ({args.dtype}), "
          f"built in {time.perf_counter() - t:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
