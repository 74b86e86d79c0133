"""The attention backends by name (--attention-backend; the names are config.AttentionBackendName).

The one module that imports every backend: base.py defines the interface they implement and imports none.
"""

from __future__ import annotations

from typing import get_args

import torch

from tokenloom.attention.base import AttentionBackend
from tokenloom.attention.cpu import CPUBackend
from tokenloom.attention.reference import ReferenceBackend
from tokenloom.attention.sdpa import SDPABackend
from tokenloom.config import AttentionBackendName
from tokenloom.errors import ConfigError
from tokenloom.kernels import load_cpu_kernels


def get_backend(name: AttentionBackendName, device: torch.device) -> AttentionBackend:
    """auto: the C++ kernel backend on CPU when it builds, else (and on CUDA) torch SDPA."""
    names = get_args(AttentionBackendName)
    if name not in names:
        raise ConfigError(f"unknown attention backend {name!r}; choose from {', '.join(names)}")
    if name == "reference":
        return ReferenceBackend()
    if name in ("auto", "cpu") and device.type == "cpu":
        kernels = load_cpu_kernels()
        if kernels is not None:
            return CPUBackend(kernels)
        if name == "cpu":
            raise ConfigError("--attention-backend cpu: the C++ kernels could not be built (see the log)")
    return SDPABackend()
