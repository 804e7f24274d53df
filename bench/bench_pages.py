"""A K/V session filled whole on transparent huge pages (KVSession(huge_pages=True), the
server's default: procs/inference/pages.py) against 4 KB pages, in the same run: the same
child process started with one and the other in turn (fresh processes, so that no freed and
already faulted memory is reused), each timing, on the real model's K/V shapes:

  fork     a new session made from another's first n tokens (KVSession.copy_prefix: a side
           request beside a resident conversation)
  restore  a session filled from a checkpoint's rows (KVSession.import_, the copy
           Disk.restore makes from the file's pages)
  decode   one decode step of that restored session at n tokens of context

medians of --reps in each child, children alternated --rounds times; the figures are the
medians over the rounds, and the ratio 4 KB / huge (above 1: huge pages faster); then each
child's RSS at its end.

    python bench/bench_pages.py [--model gemma3-270m --tokens 22000] [--dtype f32]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.machine import cpu_name  # noqa: E402


def child(a) -> dict:
    import psutil
    import torch
    from common.config import Settings
    from common.models import resolve
    from procs.inference.kvsession import KVSession
    from procs.inference.steps import decode_many
    from procs.inference.runtime import build
    s = Settings(model=resolve(a.model, Settings().models_path()), device="cpu", ctx_size=a.tokens + 512,
                 dtype=a.dtype)
    model, n_ctx, _ = build(s)
    n, huge = a.tokens, bool(a.huge)
    src = KVSession(model, n_ctx, s.chunk_size)
    src.reserve(n)
    src.k[:, :, :n].normal_()
    src.v[:, :, :n].normal_()
    src.tokens = [1 + i % 1000 for i in range(n)]
    src.logits = torch.zeros(model.cfg.vocab_size)
    tokens, k, v = src.export(n)
    out = {"fork": [], "restore": [], "decode": []}
    for i in range(a.reps):
        dst = KVSession(model, n_ctx, s.chunk_size, huge_pages=huge)
        t = time.perf_counter()
        dst.copy_prefix(src, n)
        out["fork"].append(time.perf_counter() - t)
        del dst
        dst = KVSession(model, n_ctx, s.chunk_size, huge_pages=huge)
        t = time.perf_counter()
        dst.import_(tokens, src.logits, k, v)
        out["restore"].append(time.perf_counter() - t)
        if i < a.reps - 1:
            del dst
    for i in range(a.reps + 2):            # the restored session's next tokens
        t = time.perf_counter()
        decode_many([dst], [42])
        if i >= 2:
            out["decode"].append(time.perf_counter() - t)
        dst.truncate(n)
    rss = psutil.Process().memory_info().rss
    return {key: statistics.median(x) * 1e3 for key, x in out.items()} | {"mib": src.nbytes / 2**20,
                                                                         "rss_mib": rss / 2**20}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=7500)
    ap.add_argument("--dtype", default="auto", help="compute dtype (auto: bf16 where the CPU has it, else f32)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--huge", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a)))
        return 0
    runs = {"0": [], "1": []}
    for _ in range(a.rounds):
        for thp in ("0", "1"):
            p = subprocess.run([sys.executable, __file__, "--child", "--model", a.model, "--tokens", str(a.tokens),
                                "--reps", str(a.reps), "--dtype", a.dtype, "--huge", thp],
                               capture_output=True, text=True, check=True)
            runs[thp].append(json.loads(p.stdout.strip().splitlines()[-1]))
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        mode = f.read().strip()
    print(f"CPU: {cpu_name()}; THP: {mode}; dtype {a.dtype}; model {a.model}, {a.tokens} tokens of K/V "
          f"({runs['0'][0]['mib']:.0f} MiB a session); medians of {a.reps}, {a.rounds} rounds\n")
    print("| ms | 4 KB pages | huge pages | 4 KB / huge |\n|---|---|---|---|")
    for key in ("fork", "restore", "decode"):
        small = statistics.median(r[key] for r in runs["0"])
        huge = statistics.median(r[key] for r in runs["1"])
        print(f"| {key} | {small:.1f} | {huge:.1f} | {small / huge:.2f}x |")
    small, huge = (statistics.median(r["rss_mib"] for r in runs[x]) for x in ("0", "1"))
    print(f"\nthe child's RSS at its end (the model, one session of {a.tokens} tokens, the exported rows): "
          f"{small:.0f} MiB with 4 KB pages, {huge:.0f} MiB with huge pages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
