"""Builds and loads the C++ CPU kernels (csrc/) with torch's JIT extension loader, once per machine.

Kernels: paged decode and prefill attention, KV cache writes (INT8: quantized on the way), residual add + RMSNorm,
SiLU-and-mul, rotary embedding, few-row bf16 matmul (decode and speculative verification steps), the
weight-only int8 / int4 matmuls and the GGUF K-quant / Q5_0 ones (csrc/kquant.cpp) of tokenloom/quant, and
the decode stacks that call them all for a whole decode step (csrc/decode_stack.cpp for the Llama family,
csrc/gemma_stack.cpp for Gemma; engine/fused_decode.py).
Each has a pure-torch twin (models/layers.py, attention/sdpa.py, attention/paged_kv.py, quant/linear.py,
quant/kquant.py, the Python model) that is the test oracle and the path on CUDA.

All sources build into one module: the first load compiles (under two minutes on 2 cores) into torch's
extension cache; later loads take milliseconds. Only bindings.cpp and the two stacks (pybind11 classes)
include torch/extension.h; the rest include torch/types.h, a third of its compile time per file. When no
compiler is available the loader returns None and callers use the torch path. The numbers both sides rely
on (row limits, code layout) come from limits.py, passed to the compiler as -D flags; the build is named
after them and after a hash of the csrc/ files and the compiler flags, so two checkouts with different
sources never share a build folder, and checkouts with the same sources share one (built from a copy of
csrc/ in the build folder).

Builders serialize on an flock of their own (build_lock) with a bounded wait, logging while they wait.
The kernel lock dies with its holder, so once it is held any torch `lock` file in the build folder was
left by a dead build and is removed (torch's own lock has no timeout: a stale one hung every start-up).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

try:
    import fcntl
except ImportError:  # Windows: no flock; builds then rely on torch's own lock alone
    fcntl = None  # type: ignore[assignment]

from tokenloom.kernels.limits import build_tag, compiler_defines

log = logging.getLogger("tokenloom.kernels")

_CSRC = Path(__file__).parent / "csrc"


_SOURCES = ("bindings.cpp", "paged_decode.cpp", "paged_prefill.cpp", "kv_write.cpp", "elementwise.cpp", "skinny_gemm.cpp",
            "quant_gemm.cpp", "kquant.cpp", "decode_stack.cpp", "gemma_stack.cpp")


# How long a start-up waits for another process's kernel build before using the torch path instead.
BUILD_LOCK_TIMEOUT_S = 600.0
_LOCK_NAME = "tokenloom-build.lock"  # ours (flock); torch's FileBaton file in the same folder is "lock"


def _cflags() -> list[str]:
    # -march=native: built on the machine that runs it. -fno-math-errno lets exp() vectorise.
    return ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", *compiler_defines()]


_LDFLAGS = ("-fopenmp",)  # a tuple: torch's load appends its own flags to the list it is given


def source_hash(csrc: Path, flags: Sequence[str]) -> str:
    """12 hex digits of a hash over every file in `csrc` (names and contents) and the compiler flags."""
    h = hashlib.sha256()
    for f in sorted(p for p in csrc.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        h.update(f.relative_to(csrc).as_posix().encode() + b"\0")
        h.update(f.read_bytes())
        h.update(b"\0")
    for flag in flags:
        h.update(flag.encode() + b"\0")
    return h.hexdigest()[:12]


def build_name(csrc: Path = _CSRC, flags: Sequence[str] | None = None) -> str:
    """The extension's name, hence its build folder: the sources', flags' and torch installation's hash,
    then the shared limits' tag (a build made from other sources or with other values is never reused).

    The torch installation counts because torch puts its include folders in every compile command: two
    virtual environments sharing one build folder (a CI clone beside a working checkout) made ninja see
    changed commands and rebuild it in turn, each rebuild holding the build lock for minutes while the
    other side's servers waited for it."""
    flags = [*_cflags(), *_LDFLAGS] if flags is None else flags
    return f"tokenloom_cpu_kernels_{source_hash(csrc, [*flags, *_torch_includes()])}_{build_tag()}"


def _torch_includes() -> list[str]:
    from torch.utils.cpp_extension import include_paths

    return ["-isystem" + p for p in include_paths()]


def extensions_root() -> Path:
    """The folder torch's JIT loader builds extensions in (TORCH_EXTENSIONS_DIR, else its default)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    cu = "cpu" if torch.version.cuda is None else f"cu{torch.version.cuda.replace('.', '')}"
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{py}_{cu}"


@contextlib.contextmanager
def build_lock(build_dir: Path, timeout_s: float = BUILD_LOCK_TIMEOUT_S, poll_s: float = 0.2,
               report_every_s: float = 5.0) -> Iterator[bool]:
    """Hold the kernel build lock of `build_dir` for the block; yields False when `timeout_s` passed first.

    The lock is an flock, released by the kernel when its holder dies, so it is never stale. Every
    builder takes it before torch's `load`, so while it is held a torch `lock` file in `build_dir` was
    left by a build that died (or was killed) mid-way: it is removed, or torch would wait on it forever.
    """
    build_dir.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield True
        return
    lock_path = build_dir / _LOCK_NAME
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        start = last_report = time.monotonic()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if now - start >= timeout_s:
                    log.warning("gave up after %.0f s waiting for the kernel build lock held by another "
                                "process at %s", now - start, lock_path)
                    yield False
                    return
                if now - last_report >= report_every_s:
                    log.warning("waiting for the kernel build lock held by another process at %s "
                                "(%.0f s so far)", lock_path, now - start)
                    last_report = now
                time.sleep(poll_s)
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("removing the stale torch build lock %s left by an interrupted kernel build", stale)
            stale.unlink(missing_ok=True)
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@functools.cache
def load_cpu_kernels(lock_timeout_s: float = BUILD_LOCK_TIMEOUT_S) -> ModuleType | None:
    """The kernel module, built on first use; None (callers use the torch path) when it cannot be built
    or another process's build holds the build lock for longer than `lock_timeout_s`."""
    try:
        from torch.utils.cpp_extension import load

        name = build_name()
        build_dir = extensions_root() / name
        with build_lock(build_dir, lock_timeout_s) as locked:
            if not locked:
                log.warning("CPU kernels unavailable (build lock not acquired); using the torch path")
                return None
            src = _stage_sources(build_dir)
            return load(
                name=name,
                sources=[str(src / f) for f in _SOURCES],
                extra_cflags=_cflags(),
                extra_ldflags=list(_LDFLAGS),
                build_directory=str(build_dir),
                verbose=False,
            )
    except Exception as e:  # a missing compiler or ninja must not stop the engine: fall back to torch
        log.warning("CPU kernels unavailable (%s); using the torch SDPA path for decode attention", e)
        return None


def _stage_sources(build_dir: Path) -> Path:
    """Copy csrc/ into the build folder (under the build lock) and build from that copy. The build is named
    after the sources' hash, so every checkout with the same sources shares it; compiling each checkout's own
    paths would differ in ninja's commands and make checkouts rebuild it in turn. A file is written only
    when its content differs, so ninja's timestamps stay put."""
    src = build_dir / "src"
    src.mkdir(parents=True, exist_ok=True)
    for f in sorted(_CSRC.iterdir()):
        if f.suffix not in (".cpp", ".h"):
            continue
        data = f.read_bytes()
        dst = src / f.name
        if not dst.is_file() or dst.read_bytes() != data:
            dst.write_bytes(data)
    return src


@functools.cache
def load_quant_kernels() -> ModuleType | None:
    """The kernel module when it has the int8 / int4 weight-only matmuls (csrc/quant_gemm.cpp), or None
    when it cannot be built or the CPU lacks AVX512-BF16 or AVX512-VNNI (the quantized layers then fall
    back to dequantize + F.linear)."""
    mod = load_cpu_kernels()
    if mod is None:
        return None
    if not mod.quant_available():
        log.warning("quantized matmul kernels need AVX512-BF16 and AVX512-VNNI; quantized layers dequantize per call")
        return None
    return mod
