"""Decode attention on the CPU, the kernel ricordo uses (the query heads of one K/V head as
one small GEMM: procs/inference/model._decode_attention) against torch's SDPA with
enable_gqa (what decode used before), inside the real model, measured in the same run:
the default model, a context of N tokens prefilled once, then decode steps timed with one
kernel and the other in turn (ABAB...), medians.

    .venv/bin/python bench/bench_decode_attention.py [--contexts 512 2048 8000 20000] [--steps 16]
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
import torch.nn.functional as F  # noqa: E402

from bench.bench_model import cpu_name, rand_ids  # noqa: E402
from bench.report import emit, log  # noqa: E402
from common.config import Settings  # noqa: E402
from procs.inference import model as model_mod  # noqa: E402
from procs.inference.model import KVSession  # noqa: E402
from procs.inference.runtime import build  # noqa: E402

GROUPED = model_mod._decode_attention


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    H, D = q.shape
    return F.scaled_dot_product_attention(q.view(1, H, 1, D), k.unsqueeze(0), v.unsqueeze(0),
                                          enable_gqa=True, scale=scale).view(1, H * D)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="*", default=[512, 2048, 8000, 20000])
    ap.add_argument("--steps", type=int, default=16, help="decode steps per kernel and context (median)")
    ap.add_argument("--dtype", default="auto", choices=("auto", "bf16", "f32"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    ctx = max(args.contexts) + 2 * args.steps + 8
    s = Settings.load("inference", ["--dtype", args.dtype, "--ctx-size", str(ctx)])
    model, n_ctx, _ = build(s)
    rng = random.Random(0)
    res = {"cpu": cpu_name(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "dtype": str(model.dtype).replace("torch.", ""), "threads": torch.get_num_threads(), "rows": []}
    log(f"{res['cpu']}, torch {res['torch_cpu_capability']}, {res['dtype']}, {res['threads']} threads")
    for n in args.contexts:
        sess = KVSession(model, n_ctx, s.chunk_size)
        sess.prefill(rand_ids(rng, n))
        times = {"grouped": [], "sdpa": []}
        for i in range(2 * args.steps):
            name = "grouped" if i % 2 == 0 else "sdpa"
            model_mod._decode_attention = GROUPED if name == "grouped" else sdpa
            tok = rng.randrange(100, 49000)
            t = time.perf_counter()
            sess.decode(tok)
            times[name].append(time.perf_counter() - t)
        model_mod._decode_attention = GROUPED
        g, d = statistics.median(times["grouped"]), statistics.median(times["sdpa"])
        res["rows"].append({"context": n, "grouped_tok_s": 1 / g, "sdpa_tok_s": 1 / d, "ratio": d / g})
        log(f"context {n}: grouped {1 / g:.1f} tok/s, sdpa {1 / d:.1f} tok/s, x{d / g:.2f}")
    lines = [f"decode attention, {res['cpu']}, torch {res['torch_cpu_capability']}, {res['dtype']}, "
             f"{res['threads']} threads (tok/s, medians of {args.steps} steps each, interleaved)",
             "| context | grouped GEMM (ricordo) | SDPA enable_gqa (before) | ratio |", "|---|---|---|---|"]
    lines += [f"| {r['context']} | {r['grouped_tok_s']:.1f} | {r['sdpa_tok_s']:.1f} | {r['ratio']:.2f}x |"
              for r in res["rows"]]
    return emit("\n".join(lines), res, args.json)


if __name__ == "__main__":
    sys.exit(main())
