"""Decode on the dense weights against decode on the packed weight-only copies (int4 / int8,
procs/inference/model.Linear), the same model in one process, steps interleaved, medians.

    .venv/bin/python bench/bench_decode_weights.py [--model gemma3-270m] [--dtype f32] [--context 512]

For an AVX2-only machine's kernels on an AVX-512 one: ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.bench_model import cpu_name  # noqa: E402
from bench.report import emit, log  # noqa: E402
from common.config import Settings  # noqa: E402
from common.models import resolve  # noqa: E402
from procs.inference.loader import load  # noqa: E402
from procs.inference.model import KVSession, Llama  # noqa: E402
from procs.inference.runtime import pick_dtype  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="GGUF path or catalogue name; empty = the default model")
    ap.add_argument("--dtype", default="auto", choices=("auto", "bf16", "f32"))
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    s = Settings(model=a.model, dtype=a.dtype)
    path = resolve(s.model, s.models_path())
    dtype = pick_dtype(a.dtype, "cpu")
    ctx = a.context + a.steps + 8
    models = {k: Llama(load(path, dtype, "cpu"), ctx, packed=k == "packed") for k in ("dense", "packed")}
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 40000) for _ in range(a.context)]
    sessions = {}
    for k, m in models.items():
        sessions[k] = KVSession(m, ctx, 512)
        sessions[k].prefill(prompt)
    times = {k: [] for k in models}
    for _ in range(a.steps):
        tok = rng.randrange(1000, 40000)
        for k in models:
            t = time.perf_counter()
            sessions[k].decode(tok)
            times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    kinds = sorted({x.kind or "dense" for ly in models["packed"].layers for x in (ly.wqkv, ly.wo, ly.wgu, ly.wd)})
    res = {"cpu": cpu_name(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "model": os.path.basename(path), "dtype": str(dtype).replace("torch.", ""), "context": a.context,
           "threads": torch.get_num_threads(), "ms_per_token": med, "packed_kinds": kinds,
           "speedup": med["dense"] / med["packed"]}
    log(f"{res['cpu']}, torch {res['torch_cpu_capability']}, {res['dtype']}, {res['threads']} threads")
    table = ["| model | dtype | context | dense ms/token | packed ms/token (" + "+".join(kinds) + ") | speedup |",
             "|---|---|---|---|---|---|",
             f"| {res['model']} | {res['dtype']} | {a.context} | {med['dense']:.1f} | {med['packed']:.1f} | "
             f"{res['speedup']:.2f}x |"]
    return emit("\n".join(table), res, a.json)


if __name__ == "__main__":
    sys.exit(main())
