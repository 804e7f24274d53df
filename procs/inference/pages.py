"""Transparent huge pages for a K/V session's rows on the CPU: madvise(MADV_HUGEPAGE) on the
2 MB-aligned span of a freshly allocated K or V tensor (Linux, where the kernel's
transparent_hugepage/enabled is `madvise` or `always`). A session's fresh rows are filled in
one go when a checkpoint is restored into them or another session's prefix is copied into
them (a side request beside a resident conversation), and faulting them in 4 KB at a time
was most of that copy (bench/bench_pages.py: 1.75-2.95x faster on 2 MB pages).

Only a session filled whole (KVSession.reserve(huge=layers) in copy_prefix and import_, whose
capacity is its length rounded up to a chunk), and of a restored one only the layers written
whole (not a windowed layer, which gets its last W rows: on 2 MB pages each of its touched
extents would be resident whole), not a growing one, nor every allocation
(torch's THP_MEM_ALLOC_ENABLE=1): a 2 MB page is resident whole once touched, and a growing
session's capacity is up to twice its length (reserve doubles it), rows that on 4 KB pages
cost nothing until written. With every allocation on huge pages, bench_parallel's inference
peaked at 1,588 MiB against 1,334 without, past the model and the K/V budget (1,418 MiB);
with every session's tensors on them, 1,587 MiB.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

HUGE = 2 << 20
MADV_HUGEPAGE = 14          # linux/mman.h
# glibc's largest dynamic mmap threshold (64-bit): an allocation above it always gets a
# mapping of its own, unmapped when freed. One below may come from the heap, and its advice
# would stay on the range for whatever malloc puts there next (a growing session's rows).
OWN_MAPPING = 32 << 20

_madvise = None
if sys.platform.startswith("linux"):
    try:
        _madvise = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        _madvise = None


def advise_huge(t: torch.Tensor, within: torch.Tensor | None = None) -> bool:
    """Ask for huge pages under t's whole 2 MB extents (a CPU tensor, or a view of `within`,
    of its own allocation, not yet touched there). Returns whether the kernel took the
    advice (False off Linux, on a GPU, for an allocation that may sit in malloc's heap or a
    span under 2 MB, or where THP is off)."""
    base = t if within is None else within
    if _madvise is None or t.device.type != "cpu" or base.numel() * base.element_size() <= OWN_MAPPING:
        return False
    start = t.data_ptr()
    lo, hi = -(-start // HUGE) * HUGE, (start + t.numel() * t.element_size()) // HUGE * HUGE
    return hi > lo and _madvise(lo, hi - lo, MADV_HUGEPAGE) == 0
