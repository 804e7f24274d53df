"""Decode beside other processes: the configured thread count held fixed against
--adapt-threads (procs/inference/threads.py), in the same run on the same machine.

Each sample is a fresh process that loads the model, prefills a --context-token prompt and
decodes for --seconds; it reports tokens/s over the whole window (mean, so the steps a
descheduled thread held up count). Scenarios, each with decode fixed at --threads and adaptive:
  alone           nothing else running
  busy x K        K processes spinning on the CPU beside it (a build, a test run)
  two servers     two decoders at once (the figure: their tokens/s summed)
  freed           busy x K for the first half of the window, then nothing: tokens/s over
                  the last third (how soon decode takes the freed cores back)
Rounds interleave the scenarios; medians of --rounds are printed, with adaptive / fixed.

    .venv/bin/python bench/bench_threads.py [--model smollm2-135m] [--threads 2] [--busy 1] [--rounds 3]
        [--seconds 6] [--only alone busy two freed] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.machine import cpu_name  # noqa: E402
from bench.report import emit, log  # noqa: E402


KEYS = ("alone", "busy", "two", "freed")


def worker(args) -> None:
    """One decoder: prints {"tok_s": ..., "threads": [the counts its steps used]}."""
    import random

    import torch

    from common.config import Settings
    from procs.inference.kvsession import KVSession
    from procs.inference.steps import decode_many
    from procs.inference.runtime import build
    from procs.inference.threads import DecodeThreads
    s = Settings.load("inference", ["--model", args.model, "--threads", str(args.threads), "--dtype", args.dtype])
    model, n_ctx, _ = build(s)
    rng = random.Random(0)
    sess = KVSession(model, min(n_ctx, args.context + int(1000 * args.seconds)), 512)
    sess.prefill([rng.randrange(100, 40000) for _ in range(args.context)])
    if args.mode == "waiting":       # adaptive as before freed cores brought a probe forward
        import procs.inference.threads as th
        th.FREE_WINDOWS = 10**9
    ctl = DecodeThreads(torch.get_num_threads(), args.mode != "fixed")
    for _ in range(8):
        sess.decode(rng.randrange(100, 40000))
    print("start", flush=True)
    used, n, late, t0 = {}, 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < args.seconds and len(sess) < sess.n_ctx - 1:
        ctl.step(lambda: decode_many([sess], [rng.randrange(100, 40000)]))
        used[ctl.current] = used.get(ctl.current, 0) + 1
        n += 1
        late += time.perf_counter() - t0 >= args.seconds * 2 / 3
    dt = time.perf_counter() - t0
    print(json.dumps({"tok_s": n / dt, "late_tok_s": late / (dt - args.seconds * 2 / 3), "threads": used}))


def decoders(args, mode: str, count: int, busy: int, freed: bool = False) -> list[dict]:
    """count decoders at once in `mode`, beside `busy` spinning processes (`freed`: they end
    half way through the decoders' window)."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--mode", mode, "--model", args.model,
               "--threads", str(args.threads), "--dtype", args.dtype, "--seconds", str(args.seconds),
               "--context", str(args.context)]
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(count)]
        for p in procs:
            assert p.stdout.readline().strip() == "start"
        if freed:
            time.sleep(args.seconds / 2)
            for h in hogs:
                h.kill()
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--busy", type=int, default=1, help="spinning processes beside the decoder")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", nargs="*", choices=KEYS, help="run only these scenarios")
    ap.add_argument("--waiting", action="store_true",
                    help="also adaptive without the probe freed cores bring forward (the earlier behaviour)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="fixed", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    scenarios = [("alone", 1, 0), (f"busy x {args.busy}", 1, args.busy), ("two servers (sum)", 2, 0),
                 (f"busy x {args.busy}, freed half way (last third)", 1, args.busy)]
    if args.only:
        scenarios = [sc for sc, key in zip(scenarios, KEYS) if key in args.only]
    modes = ("fixed", "adaptive") + (("waiting",) if args.waiting else ())
    got: dict = {(name, mode): [] for name, _, _ in scenarios for mode in modes}
    seen: dict = {}
    for r in range(args.rounds):
        for name, count, busy in scenarios:
            for mode in modes:
                freed = name.startswith(f"busy x {args.busy}, freed")
                outs = decoders(args, mode, count, busy, freed)
                tok_s = sum(o["late_tok_s" if freed else "tok_s"] for o in outs)
                got[name, mode].append(tok_s)
                seen[name, mode] = outs[0]["threads"]
                log(f"round {r + 1}: {name}, {mode}: {tok_s:.1f} tok/s (steps by thread count: {outs[0]['threads']})")
    res = {"cpu": cpu_name(), "cores": os.cpu_count(), "args": vars(args), "rows": []}
    lines = [f"Decode tok/s, {args.model}, --threads {args.threads}, context {args.context}, "
             f"{args.seconds:.0f} s windows, medians of {args.rounds} rounds; CPU: {res['cpu']}, {os.cpu_count()} cores",
             "", "| scenario | fixed at --threads | adaptive | adaptive / fixed | adaptive's steps by its current count (last round) |"
             + (" waiting for the scheduled probe | adaptive / waiting |" if args.waiting else ""),
             "|---|---|---|---|---|" + ("---|---|" if args.waiting else "")]
    for name, _, _ in scenarios:
        f, a = statistics.median(got[name, "fixed"]), statistics.median(got[name, "adaptive"])
        row = {"scenario": name, "fixed": f, "adaptive": a, "ratio": a / f,
               "samples": {mode: got[name, mode] for mode in modes}}
        line = f"| {name} | {f:.1f} | {a:.1f} | {a / f:.2f}x | {seen[name, 'adaptive']} |"
        if args.waiting:
            w = row["waiting"] = statistics.median(got[name, "waiting"])
            line += f" {w:.1f} | {a / w:.2f}x |"
        res["rows"].append(row)
        lines.append(line)
    return emit("\n".join(lines), res, args.json)


if __name__ == "__main__":
    sys.exit(main())
