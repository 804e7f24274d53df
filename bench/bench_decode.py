"""Decode paths against each other, in one process, the same model and tokens, steps
interleaved (ABC ABC ...), medians, at each context:

- native: one C call per token (procs/inference/native.Decoder, the default), packed weights;
- torch: torch's ops, torch's packed weight-only kernels (int4 / int8, bf16 activations) and
  the native attention kernel (--decode-kernels torch);
- torch-attn: the same with torch's batched-matmul attention (what decode ran before the
  native kernels);
- dense: native, on the dense weights (--decode-weights dense).

    .venv/bin/python bench/bench_decode.py [--model gemma3-270m] [--dtype f32] [--contexts 512 2048 8000]

For an AVX2-only machine's torch kernels on an AVX-512 one: ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2 (the native kernels are built for the CPU they run on).
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

from bench.machine import cpu_name  # noqa: E402
from bench.report import emit, log  # noqa: E402
from common.config import Settings  # noqa: E402
from common.models import resolve  # noqa: E402
from procs.inference import native  # noqa: E402
from procs.inference.loader import load  # noqa: E402
from procs.inference.model import Llama, _decode_attention  # noqa: E402
from procs.inference.kvsession import KVSession  # noqa: E402
from procs.inference.runtime import pick_dtype  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="GGUF path or catalogue name; empty = the default model")
    ap.add_argument("--dtype", default="auto", choices=("auto", "bf16", "f32"))
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8000])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--paths", nargs="+", default=["native", "torch", "torch-attn", "dense"])
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    s = Settings(model=a.model, dtype=a.dtype)
    path = resolve(s.model, s.models_path())
    dtype = pick_dtype(a.dtype, "cpu")
    kernels = native.load()
    if kernels is None:
        raise SystemExit("the native kernels did not build")
    ctx = max(a.contexts) + len(a.paths) * a.steps + 8
    models = {}
    for p in a.paths:
        m = Llama(load(path, dtype, "cpu"), ctx, packed=p != "dense",
                  kernels=None if p.startswith("torch") else kernels)
        m.attend = _decode_attention if p == "torch-attn" else kernels.attention
        models[p] = m
    rng = random.Random(0)
    res = {"cpu": cpu_name(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "model": os.path.basename(path), "dtype": str(dtype).replace("torch.", ""),
           "threads": torch.get_num_threads(), "rows": []}
    log(f"{res['cpu']}, torch {res['torch_cpu_capability']}, {res['dtype']}, {res['threads']} threads, {res['model']}")
    for n in a.contexts:
        prompt = [rng.randrange(1000, 40000) for _ in range(n)]
        sessions = {}
        for p, m in models.items():
            sessions[p] = KVSession(m, ctx, 512)
            sessions[p].prefill(prompt)
        times = {p: [] for p in models}
        for _ in range(a.steps):
            tok = rng.randrange(1000, 40000)
            for p in models:
                t = time.perf_counter()
                sessions[p].decode(tok)
                times[p].append(time.perf_counter() - t)
        row = {"context": n, **{p: 1 / statistics.median(v) for p, v in times.items()}}
        res["rows"].append(row)
        log(f"context {n}: " + ", ".join(f"{p} {row[p]:.1f} tok/s" for p in models))
        del sessions
    base = a.paths[0]
    lines = [f"decode tok/s, {res['model']}, {res['cpu']}, torch {res['torch_cpu_capability']}, {res['dtype']}, "
             f"{res['threads']} threads (medians of {a.steps} interleaved steps; ratio: {base} against each)",
             "| context | " + " | ".join(a.paths) + " |", "|---|" + "---|" * len(a.paths)]
    lines += [f"| {r['context']} | " + " | ".join(
        f"{r[p]:.1f}" + ("" if p == base else f" ({r[base] / r[p]:.2f}x)") for p in a.paths) + " |"
        for r in res["rows"]]
    return emit("\n".join(lines), res, a.json)


if __name__ == "__main__":
    sys.exit(main())
