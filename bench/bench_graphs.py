"""Decode steps and prefills on CUDA: replayed graphs (--cuda-graphs, the default) against
torch's ops launched one by one (--no-cuda-graphs), in one process and one run: decode of one
sequence and four (kvsession.decode_many) at two contexts, medians of 40 steps after two
warm-up steps; a turn's 16, 128 and 512 new tokens prefilled onto a 4,000-token session,
and four such turns' 128 tokens in one shared step (kvsession.prefill_many) against one by
one, medians of 12.

    python bench/bench_graphs.py            (a CUDA machine; the default model)

Figures and the machine they came from: bench/RESULTS-cuda.md.
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench_model import cpu_name  # noqa: E402
from common.config import Settings  # noqa: E402
from procs.inference.kvsession import KVSession, decode_many, prefill_many  # noqa: E402
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
    for ctx in (500, 4000):
        one = KVSession(model, 8192, 512); one.prefill((ids * 80)[:ctx])
        four = []
        for i in range(4):
            s = KVSession(model, 8192, 512); s.prefill([i + 7] + (ids * 80)[:ctx]); four.append(s)
        a = ms(lambda: decode_many([one], [42]))
        b = ms(lambda: decode_many(four, [42] * 4))
        print(f"graphs={graphs} ctx~{ctx}: 1 sequence {a:.2f} ms/step ({1000 / a:.0f} tok/s), "
              f"4 sequences {b:.2f} ms/step ({4000 / b:.0f} tok/s, {a * 4 / b:.2f}x)", flush=True)
    base = KVSession(model, 8192, 512); base.prefill((ids * 80)[:4000])
    for n in (16, 128, 512):                   # a turn's new tokens onto a 4,000-token session
        def turn():
            base.prefill((ids * 6)[:n]); base.logits.cpu(); base.truncate(4000)
        a = ms(turn, 12)
        print(f"graphs={graphs} prefill {n} tokens at 4000: {a:.2f} ms ({n * 1000 / a:.0f} tok/s)", flush=True)
    if graphs:                                 # four turns' 128 new tokens: one shared step, or one by one
        turns = [KVSession(model, 8192, 512) for _ in range(4)]
        for i, t in enumerate(turns):
            t.prefill([i + 7] + (ids * 80)[:4095])      # a chunk's start: 128 more stay in it

        def together():
            prefill_many(turns, [(ids * 2)[:128]] * 4, [()] * 4); turns[0].logits.cpu()
            for t in turns:
                t.truncate(4096)

        def apart():
            for t in turns:
                t.prefill((ids * 2)[:128]); t.logits.cpu(); t.truncate(4096)
        a, b = ms(together, 12), ms(apart, 12)
        print(f"4 prompts' 128 tokens at 4096: one shared step {a:.2f} ms, one by one {b:.2f} ms ({b / a:.2f}x)",
              flush=True)
        g = model.graphs
        print(f"captures {g.captures}, sessions copied into slots {g.copies}, pool {g.nbytes / 2**20:.0f} MiB"
              if g else "graphs turned off")
    del model
    torch.cuda.empty_cache()
