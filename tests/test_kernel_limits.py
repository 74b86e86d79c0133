"""The numbers shared by the C++ kernels and Python come from one place (tokenloom/kernels/limits.py)."""

from __future__ import annotations

import pytest

from tokenloom.kernels import limits, load_cpu_kernels
from tokenloom.models import layers
from tokenloom.quant import layout


def test_python_reads_the_shared_limits() -> None:
    assert layers.SKINNY_MAX_ROWS == limits.SKINNY_MAX_ROWS
    assert layers.PACKED_MAX_ROWS == limits.PACKED_MAX_ROWS
    assert layout.CHUNK == limits.QUANT_CHUNK
    assert layout.BLOCK == limits.INT4_BLOCK
    assert limits.compiler_defines() == [f"-DTOKENLOOM_{k}={v}" for k, v in limits.SHARED.items()]


def test_the_built_kernels_were_compiled_with_the_same_limits() -> None:
    k = load_cpu_kernels()
    if k is None:
        pytest.skip("the C++ kernels could not be built on this machine")
    assert k.limits() == limits.SHARED
    assert k.__name__.endswith(limits.build_tag())  # a build with other values would have another name


def test_the_build_is_named_after_the_values(monkeypatch: pytest.MonkeyPatch) -> None:
    tag = limits.build_tag()
    monkeypatch.setitem(limits.SHARED, "PACKED_MAX_ROWS", limits.PACKED_MAX_ROWS + 1)
    assert limits.build_tag() != tag
