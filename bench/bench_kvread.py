"""How fast decode's attention reads the K/V cache, against how fast this machine streams the
same number of bytes, measured in one run (interleaved, medians).

A long-context decode step is a read of every cached K/V row (at 4,700 tokens of the default
model, 108 MB in bf16, more than its ~92 MB of weights). This bench times the native decode
attention (kernels/attention.c, one query per head, every layer's cache in its own tensor as
a session holds them) and a plain streaming reduction (torch.sum) over a buffer of the same
size, and prints each one's GB/s and their ratio: how far the attention's reads are from the
memory bandwidth.

    .venv/bin/python bench/bench_kvread.py [--contexts 2048 4700 8000] [--dtype auto|bf16|f32] [--lib OLD.so]

--lib adds another build of the kernels (a kernels-*.so from an older checkout's cache,
~/.cache/ricordo/kernels) to the same rounds: two kernel versions compared in one process.

Defaults are SmolLM2-135M's shape (30 layers, 3 K/V heads, 3 query heads each, head dim 64).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.machine import cpu_name  # noqa: E402
from bench.report import emit, log  # noqa: E402
from procs.inference import native  # noqa: E402
from procs.inference.native_attention import DecodeAttention  # noqa: E402
from procs.inference.runtime import pick_dtype  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 4700, 8000])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--groups", type=int, default=3, help="query heads per K/V head")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="auto", choices=("auto", "bf16", "f32"))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--lib", action="append", default=[], help="another kernels-*.so to time in the same rounds")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    kernels = native.load()
    if kernels is None:
        raise SystemExit("the native kernels did not build")
    builds = {"this checkout": kernels.attention}
    builds.update({os.path.basename(p): DecodeAttention(ctypes.CDLL(os.path.abspath(p))) for p in a.lib})
    dtype = pick_dtype(a.dtype, "cpu")
    L, KV, G, D, cap = a.layers, a.kv_heads, a.groups, a.head_dim, max(a.contexts)
    gen = torch.Generator().manual_seed(0)
    # one tensor per layer and per K/V, [KV, cap, D], as a session's cache rows are laid out
    caches = [(torch.randn(KV, cap, D, generator=gen).to(dtype), torch.randn(KV, cap, D, generator=gen).to(dtype))
              for _ in range(L)]
    q = torch.randn(KV * G, D, generator=gen)
    scale = D ** -0.5
    res = {"cpu": cpu_name(), "dtype": str(dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
           "shape": {"layers": L, "kv_heads": KV, "groups": G, "head_dim": D}, "rows": []}
    log(f"{res['cpu']}, {res['dtype']}, {res['threads']} threads")
    for S in a.contexts:
        nbytes = 2 * L * KV * S * D * caches[0][0].element_size()
        flat = torch.randn(nbytes // 4, generator=gen)      # the same bytes, contiguous
        att, stream = {name: [] for name in builds}, []
        for r in range(a.rounds):
            for name in (list(builds) if r % 2 else list(builds)[::-1]):
                t = time.perf_counter()
                for k, v in caches:
                    builds[name](q, k[:, :S], v[:, :S], scale)
                att[name].append(time.perf_counter() - t)
            t = time.perf_counter()
            flat.sum()
            stream.append(time.perf_counter() - t)
        ts = statistics.median(stream)
        for name, times in att.items():
            ta = statistics.median(times)
            res["rows"].append({"build": name, "context": S, "mb": nbytes / 1e6, "attention_ms": ta * 1e3,
                                "stream_ms": ts * 1e3, "attention_gb_s": nbytes / ta / 1e9,
                                "stream_gb_s": nbytes / ts / 1e9})
    lines = [f"{res['cpu']}; {res['dtype']} K/V; {res['threads']} threads; {L} layers x {KV} K/V heads x "
             f"{G} queries each, head dim {D}; medians of {a.rounds} interleaved rounds", "",
             "| kernels | context | K/V MB | decode attention | streaming read (torch.sum) | attention / stream "
             "| time / this checkout's |", "|---|---|---|---|---|---|---|"]
    base = {r["context"]: r["attention_ms"] for r in res["rows"] if r["build"] == "this checkout"}
    for r in res["rows"]:
        lines.append(f"| {r['build']} | {r['context']} | {r['mb']:.0f} | {r['attention_ms']:.2f} ms, "
                     f"{r['attention_gb_s']:.1f} GB/s "
                     f"| {r['stream_ms']:.2f} ms, {r['stream_gb_s']:.1f} GB/s "
                     f"| {r['attention_gb_s'] / r['stream_gb_s']:.2f}x | {r['attention_ms'] / base[r['context']]:.2f}x |")
    return emit("\n".join(lines), res, a.json)


if __name__ == "__main__":
    sys.exit(main())
