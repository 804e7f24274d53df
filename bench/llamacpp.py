"""llama.cpp measured in the same run as ricordo (through llama-cpp-python, built by pip for
this CPU), on the same GGUF, threads and prompt lengths: prefill and decode speed, and the peak
RSS of each server alone in a fresh process. Nothing here is ever filled from elsewhere: when
llama-cpp-python is not installed the peer's figures stay empty."""
from __future__ import annotations

import os
import random
import statistics
import sys

from bench.machine import Timer
from bench.report import log

TOKEN_LO, TOKEN_HI = 100, 49000   # the random prompts both servers get: ids every vocabulary has


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]


# --- machine roofline -------------------------------------------------------------------


def extra_bufts_work(path: str, threads: int) -> bool:
    """Whether llama.cpp with its default CPU buffer types survives a short eval of this file
    (checked in a child process: a crash there is a segfault)."""
    code = ("import sys; from llama_cpp import Llama; "
            "m = Llama(model_path=sys.argv[1], n_ctx=64, n_threads=int(sys.argv[2]), verbose=False); "
            "m.eval([1, 2, 3, 4])")
    import subprocess
    r = subprocess.run([sys.executable, "-c", code, path, str(threads or os.cpu_count())],
                       capture_output=True, timeout=300)
    return r.returncode == 0


# each prints its VmHWM (the peak of its own memory map: ru_maxrss would carry the parent's
# peak over fork and exec)
_PEAK = "print(next(int(ln.split()[1]) for ln in open('/proc/self/status') if ln.startswith('VmHWM')) / 1024)"
RSS_CHILD = {
    "ricordo": ("import sys, random; sys.path.insert(0, sys.argv[5]); "
                "from common.config import Settings; from procs.inference.runtime import build; "
                "from procs.inference.kvsession import KVSession; "
                "m, ctx, _ = build(Settings.load('inference', ['--model', sys.argv[1], '--ctx-size', sys.argv[2], "
                "'--threads', sys.argv[3], '--dtype', sys.argv[6]])); r = random.Random(0); "
                "s = KVSession(m, ctx, 512); s.prefill([r.randrange(100, 40000) for _ in range(int(sys.argv[4]))]); "
                "[s.decode(r.randrange(100, 40000)) for _ in range(16)]; " + _PEAK),
    "llama.cpp": ("import sys, random; from llama_cpp import Llama; import llama_cpp.llama_cpp as lcc; "
                  # argv[7] == 'plain': without the extra CPU buffer types (they crash on this file here)
                  "dp = lcc.llama_model_default_params; "
                  "pp = lambda: (lambda p: (setattr(p, 'use_extra_bufts', False), p)[1])(dp()); "
                  "lcc.llama_model_default_params = pp if sys.argv[7] == 'plain' else dp; "
                  "m = Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[2]), n_threads=int(sys.argv[3]), "
                  "n_batch=512, verbose=False); r = random.Random(0); "
                  "m.eval([r.randrange(100, 40000) for _ in range(int(sys.argv[4]))]); "
                  "[m.eval([r.randrange(100, 40000)]) for _ in range(16)]; " + _PEAK),
}


def peak_rss_children(path: str, ctx: int, prompt: int, threads: int, dtype: str, peer: bool,
                      plain: bool = False) -> dict:
    """Peak RSS (MiB) of a fresh process that loads the model with a context of ctx tokens,
    prefills prompt tokens and decodes 16: ricordo's inference and, when peer, llama.cpp's,
    each alone (a shared process would report the larger of the two)."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = {"context": ctx, "prompt": prompt}
    for name, code in RSS_CHILD.items():
        if name == "llama.cpp" and not peer:
            continue
        r = subprocess.run([sys.executable, "-c", code, path, str(ctx), str(threads), str(prompt), root, dtype,
                            "plain" if plain else "extra"],
                           capture_output=True, text=True, timeout=1800)
        if r.returncode == 0:
            out[name] = float(r.stdout.strip().splitlines()[-1])
            log(f"  peak RSS, {name} alone (context {ctx}, {prompt}-token prompt): {out[name]:.0f} MiB")
        else:
            log(f"  peak RSS, {name}: the child failed: {r.stderr.strip().splitlines()[-1:]}")
    return out


def measure_llama_cpp(path: str, sizes, dctx, steps: int, threads: int, reps: int, rng) -> dict | None:
    """llama.cpp on the same GGUF, same threads, same prompt lengths, in this run (through
    llama-cpp-python, built for this CPU by pip); None when it is not installed."""
    try:
        from llama_cpp import Llama as LlamaCpp
    except ImportError:
        log("llama.cpp: not measured (pip install llama-cpp-python builds it for this CPU)")
        return None
    need = max(list(sizes) + [n + steps + 1 for n in dctx] + [512])
    plain = not extra_bufts_work(path, threads)
    if plain:   # ggml's repacked CPU buffers (AMX / AVX-512 repack) crash on this file here
        log("  llama.cpp: its extra CPU buffer types (weight repacking) crash on this model and CPU; "
            "measured without them (use_extra_bufts=False)")
        import llama_cpp.llama_cpp as lcc
        default_params = lcc.llama_model_default_params

        def plain_params():
            p = default_params()
            p.use_extra_bufts = False
            return p
        lcc.llama_model_default_params = plain_params
    with Timer() as t:
        lc = LlamaCpp(model_path=path, n_ctx=need, n_threads=threads, n_threads_batch=threads,
                      n_batch=512, verbose=False)
    out = {"load_s": t.s, "prefill": {}, "decode": {}, "extra_bufts": not plain}
    for n in sorted(set(sizes) | set(dctx)):
        if n + (steps + 1 if n in dctx else 0) > need:
            continue
        times = []
        for _ in range(reps if n in sizes else 1):
            ids = rand_ids(rng, n)
            lc.reset()                    # eval drops the KV rows past n_tokens
            with Timer() as t:
                lc.eval(ids)
            times.append(t.s)
        if n in sizes:
            out["prefill"][n] = n / statistics.median(times)
            log(f"  llama.cpp prefill {n}: {out['prefill'][n]:.1f} tok/s")
        if n in dctx:
            per = []
            for tok in rand_ids(rng, steps):
                with Timer() as t:
                    lc.eval([tok])
                per.append(t.s)
            out["decode"][n] = 1.0 / statistics.median(per)
            log(f"  llama.cpp decode @{n}: {out['decode'][n]:.1f} tok/s")
    return out
