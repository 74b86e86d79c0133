"""Model weights on 2 MiB pages (Linux transparent huge pages), for the memory-bound decode step.

A decode step of one or a few rows streams every weight once and does little arithmetic on it, so it runs
at the speed the memory delivers the weights. On 4 KiB pages that stream crosses a page every 4 KiB, and
the hardware prefetchers stop at each page boundary, where a TLB miss waits; on 2 MiB pages that happens
every 2 MiB. Measured on a 2-core AMD EPYC (Zen 4): SmolLM2's 30 layers of linears for one row, Q4_1 codes
2.9-3.2 ms on 4 KiB pages against 2.3-2.7 ms on 2 MiB pages, bf16 6.0-7.4 against 5.3-7.1 ms
(docs/performance-notes.md, "Weights on huge pages").

After loading (and quantizing, and prepacking), every weight tensor of the model is copied into one
anonymous mapping that asks the kernel for huge pages (madvise MADV_HUGEPAGE) and the module's parameter
or buffer is pointed at its copy; the old tensor is freed as it goes, so the peak is the model plus one
tensor. The C++ decode stack is built afterwards, from the moved tensors. Linux with transparent huge pages
set to `always` or `madvise` only; elsewhere, or with --no-huge-pages, the weights stay where they are.
oneDNN's prepacked copies (opaque tensors oneDNN allocates itself) are not moved.
"""

from __future__ import annotations

import ctypes
import mmap
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page
ALIGN = 64  # each tensor's start in the arena: a cache line (the kernels' vector loads)
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(setting: Path = THP_SETTING) -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise" or "never"); None where there is none."""
    try:
        text = setting.read_text()
    except OSError:
        return None
    m = re.search(r"\[(\w+)\]", text)
    return m.group(1) if m else None


def huge_pages_usable(setting: Path = THP_SETTING) -> str | None:
    """Why weights cannot go on huge pages here (None: they can)."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return "not Linux"
    mode = thp_mode(setting)
    if mode is None:
        return "the kernel has no transparent huge pages"
    if mode == "never":
        return "transparent huge pages are off (never)"
    return None


@dataclass(frozen=True)
class Moved:
    """What move_to_huge_pages did: how many tensors and bytes it moved, and how many of the arena's bytes the
    kernel reports on huge pages (AnonHugePages of its mapping; 0 where it could not read it)."""

    tensors: int
    nbytes: int
    huge_bytes: int

    def describe(self) -> str:
        return (f"{self.tensors} weight tensors ({self.nbytes / 1e6:.1f} MB) in one mapping, "
                f"{self.huge_bytes / 1e6:.1f} MB of it on 2 MiB pages")


def _movable(t: torch.Tensor | None) -> bool:
    return (t is not None and t.device.type == "cpu" and t.layout == torch.strided and not t.is_mkldnn
            and t.numel() > 0 and t.is_contiguous())


@dataclass
class _Slot:
    """One tensor to move and every (module, name) that holds it."""

    tensor: torch.Tensor
    is_param: bool
    owners: list[tuple[nn.Module, str]]


def _slots(modules: list[nn.Module]) -> list[_Slot]:
    """Every movable parameter and buffer once, with all its owners: a parameter tied to several modules
    (embeddings and LM head) or a buffer registered in several is one tensor object, moved once."""
    by_id: dict[int, _Slot] = {}
    for root in modules:
        for mod in root.modules():
            for is_param, table in ((True, mod._parameters), (False, mod._buffers)):
                for name, t in table.items():
                    if _movable(t):
                        by_id.setdefault(id(t), _Slot(t, is_param, [])).owners.append((mod, name))
    return list(by_id.values())


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def move_to_huge_pages(*modules: nn.Module) -> Moved:
    """Copy the modules' weights into one huge-page mapping (see the module docstring); returns what moved.

    A tensor object held by several modules stays one (moved once, every holder pointed at the copy); two
    different tensor objects over one storage (views) would each get their own copy, which this codebase's
    models do not have."""
    count, nbytes, arena_start = _copy_into_arena(_slots(list(modules)))
    _trim_heap()  # after _copy_into_arena returned: nothing refers to the old tensors any more
    return Moved(count, nbytes, anon_huge_bytes(arena_start) if count else 0)


def _copy_into_arena(slots: list[_Slot]) -> tuple[int, int, int]:
    """The slots' tensors copied into a new mapping and their modules pointed at the copies: (tensors, bytes,
    the address of the arena's first 2 MiB boundary)."""
    if not slots:
        return 0, 0, 0
    sizes = [s.tensor.numel() * s.tensor.element_size() for s in slots]
    total = sum(_round_up(n, ALIGN) for n in sizes)
    arena = mmap.mmap(-1, _round_up(total, HUGE_PAGE) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arena.madvise(mmap.MADV_HUGEPAGE)  # before any page is touched: each first touch then faults in 2 MiB
    raw = torch.frombuffer(arena, dtype=torch.uint8)  # keeps `arena` alive as long as any view of it lives
    start = (-raw.data_ptr()) % HUGE_PAGE  # the first 2 MiB boundary: the pages before it could only be small
    off = start
    for slot, n in zip(slots, sizes):
        new = raw[off:off + n].view(slot.tensor.dtype).view(slot.tensor.shape)
        new.copy_(slot.tensor)
        if slot.is_param:
            slot.tensor.data = new  # the same Parameter object in every holder: ties and references stay valid
        else:
            for mod, name in slot.owners:
                mod._buffers[name] = new
            slot.tensor = new  # the last reference to the old buffer: freed now, not after the loop
        off += _round_up(n, ALIGN)
    return len(slots), sum(sizes), raw.data_ptr() + start


def _trim_heap() -> None:
    """Hand the old tensors' freed memory back to the system (glibc keeps freed heap memory for reuse and
    raises its mmap threshold after large frees, so without this the move would cost resident memory about
    the size of the weights' smaller tensors)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own symbols: libc's where it is glibc
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)


def anon_huge_bytes(address: int, smaps: Path = Path("/proc/self/smaps")) -> int:
    """AnonHugePages of the mapping that holds `address`, in bytes (0 where /proc says nothing)."""
    try:
        text = smaps.read_text()
    except OSError:
        return 0
    inside = False
    for line in text.splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0
