"""procs/inference/pages.py: a session filled whole (a fork's copy, a restore) sits on
transparent huge pages, a growing one on 4 KB pages (its capacity runs up to twice its
length, rows that cost nothing until written there), and huge_pages=False keeps any session
off them. Read from the process's own AnonHugePages; skipped where the kernel allows none."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from procs.inference.kvsession import KVSession
from procs.inference.loader import load
from procs.inference.model import Llama

MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
pytestmark = pytest.mark.skipif(not MODE.exists() or "[never]" in MODE.read_text(),
                                reason="no transparent huge pages here")


def huge_kb() -> int:
    return int(re.search(r"AnonHugePages:\s+(\d+) kB", Path("/proc/self/smaps_rollup").read_text()).group(1))


def test_only_sessions_filled_whole_are_on_huge_pages(model_path):
    m = Llama(load(model_path, torch.float32, "cpu"), 4096, packed=False)
    n = 3000
    src = KVSession(m, 4096, 512)
    before = huge_kb()
    src.reserve(n)                           # as a prefill grows it
    src.k[:, :, :n].normal_()
    src.v[:, :, :n].normal_()
    src.tokens = list(range(1, n + 1))
    assert huge_kb() - before < 2048, "a growing session's rows on huge pages"
    tokens, k, v = src.export(n)
    for fill in ("copy_prefix", "import_"):
        for huge in (True, False):
            s = KVSession(m, 4096, 512, huge_pages=huge)
            before = huge_kb()
            if fill == "copy_prefix":
                s.copy_prefix(src, n)
            else:
                s.import_(tokens, None, k, v)
            grew = huge_kb() - before
            # K and V of 30 layers x 3 heads x 3,072 rows x 64 f32: 70 MB each
            if huge:
                assert grew >= 2 * 64 << 10, (fill, grew)
            else:
                assert grew < 2048, (fill, grew)
            assert torch.equal(s.k[:, :, :n], src.k[:, :, :n]) and s.tokens == src.tokens
