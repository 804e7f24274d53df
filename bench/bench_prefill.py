"""Prefill's attention: the native kernel (kernels/prefill.c) against torch's SDPA, measured
interleaved in one process on the same model and prompt.

Two tables: whole prefills (tok/s, a model built once with each attention) and attention
alone over one layer's chunks (GFLOP/s of causal attention, the prompt in 512-token chunks as
prefill calls it). Medians of --repeats; the CPU and torch's capability are printed.

    .venv/bin/python bench/bench_prefill.py [--model M] [--dtype auto|bf16|f32] [--sizes 2048 8000]

--sinks: instead, attention alone with gpt-oss's sink logits at gpt-oss-20b's head shape (64
query heads, 8 K/V heads of 64 dims), over the whole prompt and over a 128-token window: the
kernel against torch's ops (torch_attention.sink_attention; SDPA takes no sinks).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch                                           # noqa: E402
import torch.nn.functional as F                        # noqa: E402

from common.config import Settings                     # noqa: E402
from procs.inference.kvsession import KVSession        # noqa: E402
from procs.inference import native                     # noqa: E402
from procs.inference.cpu import bf16_products_fast     # noqa: E402
from procs.inference.model import _mask                # noqa: E402
from procs.inference.torch_attention import sink_attention   # noqa: E402
from procs.inference.runtime import build, pick_dtype  # noqa: E402
from bench.machine import cpu_name                 # noqa: E402


def attention_only(model, n: int, chunk: int, repeats: int) -> dict:
    """Seconds for one layer's attention over an n-token prompt in chunks, each kind."""
    c = model.cfg
    H, KV, D, dt = c.n_heads, c.n_kv_heads, c.head_dim, model.dtype
    g = torch.Generator().manual_seed(0)
    kc, vc = (torch.randn(KV, n, D, generator=g).to(dt) for _ in range(2))
    scale = D ** -0.5
    secs = {"native": 0.0, "sdpa": 0.0}
    for pos in range(0, n, chunk):
        T = min(chunk, n - pos)
        S = pos + T
        q = torch.randn(T, H, D, generator=g).to(dt)
        mask = _mask(torch.arange(pos, S).unsqueeze(1), torch.arange(S), 0, dt)
        times = {k: [] for k in secs}
        for _ in range(repeats):
            t = time.perf_counter()
            model.prefill_attend(q, kc, vc, pos, 0, scale)
            times["native"].append(time.perf_counter() - t)
            t = time.perf_counter()
            F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), kc[None, :, :S], vc[None, :, :S],
                                           attn_mask=mask, enable_gqa=True, scale=scale)
            times["sdpa"].append(time.perf_counter() - t)
        for k in secs:
            secs[k] += statistics.median(times[k])
    flops = sum(4 * min(chunk, n - p) * (p + min(chunk, n - p) / 2) * D * H for p in range(0, n, chunk))
    return {k: {"s": v, "gflops": flops / v / 1e9} for k, v in secs.items()}


def sinks_table(sizes: list[int], dtype: str, repeats: int) -> None:
    """Seconds of one layer's attention with sinks over each prompt in 512-token chunks, as
    prefill calls it (a windowed layer passes torch only the keys its window can see)."""
    kernels = native.load()
    assert kernels is not None, "the native kernels did not build"
    H, KV, D = 64, 8, 64
    dt = pick_dtype(dtype, "cpu")
    pairs = dt == torch.bfloat16 and bf16_products_fast()
    rows = ["| tokens | window | kernel (s) | torch's ops (s) | torch / kernel |", "|---|---|---|---|---|"]
    for n in sizes:
        g = torch.Generator().manual_seed(0)
        kc, vc = (torch.randn(KV, n, D, generator=g).to(dt) for _ in range(2))
        sinks, scale = torch.randn(H, generator=g), D ** -0.5
        for window in (0, 128):
            secs = {"kernel": 0.0, "torch": 0.0}
            for pos in range(0, n, 512):
                T = min(512, n - pos)
                S, ks = pos + T, max(0, pos - window + 1) if window else 0
                q = torch.randn(T, H, D, generator=g).to(dt)
                mask = _mask(torch.arange(pos, S).unsqueeze(1), torch.arange(ks, S), window, dt)
                times = {k: [] for k in secs}
                for _ in range(repeats):
                    t = time.perf_counter()
                    kernels.prefill(q, kc, vc, pos, window, scale, pairs, sinks)
                    times["kernel"].append(time.perf_counter() - t)
                    t = time.perf_counter()
                    sink_attention(q, kc[:, ks:S], vc[:, ks:S], mask, scale, sinks)
                    times["torch"].append(time.perf_counter() - t)
                for k in secs:
                    secs[k] += statistics.median(times[k])
            rows.append(f"| {n} | {window or 'none'} | {secs['kernel']:.3f} | {secs['torch']:.3f} | "
                        f"{secs['torch'] / secs['kernel']:.2f}x |")
    rows.append(f"\nCPU: {cpu_name()}; {str(dt).replace('torch.', '')}, bf16 products {pairs}; "
                f"{torch.get_num_threads()} threads")
    print("\n".join(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--dtype", default="auto", choices=("auto", "bf16", "f32"))
    ap.add_argument("--sizes", type=int, nargs="*", default=[512, 2048, 8000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--sinks", action="store_true")
    args = ap.parse_args()
    if args.sinks:
        if args.threads:
            torch.set_num_threads(args.threads)
        return sinks_table(args.sizes, args.dtype, args.repeats)
    models = {}
    for kind in ("native", "sdpa"):
        models[kind] = build(Settings(model=args.model, dtype=args.dtype, threads=args.threads,
                                      prefill_attention=kind))[0]
    assert models["native"].prefill_attend is not None, "the native kernels did not build"
    rng = random.Random(0)
    res = {"cpu": cpu_name(), "torch_capability": torch.backends.cpu.get_cpu_capability(),
           "dtype": str(models["native"].dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
           "prefill": {}, "attention": {}}
    for n in args.sizes:
        ids = [rng.randrange(100, 20000) for _ in range(n)]
        times = {k: [] for k in models}
        for _ in range(args.repeats if n < 4096 else max(1, args.repeats - 1)):
            for kind, m in models.items():
                s = KVSession(m, n + 16, 512)
                t = time.perf_counter()
                s.prefill(ids)
                times[kind].append(time.perf_counter() - t)
        res["prefill"][n] = {k: n / statistics.median(v) for k, v in times.items()}
        res["attention"][n] = attention_only(models["native"], n, 512, args.repeats)
        p, a = res["prefill"][n], res["attention"][n]
        print(f"  {n}: prefill native {p['native']:.1f} / SDPA {p['sdpa']:.1f} tok/s; attention per layer "
              f"{a['native']['gflops']:.0f} / {a['sdpa']['gflops']:.0f} GFLOP/s", file=sys.stderr, flush=True)
    rows = ["| tokens | prefill native (tok/s) | prefill SDPA (tok/s) | ratio | attention native (GFLOP/s) | "
            "attention SDPA (GFLOP/s) | ratio |", "|---|---|---|---|---|---|---|"]
    for n in args.sizes:
        p, a = res["prefill"][n], res["attention"][n]
        rows.append(f"| {n} | {p['native']:.1f} | {p['sdpa']:.1f} | {p['native'] / p['sdpa']:.2f}x | "
                    f"{a['native']['gflops']:.0f} | {a['sdpa']['gflops']:.0f} | "
                    f"{a['native']['gflops'] / a['sdpa']['gflops']:.2f}x |")
    rows.append(f"\nCPU: {res['cpu']}; torch CPU capability {res['torch_capability']}; {res['dtype']}; "
                f"{res['threads']} threads")
    print("\n".join(rows), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
