"""Decode steps and prefills on CUDA: replayed graphs (--cuda-graphs, the default) against
torch's ops launched one by one (--no-cuda-graphs), in one process and one run: decode of one
sequence and four (steps.decode_many) at two contexts, medians of 40 steps after two
warm-up steps, and a turn's 16, 128 and 512 new tokens prefilled onto a 4,000-token session
(with graphs, both ways of attention: the product and the fused kernel, as
graphs.choose_attention times them at start, which this prints first);
and four such turns' 32, 128, 256 or 512 tokens in one shared step (steps.prefill_many)
against one by one (when each prompt is in, for the median time to first token), medians
of 12.

    python bench/bench_graphs.py            (a CUDA machine; the default model)

Figures and the machine they came from: bench/RESULTS-cuda.md.
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.machine import cpu_name  # noqa: E402
from common.config import Settings  # noqa: E402
from procs.inference.kvsession import KVSession  # noqa: E402
from procs.inference.steps import decode_many, prefill_many  # noqa: E402
from procs.inference.runtime import build  # noqa: E402
from tests.conftest import default_model_path  # noqa: E402


def ms(f, n=40):
    f(); f(); torch.cuda.synchronize()
    out = []
    for _ in range(n):
        t = time.perf_counter(); f(); torch.cuda.synchronize(); out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


if not torch.cuda.is_available():
    sys.exit("no CUDA device: this bench times CUDA graphs")
print(f"CPU: {cpu_name()}; GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
ids = list(range(1000, 1100))
for graphs in (True, False):
    model, _, _ = build(Settings(model=default_model_path(), device="cuda", ctx_size=8192, cuda_graphs=graphs))
    if graphs:                                 # as the server starts (procs/inference/server.py)
        t0 = time.perf_counter()
        made = model.graphs.warm(4, 512)
        print(f"graphs captured ahead: {made} in {time.perf_counter() - t0:.1f} s, pools "
              f"{model.graphs.nbytes / 2**20:.0f} MiB", flush=True)
        for kind, (shape, product, fused) in model.graphs.attention_ms.items():
            print(f"{kind} attention at {shape} (B, T, keys): product {product:.2f} ms, fused "
                  f"{'-' if fused is None else f'{fused:.2f} ms'}: {'fused' if model.graphs.fused[kind] else 'product'}"
                  " chosen", flush=True)
        chosen = dict(model.graphs.fused)
    # with graphs, each step's attention both ways in turn (graphs.choose_attention picks one at start)
    for fused in ((False, True) if graphs else (False,)):
        label = f"graphs={graphs}" + (f" {'fused' if fused else 'product'}" if graphs else "")
        if graphs:
            model.graphs.fused = {"decode": fused, "prefill": fused}
            model.graphs._forget()             # their steps captured anew (in ms()'s warm-ups)
        for ctx in (500, 4000):
            one = KVSession(model, 8192, 512); one.prefill((ids * 80)[:ctx])
            four = []
            for i in range(4):
                s = KVSession(model, 8192, 512); s.prefill([i + 7] + (ids * 80)[:ctx]); four.append(s)
            a = ms(lambda: decode_many([one], [42]))
            b = ms(lambda: decode_many(four, [42] * 4))
            print(f"{label} ctx~{ctx}: 1 sequence {a:.2f} ms/step ({1000 / a:.0f} tok/s), "
                  f"4 sequences {b:.2f} ms/step ({4000 / b:.0f} tok/s, {a * 4 / b:.2f}x)", flush=True)
        base = KVSession(model, 8192, 512); base.prefill((ids * 80)[:4000])
        for n in (16, 128, 512):               # a turn's new tokens onto a 4,000-token session
            def turn():
                base.prefill((ids * 6)[:n]); base.logits.cpu(); base.truncate(4000)
            a = ms(turn, 12)
            print(f"{label} prefill {n} tokens at 4000: {a:.2f} ms ({n * 1000 / a:.0f} tok/s)", flush=True)
    if graphs:
        model.graphs.fused = chosen
        model.graphs._forget()
    if graphs:          # four turns' new tokens: one shared step, or one by one (runs.prefill_step's choice)
        turns = [KVSession(model, 8192, 512) for _ in range(4)]
        for i, t in enumerate(turns):
            t.prefill([i + 7] + (ids * 80)[:4095])      # a chunk's start: 512 more stay in it
        for n in (32, 128, 256, 512):
            chunks = [(ids * 3)[:n]] * 4
            for _ in range(3):         # not captured: the server's idle loop captures it (capture_wanted)
                if prefill_many(turns, chunks, [()] * 4) is not None:
                    break
                model.graphs.capture_wanted()
            else:
                print(f"4 prompts' {n} tokens: no shared step (not captured; wanted {list(model.graphs.wanted)})")
                continue
            for t in turns:
                t.truncate(4096)
            shared, apart = [], []
            for rep in range(14):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                assert prefill_many(turns, chunks, [()] * 4) is not None
                turns[0].logits.cpu()
                shared.append((time.perf_counter() - t0) * 1e3)
                for t in turns:
                    t.truncate(4096)
                t0, ins = time.perf_counter(), []
                for t in turns:
                    t.prefill((ids * 3)[:n]); t.logits.cpu(); ins.append((time.perf_counter() - t0) * 1e3)
                for t in turns:
                    t.truncate(4096)
                apart.append(ins)
            shared, apart = shared[2:], apart[2:]     # two warm-ups (captures)
            a = statistics.median(shared)
            b = [statistics.median(x[i] for x in apart) for i in range(4)]
            print(f"4 prompts' {n} tokens at 4096: one shared step {a:.2f} ms (all four in); one by one "
                  f"{b[3]:.2f} ms in all, each in at {' / '.join(f'{x:.2f}' for x in b)} ms (p50 "
                  f"{statistics.median(b):.2f}): shared/one-by-one p50 {a / statistics.median(b):.2f}", flush=True)
        g = model.graphs
        print(f"captures {g.captures}, sessions copied into slots {g.copies}, pool {g.nbytes / 2**20:.0f} MiB"
              if g else "graphs turned off")
    del model
    torch.cuda.empty_cache()
