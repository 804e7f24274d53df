"""What --deterministic costs: prefill time of a new suffix after a cached prefix, default
mode against exact mode, in one process on the default model.

For each cached prefix length P (the live session or a restored checkpoint holds P tokens)
and suffix length N (the new turn), the session is reset to the same P rows (imported, not
timed) and the prefill of the N new tokens is timed; that is the server's time to first
token less the pipeline and the restore. Exact mode runs every prefill call as whole chunks
(linears padded to the chunk, attention over keys padded to a multiple of it), so a short
suffix costs a full chunk. Medians of --repeats; both modes alternate within a repeat, so
the ratio is taken under the same machine load.

    .venv/bin/python bench/bench_exact.py [--threads 1] [--repeats 5] [--json]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from common.config import Settings  # noqa: E402
from procs.inference.kvsession import KVSession  # noqa: E402
from procs.inference.runtime import build  # noqa: E402

CASES = [(0, 16), (0, 200), (0, 2048), (2048, 16), (2048, 200), (7680, 16), (7680, 200)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    s = Settings.load("inference", ["--threads", str(args.threads)])
    model, n_ctx, _ = build(s)
    rng = random.Random(0)
    ids = [rng.randrange(100, model.cfg.vocab_size) for _ in range(n_ctx)]
    sessions = {False: KVSession(model, n_ctx, s.chunk_size), True: KVSession(model, n_ctx, s.chunk_size, exact=True)}
    prefix = {}
    src = sessions[False]
    for p in sorted({p for p, _ in CASES if p}):
        src.truncate(0)
        src.prefill(ids[:p])
        prefix[p] = src.export(p)
    rows = []
    for p, n in CASES:
        times = {False: [], True: []}
        for _ in range(args.repeats):
            for exact, sess in sessions.items():
                sess.truncate(0)
                if p:
                    tokens, k, v = prefix[p]
                    sess.import_(tokens, None, k, v)
                t0 = time.perf_counter()
                sess.prefill(ids[p:p + n])
                times[exact].append(time.perf_counter() - t0)
        d, e = statistics.median(times[False]), statistics.median(times[True])
        rows.append({"cached": p, "suffix": n, "default_s": round(d, 4), "exact_s": round(e, 4),
                     "ratio": round(e / d, 2)})
        print(f"cached {p:5d} + suffix {n:5d}: default {d * 1000:8.1f} ms, exact {e * 1000:8.1f} ms, "
              f"exact/default {e / d:5.2f}", flush=True)
    if args.json:
        print(json.dumps({"threads": args.threads, "repeats": args.repeats, "dtype": str(model.dtype),
                          "torch": torch.__version__, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
