"""The renderer's prompt encoding per agent turn: the whole prompt (TextModel.encode) against
renderer.encoding.PromptEncoder (a recent prompt's ids reused up to a special token they share),
in one process, one run, over an agent conversation growing turn by turn to ~6,000 tokens
(bench_agent's); medians of each turn's encode, 5 repeats.

    .venv/bin/python bench/bench_encoding.py [--model smollm2-135m]
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.bench_agent import conversation  # noqa: E402
from bench.machine import cpu_name  # noqa: E402
from common.config import Settings  # noqa: E402
from common.models import load_text, resolve  # noqa: E402
from procs.renderer.encoding import PromptEncoder  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="smollm2-135m")
a = ap.parse_args()
text = load_text(resolve(a.model, Settings().models_path()), "")
system, turns = conversation(1, 3000, 150, 8)
msgs, prompts = [{"role": "system", "content": system}], []
for t in turns:
    msgs.append({"role": "user", "content": t})
    prompts.append(text.render_chat(msgs).encode())
    msgs.append({"role": "assistant", "content": "word " * 128})
whole, reuse = [], []
for _ in range(5):
    enc = PromptEncoder(text)
    for p in prompts:
        t0 = time.perf_counter(); ids = text.encode(p); whole.append(time.perf_counter() - t0)
        t0 = time.perf_counter(); got = enc.encode(p); reuse.append(time.perf_counter() - t0)
        assert got == ids
w, r = statistics.median(whole) * 1e3, statistics.median(reuse) * 1e3
print(f"CPU: {cpu_name()}; {a.model}; {len(prompts)} turns, {len(text.encode(prompts[0]))} to "
      f"{len(text.encode(prompts[-1]))} tokens")
print(f"median per turn: whole prompt {w:.2f} ms, reused start {r:.2f} ms ({w / r:.1f}x)")
