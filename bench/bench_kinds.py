"""Decode's weight products per packed kind (int4, int8, 5-bit, dense): each layer's Linear
multiplied into one f32 activation row by the native kernels (`mat_mul`, what a decode step
runs), medians of --repeats, summed per kind, with the parameters each kind holds and its
rate in G params/s. Tells which kind a slow decode step spends its time in (on an AVX2-only
EPYC, 2026-12-08: 5-bit groups 5.5 G params/s, int4 / int8 22-36; bench/RESULTS-avx2.md).
The output head is not included.

    .venv/bin/python bench/bench_kinds.py [--model qwen2.5-coder-0.5b] [--repeats 15]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch                                           # noqa: E402

from bench.machine import cpu_name                     # noqa: E402
from common.config import Settings                     # noqa: E402
from common.models import resolve                      # noqa: E402
from procs.inference import native                     # noqa: E402
from procs.inference.linear import Linear              # noqa: E402
from procs.inference.loader import load                # noqa: E402
from procs.inference.model import Llama                # noqa: E402
from procs.inference.packs import MAT_Q4, MAT_Q5, MAT_Q8   # noqa: E402

NAMES = {MAT_Q4: "int4", MAT_Q8: "int8", MAT_Q5: "5-bit"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    m = Llama(load(resolve(a.model, Settings().models_path()), torch.float32, "cpu"), 1024, kernels=native.load())
    lins = [v for ly in m.layers for v in (getattr(ly, f) for f in dir(ly) if not f.startswith("_"))
            if isinstance(v, Linear) and v.mat is not None]
    agg: dict[str, list] = {}
    for lin in lins:
        cm = lin.mat.mat()
        x = torch.randn(1, cm.k)
        for _ in range(3):
            lin.kernels.mat_mul(lin.mat, x)
        ts = []
        for _ in range(a.repeats):
            t = time.perf_counter()
            lin.kernels.mat_mul(lin.mat, x)
            ts.append(time.perf_counter() - t)
        row = agg.setdefault(NAMES.get(cm.kind, f"dense ({cm.kind})"), [0, 0, 0.0])
        row[0], row[1], row[2] = row[0] + 1, row[1] + cm.n * cm.k, row[2] + statistics.median(ts)
    print("| kind | matrices | M params | ms a token | G params/s |\n|---|---|---|---|---|")
    for kind, (n, params, secs) in sorted(agg.items()):
        print(f"| {kind} | {n} | {params / 1e6:.1f} | {1e3 * secs:.2f} | {params / secs / 1e9:.1f} |")
    print(f"\n{a.model}, f32 activations, {torch.get_num_threads()} threads, CPU: {cpu_name()}")


if __name__ == "__main__":
    main()
