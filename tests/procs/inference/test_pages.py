"""procs/inference/pages.py: a session filled whole (a fork's copy, a restore) sits on
transparent huge pages, a growing one on 4 KB pages (its capacity runs up to twice its
length, rows that cost nothing until written there), and huge_pages=False keeps any session
off them, as does one small enough for malloc's heap. Read from the process's own
AnonHugePages of the sessions' own mappings; skipped unless the kernel's mode is `madvise`.
Each test runs in a fresh process: after the rest of the suite, malloc's state (its dynamic
mmap threshold, its heap) put a growing session's rows where huge pages were (a Xeon's run,
14 MB of them), which a test of this process's own pages cannot tell from the session's."""
from __future__ import annotations

import multiprocessing
import re
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch

from procs.inference.kvsession import KVSession
from procs.inference.loader import load
from procs.inference.model import Llama

MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# under `always` every allocation may get huge pages, and the 4 KB cases cannot be told apart
pytestmark = pytest.mark.skipif(not MODE.exists() or "[madvise]" not in MODE.read_text(),
                                reason="transparent huge pages not in madvise mode here")


def huge_kb(*tensors: torch.Tensor) -> int:
    """AnonHugePages (kB) of the mappings that hold these tensors' bytes, not of the whole
    process: a huge page collapsed elsewhere meanwhile (khugepaged works on its own time, in
    what earlier tests advised) once failed the 4 KB case by exactly 2,048 kB."""
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors]
    total, hit = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            lo, hi = int(head.group(1), 16), int(head.group(2), 16)
            hit = any(a < hi and lo < b for a, b in spans)
        elif hit and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


def fallbacks() -> int:
    """The kernel's count of faults on advised memory it could not serve with a huge page
    (fragmented memory: seen on this shared machine, a fork 66 MB short of huge pages)."""
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("thp_fault_fallback "):
            return int(line.split()[1])
    return 0


def in_fresh_process(fn, *args):
    """fn(*args) in a spawned process (its assertions fail here, with their message)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        return ex.submit(fn, *args).result()


def test_only_sessions_filled_whole_are_on_huge_pages(model_path):
    in_fresh_process(_only_sessions_filled_whole, model_path)


def _only_sessions_filled_whole(model_path):
    torch.set_num_threads(2)
    m = Llama(load(model_path, torch.float32, "cpu"), 4096, packed=False)
    n = 3000
    src = KVSession(m, 4096, 512)
    src.reserve(n)                           # as a prefill grows it
    src.k[:, :, :n].normal_()
    src.v[:, :, :n].normal_()
    src.tokens = list(range(1, n + 1))
    assert huge_kb(src.k, src.v) < 2048, "a growing session's rows on huge pages"
    tokens, k, v = src.export(n)
    for fill in ("copy_prefix", "import_"):
        for huge in (True, False):
            s = KVSession(m, 4096, 512, huge_pages=huge)
            before = fallbacks()
            if fill == "copy_prefix":
                s.copy_prefix(src, n)
            else:
                s.import_(tokens, None, k, v)
            grew = huge_kb(s.k, s.v)
            # K and V of 30 layers x 3 heads x 3,072 rows x 64 f32: 70 MB each
            if huge:   # each fault the kernel could not serve huge costs at most one 2 MB extent
                assert grew >= (2 * 64 << 10) - 2048 * (fallbacks() - before), (fill, grew)
            else:
                assert grew < 2048, (fill, grew)
            assert torch.equal(s.k[:, :, :n], src.k[:, :, :n]) and s.tokens == src.tokens
    # K of 1,024 rows is 23.6 MB: malloc may serve it from its heap, where the advice would
    # outlive the tensor, so a fork this small stays on 4 KB pages
    s = KVSession(m, 4096, 512)
    s.copy_prefix(src, 1000)
    assert huge_kb(s.k, s.v) < 2048 and s.k.numel() * 4 < 32 << 20


def test_a_restored_windowed_layer_stays_on_small_pages():
    """Gemma 3's sliding-window layers get only their last W rows from a checkpoint: on huge
    pages each would hold 2 MB resident for its few hundred KB, so only the layers written
    whole (the global ones) are advised; a fork's copy writes every row of every layer and
    advises them all."""
    in_fresh_process(_restored_windowed_layer)


def _restored_windowed_layer():
    torch.set_num_threads(2)
    from common.config import Settings
    from common.models import resolve
    m = Llama(load(resolve("gemma3-270m", Settings().models_path()), torch.float32, "cpu"), 8192, packed=False)
    windows = list(m.cfg.windows)
    n = 6000
    assert any(windows) and n > max(windows)
    glob = [li for li, w in enumerate(windows) if not w]
    src = KVSession(m, 8192, 512)
    src.reserve(n)
    src.k[:, :, :n].normal_()
    src.v[:, :, :n].normal_()
    src.tokens = list(range(1, n + 1))
    tokens, k, v = src.export(n)
    row = m.cfg.n_kv_heads * m.cfg.head_dim * 4                  # bytes per row of a layer
    layer_kb = -(-n // 512) * 512 * row >> 10                    # a layer's capacity
    s = KVSession(m, 8192, 512)
    before = fallbacks()
    s.import_(tokens, None, k, v)
    grew = huge_kb(s.k, s.v)
    # K and V: each global layer's span holds at least one whole 2 MB extent (less one for each
    # fault the kernel could not serve huge), and at most its own size
    short = 2048 * (fallbacks() - before)
    assert 2 * len(glob) * 2048 - short <= grew <= 2 * len(glob) * layer_kb, (grew, glob, layer_kb, short)
    for li, w in enumerate(windows):
        r = min(n, w) if w else n
        assert torch.equal(s.k[li, :, n - r:n], src.k[li, :, n - r:n])
    fork = KVSession(m, 8192, 512)
    before = fallbacks()
    fork.copy_prefix(s, n)
    short = 2048 * (fallbacks() - before)
    assert huge_kb(fork.k, fork.v) >= 2 * (len(windows) * layer_kb - 2048) - short, ("a fork's rows off huge pages",
                                                                                      short)
