"""Model throughput benchmark: load time, prefill and decode tokens/s, peak RSS, and the
machine's own bf16 matmul throughput measured in the same run (prefill as a fraction of it),
side by side with llama.cpp measured in the same run on the same GGUF and threads (through
llama-cpp-python when it is installed: `pip install llama-cpp-python` builds it for this CPU;
without it the llama.cpp column stays empty, never filled from elsewhere).

    .venv/bin/python bench/bench_model.py [--model gemma3-270m] [--dtype auto] [--chunk-size 512] [--repeats 3] [--quick] [--json]

All figures are medians (the target machine is shared and noisy). With --json the table goes
to stderr and a JSON object to stdout. --chunk-sweep 256 512 1024 adds prefill at those chunk
sizes, interleaved round-robin.

Noise handling, for a 2-core machine that other processes share: before each timed sample the
bench waits (at most --wait-quiet s) for the CPUs to be mostly idle; every sample records its
run-queue wait (time our threads were runnable but not running / wall x threads, from
/proc/self/task/*/schedstat), shown as a column. A prefill sample above --max-wait is retaken
(--retries); decode steps above it are left out of the median when at least half are quiet.
Peak RSS is ru_maxrss of the whole run (model builds included).
"""
from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from common.config import Settings  # noqa: E402
from procs.inference import native  # noqa: E402
from procs.inference.model import Llama  # noqa: E402
from procs.inference.kvsession import KVSession  # noqa: E402
from procs.inference.runtime import build  # noqa: E402
from common.models import resolve  # noqa: E402
from bench.llamacpp import TOKEN_HI, TOKEN_LO, measure_llama_cpp, peak_rss_children, rand_ids  # noqa: E402
from bench.machine import QUIET, Timer, cpu_name, rss_mb, run_delay_s, wait_quiet  # noqa: E402
from bench.report import emit, log  # noqa: E402

PREFILL_TARGET = 2.0   # >= 2x llama.cpp
DECODE_TARGET = 1.0    # >= llama.cpp


def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype, repeats: int,
                  min_s: float = 0.1) -> tuple[float, float]:
    """(median GFLOP/s, median run-queue wait) of torch.mm [m,k]x[k,n]; samples run >= min_s."""
    a = (0.5 * torch.randn(m, k)).to(dtype)
    b = (0.05 * torch.randn(k, n)).to(dtype)
    for _ in range(3):
        torch.mm(a, b)
    t0, it = time.perf_counter(), 0
    while time.perf_counter() - t0 < min_s:
        torch.mm(a, b)
        it += 1
    iters = max(1, it)
    flop = 2.0 * m * k * n * iters
    samples, waits = [], []
    for _ in range(repeats):
        with Timer() as t:
            for _ in range(iters):
                torch.mm(a, b)
        samples.append(flop / t.s / 1e9)
        waits.append(t.wait)
    return statistics.median(samples), statistics.median(waits)


# --- model FLOPs ------------------------------------------------------------------------

def _numel(lin) -> int:
    if lin.mat is not None:       # a native pack: its shape, without dequantizing it
        m = lin.mat.mat()
        return m.n * m.k
    return lin.w.numel()


def linear_params(model: Llama) -> tuple[int, int]:
    """(params a token multiplies in the per-layer linear layers: the chosen experts' only,
    params in lm_head)."""
    per = 0
    for ly in model.layers:
        per += sum(_numel(lin) for lin in (ly.wqkv, ly.wo, ly.wgu, ly.wd) if lin is not None)
        if ly.moe is not None:
            gu, down = ly.moe.gate_up, ly.moe.down
            each = _numel(gu[0]) + _numel(down[0]) if ly.moe.packed else gu[0].numel() + down[0].numel()
            per += ly.moe.k * each
    return per, model.cfg.vocab_size * model.cfg.dim


def prefill_flops(model: Llama, n: int, start: int = 0) -> float:
    """Useful FLOPs to prefill tokens start..start+n-1 (causal attention; lm_head once)."""
    c = model.cfg
    lin, head = linear_params(model)
    # attention: q.k and p.v are 2*H*D*S each per layer for a token that sees S keys
    keys = sum(range(start + 1, start + n + 1))
    return 2.0 * lin * n + 2.0 * head + 4.0 * c.n_layers * c.n_heads * c.head_dim * keys


# --- benchmarks -------------------------------------------------------------------------

def bench_load(s: Settings, n: int) -> tuple[Llama, int, list[float]]:
    times, model, ctx = [], None, 0
    for i in range(n):
        model = None
        gc.collect()
        with Timer() as t:
            model, ctx, secs = build(s)
        times.append(secs)
        log(f"  load {i + 1}/{n}: {secs:.3f} s (run-queue wait {100 * t.wait:.0f}%)")
    return model, ctx, times


def warmup(model: Llama, chunk: int, rng: random.Random) -> None:
    sess = KVSession(model, 2 * chunk + 16, chunk)
    sess.prefill(rand_ids(rng, chunk + chunk // 2))     # a full chunk and a partial one
    for _ in range(8):
        sess.decode(rng.randrange(TOKEN_LO, TOKEN_HI))


def bench_decode(sess: KVSession, rng: random.Random, steps: int) -> tuple[list[float], list[float]]:
    """(per-token decode seconds, per-token run-queue wait) for `steps` tokens appended to sess.
    Feeds back the argmax (a real decode loop), or a random id when that is a special token."""
    out, waits = [], []
    tok = rng.randrange(TOKEN_LO, TOKEN_HI)
    nt = torch.get_num_threads()
    wait_quiet()
    for _ in range(steps):
        d0 = run_delay_s()            # read outside the timed span
        t0 = time.perf_counter()
        logits = sess.decode(tok)
        dt = time.perf_counter() - t0
        out.append(dt)
        waits.append((run_delay_s() - d0) / (dt * nt))
        tok = int(logits.argmax())
        if not TOKEN_LO <= tok < TOKEN_HI:
            tok = rng.randrange(TOKEN_LO, TOKEN_HI)
    return out, waits


def chunk_sweep(model: Llama, args, rng: random.Random) -> dict:
    """Prefill tok/s per chunk size, interleaved round-robin so that the machine's noise falls
    on all chunk sizes alike; median over rounds, busy samples retaken like the main prefill."""
    out = {}
    for n in args.chunk_sweep_sizes:
        samples = {c: [] for c in args.chunk_sweep}
        busy = {c: [] for c in args.chunk_sweep}
        warmup_done = set()
        for r in range(args.repeats):
            for c in args.chunk_sweep:
                if c not in warmup_done:                 # first use of new chunk shapes
                    KVSession(model, 2 * c, c).prefill(rand_ids(rng, 2 * c))
                    warmup_done.add(c)
                for attempt in range(1 + args.retries):
                    sess = KVSession(model, n, c)
                    ids = rand_ids(rng, n)
                    with Timer() as t:
                        sess.prefill(ids)
                    sess = None
                    if t.wait <= args.max_wait:
                        break
                (samples if t.wait <= args.max_wait else busy)[c].append(n / t.s)
                log(f"  chunk {c} prefill {n}: {n / t.s:.1f} tok/s (run-queue wait {100 * t.wait:.0f}%)")
        # median over the quiet samples; over all of them only where none was quiet
        out[n] = {c: {"tok_s": statistics.median(samples[c] or busy[c]), "quiet": len(samples[c]),
                      "samples": samples[c], "busy_samples": busy[c]} for c in args.chunk_sweep}
    return out


def measure_matmul(dtype: torch.dtype, reps: int) -> dict:
    mm = {}
    for name, (m, k, n) in (("2048x576x1536", (2048, 576, 1536)), ("2048x2048x2048", (2048, 2048, 2048))):
        g, w = matmul_gflops(m, k, n, dtype, reps)
        mm[name] = {"gflops": g, "wait": w}
        log(f"  {name}: {g:.1f} GFLOP/s (run-queue wait {100 * w:.0f}%)")
    return mm


def weight_kind(lin) -> str:
    """What decode reads for one model.Linear: the native copy's kind, or torch's packed one."""
    if lin.mat is not None:
        return native.KIND_NAMES[lin.mat.kind]
    return lin.kind or "dense"


def run(args) -> dict:
    s = Settings(model=args.model, dtype=args.dtype, chunk_size=args.chunk_size, threads=args.threads,
                 prefill_attention=args.prefill_attention, prefill_math=args.prefill_math)
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    res: dict = {
        "settings": {"dtype": args.dtype, "chunk_size": args.chunk_size, "repeats": args.repeats,
                     "quick": args.quick},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "cpu": cpu_name(),
                    "torch": torch.__version__, "loadavg_start": os.getloadavg()[0]},
    }
    wall0 = time.perf_counter()

    loads = 0 if args.no_load else (1 if args.quick else args.loads)
    log(f"model load x{max(loads, 1)}")
    model, ctx, load_times = bench_load(s, max(loads, 1))
    lin, head = linear_params(model)
    res["settings"]["threads"] = torch.get_num_threads()
    res["settings"]["compute_dtype"] = str(model.dtype).replace("torch.", "")
    res["settings"]["prefill_math"] = str(model.mm_dtype).replace("torch.", "")
    res["model"] = {"file": os.path.basename(resolve(s.model, s.models_path())), "arch": model.cfg.arch, "n_layers": model.cfg.n_layers, "dim": model.cfg.dim, "ctx": ctx,
                    "linear_params": lin, "lm_head_params": head,
                    "decode_path": "native" if model.decoder is not None else "torch",
                    "prefill_attention": "native" if model.prefill_attend is not None else "sdpa",
                    "decode_weights": sorted({weight_kind(x) for ly in model.layers
                                              for x in (ly.wqkv, ly.wo, ly.wgu, ly.wd,
                                                        *(ly.moe.gate_up + ly.moe.down if ly.moe and ly.moe.packed else ()))
                                              if x is not None})}
    if loads:
        res["load_s"] = statistics.median(load_times)
        res["load_samples_s"] = load_times

    # the machine's matmul throughput in the dtype prefill multiplies in, at the start and the
    # end; in bf16 on the CPU the other dtype too, once (what --prefill-math auto chose between)
    mm_reps = 3 if args.quick else 7
    if not args.no_matmul:
        log(f"matmul throughput ({res['settings']['prefill_math']}, start)")
        res["matmul_start"] = measure_matmul(model.mm_dtype, mm_reps)
        if model.dtype == torch.bfloat16 and model.device.type == "cpu":
            other = torch.float32 if model.mm_dtype == torch.bfloat16 else torch.bfloat16
            log(f"matmul throughput ({str(other).replace('torch.', '')}, for comparison)")
            res["matmul_other"] = {"dtype": str(other).replace("torch.", ""),
                                   **measure_matmul(other, mm_reps)}

    log("warmup")
    warmup(model, args.chunk_size, rng)

    sizes = args.prefill_sizes if args.prefill_sizes is not None else \
        ([512, 2048] if args.quick else [512, 2048, 8000])
    dctx = set(args.decode_contexts if args.decode_contexts is not None
               else ([512, 2048] if args.quick else [512, 2048, 8000]))
    steps = args.decode_steps or (16 if args.quick else 48)
    res["settings"]["decode_steps"] = steps
    res["prefill"], res["decode"] = {}, {}
    for n in sorted(set(sizes) | dctx):
        do_prefill = n in sizes
        reps = 1 if args.quick or not do_prefill else \
            (args.repeats if n < 4096 else min(args.repeats, args.long_repeats))
        need = n + (steps + 1 if n in dctx else 0)
        if need > ctx:
            log(f"  skip {n}: {need} tokens exceed the context of {ctx}")
            continue
        times, waits, sess = [], [], None
        for _ in range(reps):
            for attempt in range(1 + args.retries):   # retake a sample the machine stole
                sess = None
                gc.collect()
                sess = KVSession(model, need, args.chunk_size)
                ids = rand_ids(rng, n)
                with Timer() as t:
                    sess.prefill(ids)
                busy = t.wait > args.max_wait
                log(f"  prefill {n}: {n / t.s:.1f} tok/s ({t.s:.2f} s, run-queue wait {100 * t.wait:.0f}%)"
                    f"{'' if do_prefill else ' [decode setup]'}"
                    f"{' [busy, retaken]' if busy and do_prefill and attempt < args.retries else ''}")
                if not busy or not do_prefill:
                    break
            times.append(t.s)
            waits.append(t.wait)
        if do_prefill:
            med = statistics.median(times)
            flops = prefill_flops(model, n)
            p = {"tokens": n, "seconds": med, "tok_s": n / med, "samples_s": times,
                 "wait": statistics.median(waits),
                 "gflop_per_token": flops / n / 1e9, "gflops": flops / med / 1e9}
            res["prefill"][n] = p
        if n in dctx:
            per, pw = bench_decode(sess, rng, steps)
            # steps the machine stole (run-queue wait > --max-wait) are left out when at least
            # half the steps are quiet; otherwise all steps count
            quiet = [t for t, w in zip(per, pw) if w <= args.max_wait]
            use = quiet if len(quiet) * 2 >= len(per) else per
            med, srt = statistics.median(use), sorted(use)
            wait = statistics.mean(pw)
            d = {"context": n, "steps": steps, "steps_used": len(use), "ms_per_token": med * 1e3,
                 "tok_s": 1.0 / med, "ms_per_token_all_steps": statistics.median(per) * 1e3,
                 "p10_ms": srt[len(srt) // 10] * 1e3, "p90_ms": srt[(9 * len(srt)) // 10] * 1e3,
                 "wait": wait, "gflops": prefill_flops(model, 1, n + steps // 2) / med / 1e9}
            res["decode"][n] = d
            log(f"  decode @{n}: {d['tok_s']:.1f} tok/s ({d['ms_per_token']:.2f} ms/token over {len(use)}/{steps} "
                f"steps; all steps {d['ms_per_token_all_steps']:.2f} ms; run-queue wait {100 * wait:.0f}%)")
        sess = None

    if not args.no_llama_cpp:
        log("llama.cpp, same GGUF and threads")
        lc = measure_llama_cpp(resolve(s.model, s.models_path()), res["prefill"], res["decode"], steps,
                               torch.get_num_threads(), 1 if args.quick else args.repeats, rng)
        if lc:
            res["llama_cpp"] = lc
            for kind, target in (("prefill", PREFILL_TARGET), ("decode", DECODE_TARGET)):
                for n, x in res[kind].items():
                    ref = lc[kind].get(n)
                    if ref:
                        x.update(llama_cpp_tok_s=ref, ratio=x["tok_s"] / ref, target_met=x["tok_s"] / ref >= target)

    if args.chunk_sweep:
        res["chunk_sweep"] = chunk_sweep(model, args, rng)

    if not args.no_matmul:
        log("matmul throughput (end)")
        res["matmul_end"] = measure_matmul(model.mm_dtype, mm_reps)
        # roofline: the better of the two medians (both are under the same shared-machine noise)
        res["roofline_gflops"] = max(res["matmul_start"]["2048x576x1536"]["gflops"],
                                     res["matmul_end"]["2048x576x1536"]["gflops"])
        for p in res["prefill"].values():
            p["roofline_frac"] = p["gflops"] / res["roofline_gflops"]
    if args.rss_context:
        log("peak RSS in fresh processes")
        res["rss_children"] = peak_rss_children(resolve(s.model, s.models_path()), args.rss_context,
                                                args.rss_prompt, torch.get_num_threads(), args.dtype,
                                                not args.no_llama_cpp and "llama_cpp" in res,
                                                not (res.get("llama_cpp") or {}).get("extra_bufts", True))
    cur, peak = rss_mb()
    res["rss_mb"], res["peak_rss_mb"] = cur, peak
    res["machine"]["loadavg_end"] = os.getloadavg()[0]
    res["wall_s"] = time.perf_counter() - wall0
    res["waited_for_quiet_s"] = QUIET["waited_s"]
    return res


# --- output -----------------------------------------------------------------------------

def _grid(rows) -> list[str]:
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    line = lambda r: "| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(r)) + " |"  # noqa: E731
    return [line(rows[0]), "|" + "|".join("-" * (x + 2) for x in w) + "|"] + [line(r) for r in rows[1:]]


def table(res: dict) -> str:
    rows = [("metric", "ricordo", "llama.cpp (same run)", "ratio", "target", "met", "run-queue wait")]

    def add(name, ours, ref=None, fmt="{:.1f}", target=None, met=None, ratio=None, wait=None):
        rows.append((name, fmt.format(ours), "" if ref is None else fmt.format(ref),
                     "" if ratio is None else f"{ratio:.2f}x", target or "",
                     "" if met is None else ("yes" if met else "NO"),
                     "" if wait is None else f"{100 * wait:.0f}%"))

    if "load_s" in res:
        ref = res.get("llama_cpp", {}).get("load_s")
        add("load (s, lower is better)", res["load_s"], ref, "{:.2f}", ratio=res["load_s"] / ref if ref else None)
    for n, p in sorted(res["prefill"].items()):
        add(f"prefill {n} (tok/s)", p["tok_s"], p.get("llama_cpp_tok_s"),
            target=f">= {PREFILL_TARGET:.2f}x" if "ratio" in p else None,
            met=p.get("target_met"), ratio=p.get("ratio"), wait=p["wait"])
    for n, d in sorted(res["decode"].items()):
        add(f"decode @{n} (tok/s)", d["tok_s"], d.get("llama_cpp_tok_s"),
            target=f">= {DECODE_TARGET:.2f}x" if "ratio" in d else None,
            met=d.get("target_met"), ratio=d.get("ratio"), wait=d["wait"])
    rc = res.get("rss_children")
    if rc and "ricordo" in rc:
        ref = rc.get("llama.cpp")
        add(f"peak RSS, own process, context {rc['context']} (MiB, lower is better)", rc["ricordo"], ref,
            fmt="{:.0f}", target="<= 1.50x" if ref else None, met=rc["ricordo"] / ref <= 1.5 if ref else None,
            ratio=rc["ricordo"] / ref if ref else None)
    add("peak RSS of this bench (MiB)", res["peak_rss_mb"], fmt="{:.0f}")
    out = _grid(rows)

    if "roofline_gflops" in res:
        out.append("")
        out.append(f"machine matmul ({res['settings']['prefill_math']}, median GFLOP/s, start / end of run): "
                   + ", ".join(f"{k} {res['matmul_start'][k]['gflops']:.0f} / {res['matmul_end'][k]['gflops']:.0f}"
                               for k in res["matmul_start"]))
        if "matmul_other" in res:
            o = res["matmul_other"]
            out.append(f"machine matmul ({o['dtype']}, not what prefill multiplies in here): "
                       + ", ".join(f"{k} {o[k]['gflops']:.0f}" for k in res["matmul_start"]))
        out.append("")
        rr = [("prefill", "GFLOP/token", "achieved GFLOP/s",
               f"of matmul 2048x576x1536 ({res['roofline_gflops']:.0f} GFLOP/s)")]
        rr += [(str(n), f"{p['gflop_per_token']:.3f}", f"{p['gflops']:.1f}", f"{100 * p['roofline_frac']:.0f}%")
               for n, p in sorted(res["prefill"].items())]
        out += _grid(rr)
    for n, per in sorted(res.get("chunk_sweep", {}).items()):
        best = max(per, key=lambda c: per[c]["tok_s"])
        out.append("")
        out.append(f"chunk sweep, prefill {n} (median tok/s, interleaved): " + ", ".join(
            f"{c}: {v['tok_s']:.0f} [{v['quiet']} quiet]" for c, v in per.items()) + f" -> fastest {best}")
    if res["decode"]:
        out.append("")
        out.append("decode ms/token, median (p10-p90) [quiet steps used]: " + ", ".join(
            f"@{n} {d['ms_per_token']:.2f} ({d['p10_ms']:.2f}-{d['p90_ms']:.2f}) [{d['steps_used']}/{d['steps']}]"
            for n, d in sorted(res["decode"].items())))
    st = res["settings"]
    out.append("")
    out.append(f"CPU: {res['machine']['cpu']}, {res['machine']['cpus']} cores")
    out.append(f"dtype {st['dtype']} -> {st['compute_dtype']} (prefill multiplies in {st['prefill_math']}), chunk {st['chunk_size']}, threads {st['threads']}, "
               f"repeats {st['repeats']}, decode steps {st['decode_steps']}, decode {res['model']['decode_path']} on "
               f"{'+'.join(res['model']['decode_weights'])}, prefill attention {res['model']['prefill_attention']}, RSS at end {res['rss_mb']:.0f} MiB, "
               f"loadavg {res['machine']['loadavg_start']:.2f} -> {res['machine']['loadavg_end']:.2f}, "
               f"wall {res['wall_s']:.0f} s (of which {res['waited_for_quiet_s']:.0f} s waiting for a quiet machine)")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="", help="GGUF path or catalogue name (ricordo fetch-model --list); "
                    "empty = the default model")
    ap.add_argument("--dtype", default="auto", choices=("auto", "bf16", "f32", "f16"))
    ap.add_argument("--chunk-size", type=int, default=512)
    ap.add_argument("--prefill-math", default="auto", choices=("auto", "bf16", "f32"),
                    help="in bf16 on the CPU, what prefill multiplies in (the server's --prefill-math)")
    ap.add_argument("--prefill-attention", default="auto", choices=("auto", "native", "sdpa"),
                    help="prefill's attention on the CPU (the server's --prefill-attention)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--repeats", type=int, default=3, help="prefill repeats (median)")
    ap.add_argument("--long-repeats", type=int, default=2, help="at most this many repeats for >= 4096 tokens")
    ap.add_argument("--loads", type=int, default=3, help="fresh model builds timed (median)")
    ap.add_argument("--decode-steps", type=int, default=0, help="decode steps timed (0 = 48, 16 with --quick)")
    ap.add_argument("--prefill-sizes", type=int, nargs="*", default=None,
                    help="prompt lengths (default 512 2048 8000; 512 2048 with --quick; none: empty)")
    ap.add_argument("--decode-contexts", type=int, nargs="*", default=None,
                    help="contexts for decode (same defaults as --prefill-sizes)")
    ap.add_argument("--no-load", action="store_true", help="build once, do not report load time")
    ap.add_argument("--no-matmul", action="store_true")
    ap.add_argument("--no-llama-cpp", action="store_true", help="do not measure llama.cpp alongside")
    ap.add_argument("--max-wait", type=float, default=0.2,
                    help="a sample whose run-queue wait (time runnable but not running / wall x threads) "
                         "exceeds this counts as stolen by other processes: prefill retakes it, decode drops it")
    ap.add_argument("--wait-quiet", type=float, default=20.0,
                    help="before each timed sample wait up to this many seconds for the machine to be "
                         "--quiet-idle idle (0 = never wait)")
    ap.add_argument("--quiet-idle", type=float, default=0.7, help="idle fraction that counts as quiet")
    ap.add_argument("--retries", type=int, default=2, help="retakes of a stolen prefill sample")
    ap.add_argument("--chunk-sweep", type=int, nargs="*", default=[],
                    help="also time prefill at these chunk sizes, interleaved (e.g. 256 512 1024)")
    ap.add_argument("--chunk-sweep-sizes", type=int, nargs="*", default=[2048],
                    help="prompt lengths for --chunk-sweep")
    ap.add_argument("--rss-context", type=int, default=8192,
                    help="peak RSS of each server alone at this context, in fresh processes (0: skip)")
    ap.add_argument("--rss-prompt", type=int, default=2048, help="prompt prefilled in the peak RSS runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="1 load, 1 repeat, 512/2048 only, 16 decode steps")
    ap.add_argument("--json", action="store_true", help="JSON to stdout, table to stderr")
    args = ap.parse_args(argv)
    QUIET["max_s"], QUIET["idle"] = args.wait_quiet, args.quiet_idle
    res = run(args)
    return emit(table(res), res, args.json)


if __name__ == "__main__":
    sys.exit(main())
