"""The kernel build cache: named after the sources, and a stale or held build lock never hangs start-up."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from pathlib import Path

import pytest

import tokenloom.kernels as kernels
from tokenloom.kernels import build_lock, build_name, extensions_root
from tokenloom.kernels.limits import build_tag

CSRC = Path(kernels.__file__).parent / "csrc"


def _hold_lock(build_dir: Path) -> int:
    """An flock on build_dir's kernel build lock through a separate open file (as another process holds it)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(build_dir / kernels._LOCK_NAME, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_stale_torch_lock_is_removed(tmp_path: Path) -> None:
    (tmp_path / "lock").write_text("")  # torch's FileBaton file, left by a build that was killed
    with build_lock(tmp_path, timeout_s=5) as locked:
        assert locked
        assert not (tmp_path / "lock").exists()


def test_held_lock_times_out_with_a_message(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fd = _hold_lock(tmp_path)
    (tmp_path / "lock").write_text("")  # belongs to the live holder's build: must stay
    try:
        with caplog.at_level(logging.WARNING, logger="tokenloom.kernels"):
            with build_lock(tmp_path, timeout_s=0.6, poll_s=0.05, report_every_s=0.2) as locked:
                assert not locked
        assert (tmp_path / "lock").exists()
        assert "waiting for the kernel build lock held by another process at" in caplog.text
        assert str(tmp_path / kernels._LOCK_NAME) in caplog.text
        assert "gave up" in caplog.text
    finally:
        os.close(fd)  # the holder "dies": its flock goes with it
    with build_lock(tmp_path, timeout_s=5) as locked:
        assert locked and not (tmp_path / "lock").exists()


def test_load_returns_none_when_the_lock_is_never_free(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    fd = _hold_lock(tmp_path / build_name())
    try:
        assert kernels.load_cpu_kernels.__wrapped__(lock_timeout_s=0.3) is None
    finally:
        os.close(fd)


def test_extensions_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert extensions_root() == tmp_path
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    from torch.utils.cpp_extension import get_default_build_root

    assert extensions_root().parent == Path(get_default_build_root())


def test_build_name_follows_sources_and_flags(tmp_path: Path) -> None:
    copy = tmp_path / "csrc"
    shutil.copytree(CSRC, copy, ignore=shutil.ignore_patterns("__pycache__"))
    name = build_name()
    assert name.startswith("tokenloom_cpu_kernels_") and name.endswith(build_tag()) and name.isidentifier()
    assert build_name(copy) == name  # same contents elsewhere: the same build
    src = copy / "elementwise.cpp"
    src.write_text(src.read_text() + "\n// changed\n")
    changed = build_name(copy)
    assert changed != name and changed.endswith(build_tag())
    (copy / "kernels.h").write_text((copy / "kernels.h").read_text() + "\n")  # headers count too
    assert build_name(copy) not in (name, changed)
    assert build_name(CSRC, ["-O2"]) != build_name(CSRC, ["-O3"])


def test_build_name_follows_the_torch_installation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another virtual environment's torch (its include folders are in every compile command) builds in its
    own folder, so that two environments on one machine do not rebuild one folder in turn."""
    here = build_name()
    assert kernels._torch_includes() and all(f.startswith("-isystem") for f in kernels._torch_includes())
    monkeypatch.setattr(kernels, "_torch_includes", lambda: ["-isystem/other/venv/torch/include"])
    assert build_name() != here


def test_stale_lock_in_the_real_build_dir_does_not_hang(tmp_path: Path) -> None:
    """End to end, when the build already exists (no 2-minute compile here): a stale torch `lock`
    in the build folder is removed and the load returns the module."""
    import subprocess
    import sys

    build_dir = extensions_root() / build_name()
    if not (build_dir / f"{build_name()}.so").exists():
        pytest.skip("kernels not built yet (tests/test_kernels.py builds them)")
    # Written while holding the build lock, so no live build in another process can see it as its own.
    with build_lock(build_dir, timeout_s=60) as locked:
        assert locked
        (build_dir / "lock").write_text("")
    code = "from tokenloom.kernels import load_cpu_kernels; assert load_cpu_kernels() is not None"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # (another process taking the lock first would have removed it just the same)
    assert not (build_dir / "lock").exists()


def test_build_name_is_stable_across_loads() -> None:
    """torch's load extends the flag lists it is given; the name must not change after a load."""
    name = build_name()
    kernels.load_cpu_kernels()
    assert build_name() == name
