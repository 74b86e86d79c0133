"""The GGUF file container (llama.cpp's format): header, metadata, tensor infos, memory-mapped data.

    f = read_gguf(path)      # f.metadata, f.tensors, f.tensor(name, dtype)

What the values mean (model config, Hugging Face weight names) is models/gguf.py's; the tokenizer is
rebuilt in models/gguf_tokenizer.py. Both read a GGUFFile from here.

The container is parsed here rather than with `gguf.GGUFReader`, whose per-array-element numpy views
make reading a large vocabulary slower than the whole rest of a load (see
docs/performance-notes.md#gguf-loading); this parser reads the same layout and memory-maps the tensor
data the same way.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from tokenloom.errors import ModelLoadError
from tokenloom.models.gguf_quants import dequantize

# Little-endian: "GGUF", u32 version, u64 tensor count, u64 kv count; kv pairs (string key, u32 type,
# value); tensor infos (string name, u32 n_dims, u64 dims[n_dims] fastest-first, u32 ggml type,
# u64 offset); padding to `general.alignment`; tensor data. Strings are u64 length + UTF-8 bytes.

_SCALAR_FORMATS: dict[int, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: the GGUF dims reversed (rows first)
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]  # scalars as Python values, numeric arrays as numpy, string arrays as lists
    tensors: dict[str, GGUFTensorInfo]
    data: np.ndarray  # the whole file, uint8, memory-mapped copy-on-write

    def raw(self, name: str) -> np.ndarray:
        """The bytes of tensor `name` (a view into the mapping, no copy)."""
        t = self.tensors[name]
        return self.data[t.offset : t.offset + t.nbytes]

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = self.tensors[name]
        return dequantize(self.raw(name), t.qtype, t.shape, dtype)


def read_gguf(path: Path) -> GGUFFile:
    """Parse the header of a GGUF file and memory-map its tensor data."""
    try:
        with open(path, "rb") as fh:
            # ACCESS_COPY: writable pages (so torch.from_numpy does not warn) that never reach the file.
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as e:  # ValueError: empty file
        raise ModelLoadError(f"{path}: cannot read GGUF file: {e}") from e
    try:
        return _parse(Path(path), mm)
    # Every read is bounds-checked (_Malformed); the rest is a corrupted value that got past the checks.
    except (struct.error, UnicodeDecodeError, IndexError, ValueError, TypeError, OverflowError,
            ZeroDivisionError, MemoryError) as e:
        raise ModelLoadError(f"{path}: malformed or truncated GGUF header ({e})") from e


class _Malformed(ValueError):
    """A count or length in the header that the file cannot hold (read_gguf adds the path)."""


# The fewest bytes one item can take: a kv pair (key length, value type, a 1-byte value), a tensor
# info (name length, n_dims, ggml type, offset), and an array element of a non-scalar type.
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8
_MAX_DIMS = 8  # ggml has 4


def _need(mm: mmap.mmap, off: int, n: int, what: str) -> None:
    """Raise _Malformed unless `n` bytes from `off` lie inside the file."""
    if n < 0 or off + n > len(mm):
        raise _Malformed(f"{what} needs {n} bytes at offset {off}, but the file has {len(mm)} (truncated?)")


def _parse(path: Path, mm: mmap.mmap) -> GGUFFile:
    if mm[:4] != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (magic {mm[:4]!r})")
    (version,) = _U32.unpack_from(mm, 4)
    if version & 0xFFFF == 0:  # a byte-swapped small number
        raise ModelLoadError(f"{path}: big-endian GGUF files are not supported")
    if version not in (2, 3):
        raise ModelLoadError(f"{path}: unsupported GGUF version {version}")
    _need(mm, 8, 16, "the tensor and metadata counts")
    n_tensors, n_kv = struct.unpack_from("<QQ", mm, 8)
    off = 24
    # Checked before any loop runs: a corrupted count must not spin for ages or allocate the impossible.
    if n_kv * _MIN_KV_BYTES > len(mm) - off:
        raise _Malformed(f"metadata count {n_kv} cannot fit in a {len(mm)}-byte file")
    if n_tensors * _MIN_TENSOR_INFO_BYTES > len(mm) - off:
        raise _Malformed(f"tensor count {n_tensors} cannot fit in a {len(mm)}-byte file")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key, off = _read_str(mm, off)
        _need(mm, off, 4, f"the value type of metadata key {key!r}")
        (vtype,) = _U32.unpack_from(mm, off)
        metadata[key], off = _read_value(mm, off + 4, vtype)

    infos: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(n_tensors):
        name, off = _read_str(mm, off)
        _need(mm, off, 4, f"the dimension count of tensor {name!r}")
        (n_dims,) = _U32.unpack_from(mm, off)
        if n_dims > _MAX_DIMS:
            raise _Malformed(f"tensor {name!r} has {n_dims} dimensions (at most {_MAX_DIMS})")
        _need(mm, off + 4, 8 * n_dims + 12, f"the shape, type and offset of tensor {name!r}")
        dims = struct.unpack_from(f"<{n_dims}Q", mm, off + 4)
        qtype_id, rel = struct.unpack_from("<IQ", mm, off + 4 + 8 * n_dims)
        off += 4 + 8 * n_dims + 12
        infos.append((name, tuple(int(d) for d in reversed(dims)), qtype_id, rel))

    alignment = int(metadata.get("general.alignment", 32))
    if alignment <= 0:
        raise _Malformed(f"general.alignment is {alignment}")
    data_start = -(-off // alignment) * alignment
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, shape, qtype_id, rel in infos:
        try:
            qtype = GGMLQuantizationType(qtype_id)
        except ValueError as e:
            raise ModelLoadError(f"{path}: tensor {name!r} has unknown ggml type id {qtype_id}") from e
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        n_elements = math.prod(shape)
        nbytes = n_elements // block_size * type_size
        start = data_start + rel
        if start + nbytes > len(mm):
            raise ModelLoadError(f"{path}: tensor {name!r} lies past the end of the file (truncated?)")
        tensors[name] = GGUFTensorInfo(name, shape, qtype, start, nbytes)
    data = np.frombuffer(mm, dtype=np.uint8)
    return GGUFFile(path, version, metadata, tensors, data)


def _read_str(mm: mmap.mmap, off: int) -> tuple[str, int]:
    _need(mm, off, 8, "a string length")
    (n,) = _U64.unpack_from(mm, off)
    _need(mm, off + 8, n, "a string")
    end = off + 8 + n
    return mm[off + 8 : end].decode("utf-8", errors="replace"), end


def _read_value(mm: mmap.mmap, off: int, vtype: int) -> tuple[Any, int]:
    if vtype == GGUFValueType.STRING:
        return _read_str(mm, off)
    if vtype == GGUFValueType.ARRAY:
        _need(mm, off, 12, "an array header")
        itype, count = struct.unpack_from("<IQ", mm, off)
        off += 12
        if itype in _SCALAR_FORMATS:
            dt = np.dtype(_SCALAR_FORMATS[itype])
            _need(mm, off, count * dt.itemsize, f"an array of {count} elements")
            arr = np.frombuffer(mm, dtype=dt, count=count, offset=off).copy()
            return arr, off + count * dt.itemsize
        if itype not in (GGUFValueType.STRING, GGUFValueType.ARRAY):
            raise _Malformed(f"unknown GGUF array element type {itype}")
        # Each string takes at least its 8-byte length, each nested array its 12-byte header.
        _need(mm, off, count * (8 if itype == GGUFValueType.STRING else 12), f"an array of {count} elements")
        items: list[Any] = []
        for _ in range(count):  # strings (tokens, merges) and nested arrays
            item, off = _read_value(mm, off, itype)
            items.append(item)
        return items, off
    fmt = _SCALAR_FORMATS.get(vtype)
    if fmt is None:
        raise _Malformed(f"unknown GGUF metadata value type {vtype}")
    _need(mm, off, struct.calcsize(fmt), "a metadata value")
    (value,) = struct.unpack_from(fmt, mm, off)
    return value, off + struct.calcsize(fmt)
