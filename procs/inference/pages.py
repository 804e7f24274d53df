"""Transparent huge pages for a K/V session's rows on the CPU: madvise(MADV_HUGEPAGE) on the
2 MB-aligned span of a freshly allocated K or V tensor (Linux, where the kernel's
transparent_hugepage/enabled is `madvise` or `always`). A session's fresh rows are filled in
one go when a checkpoint is restored into them or another session's prefix is copied into
them (a side request beside a resident conversation), and faulting them in 4 KB at a time
was most of that copy (bench/bench_pages.py: 1.75-2.95x faster on 2 MB pages).

Only a session filled whole (KVSession.reserve(huge=True) in copy_prefix and import_, whose
capacity is its length rounded up to a chunk), not a growing one, nor every allocation
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

_madvise = None
if sys.platform.startswith("linux"):
    try:
        _madvise = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        _madvise = None


def advise_huge(t: torch.Tensor) -> bool:
    """Ask for huge pages under t's whole 2 MB extents (a CPU tensor of its own, not yet
    touched there). Returns whether the kernel took the advice (False off Linux, on a GPU,
    for a tensor under 2 MB, or where THP is off)."""
    if _madvise is None or t.device.type != "cpu":
        return False
    start = t.data_ptr()
    lo, hi = -(-start // HUGE) * HUGE, (start + t.numel() * t.element_size()) // HUGE * HUGE
    return hi > lo and _madvise(lo, hi - lo, MADV_HUGEPAGE) == 0
