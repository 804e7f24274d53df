"""What constrained decoding costs ricordo, measured in one run on this machine.

    .venv/bin/python bench/bench_grammar.py [--repeats 5] [--tokens 48]

1. Decode tokens/s on the same prompt (a forced call of a Claude-Code-sized tool list: 24
   tools, ~64 KB of schemas, made by bench_grammar_libs.gen_tools; the prompt lists 4 of them),
   free and constrained,
   alternating free/constrained runs so the machine's noise hits both alike. Both decode
   the same number of tokens: the constrained run's tokens are replayed in the free one,
   so only the mask (compute, apply, advance) differs.
2. The time the grammar adds to a turn: the renderer's validation and inference's compile
   of that tool list, first time (cold) and again (cached by the grammar's hash).
Figures are medians; the CPU model and flags are printed with them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from bench.machine import cpu_name  # noqa: E402
from bench_grammar_libs import gen_tools  # noqa: E402
from common.config import Settings  # noqa: E402
from common.models import load_text, resolve  # noqa: E402
from common import messages as m  # noqa: E402
from procs.inference.guide import Guides  # noqa: E402
from procs.inference.kvsession import KVSession  # noqa: E402
from procs.inference.runtime import build, describe  # noqa: E402
from procs.inference.sampling import Sampler  # noqa: E402
from procs.renderer import grammar  # noqa: E402
from procs.renderer.tools import opener, tools_text  # noqa: E402


def ms(xs) -> str:
    return f"{statistics.median(xs) * 1000:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48)
    a = ap.parse_args()
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores")
    print(describe())
    s = Settings.load("inference", [])
    model, n_ctx, _ = build(s)
    text = load_text(resolve(s.model, s.models_path()))
    tools = [{"type": "function", "function": {"name": n, "description": "", "parameters": p}}
             for n, p in gen_tools()]
    size = sum(len(json.dumps(t["function"]["parameters"])) for t in tools)
    print(f"model {os.path.basename(resolve(s.model, s.models_path()))}, {len(tools)} tools, {size} bytes of schemas")

    # 2. compile and validate, cold and cached
    cold_check, cold_compile, warm_check, warm_compile = [], [], [], []
    for _ in range(a.repeats):
        guides = Guides(text)
        checker = grammar.Checker(guides.tok)
        t0 = time.perf_counter()
        c = checker.make(tools, "required", None)
        t1 = time.perf_counter()
        guides.matcher(c.grammar)
        t2 = time.perf_counter()
        checker.make(tools, "required", None)
        t3 = time.perf_counter()
        guides.matcher(c.grammar)
        t4 = time.perf_counter()
        cold_check.append(t1 - t0), cold_compile.append(t2 - t1)
        warm_check.append(t3 - t2), warm_compile.append(t4 - t3)
    print(f"grammar, first turn: validate {ms(cold_check)} ms (renderer) + compile {ms(cold_compile)} ms (inference); "
          f"later turns: {ms(warm_check)} + {ms(warm_compile)} ms")

    # 1. decode with and without the mask, same prompt, same tokens
    # the prompt lists 4 of the tools (all 24 render to ~17k tokens, past the default context);
    # the grammar holds all 24, which is what the mask's cost depends on
    messages = [{"role": "system", "content": tools_text(tools[:4])},
                {"role": "user", "content": "Read the file /etc/hosts."}]
    prompt = text.render_chat(messages, add_generation_prompt=True) + opener("required")
    ids = text.encode(prompt)
    session = KVSession(model, n_ctx, s.chunk_size)
    session.prefill(ids)
    base = session.logits
    params = m.SamplingParams(max_tokens=a.tokens)
    free_rates, guided_rates, n_tokens = [], [], []
    for _ in range(a.repeats):
        session.truncate(len(ids))
        session.logits = base
        guide = guides.start(c)
        out, logits = [], base
        t0 = time.perf_counter()
        for _ in range(a.tokens):
            tok, _, _ = Sampler(params)(logits, guide.mask(logits))
            guide.advance(tok)
            out.append(tok)
            if tok in text.stop_ids:
                break
            logits = session.decode(tok)
        guided_rates.append(len(out) / (time.perf_counter() - t0))
        n_tokens.append(len(out))
        session.truncate(len(ids))
        session.logits = base
        logits = base
        t0 = time.perf_counter()
        for tok in out:                           # the same tokens, unmasked sampling
            Sampler(params)(logits)
            if tok in text.stop_ids:
                break
            logits = session.decode(tok)
        free_rates.append(len(out) / (time.perf_counter() - t0))
    fr, gr = statistics.median(free_rates), statistics.median(guided_rates)
    print(f"decode after a {len(ids)}-token prompt, {statistics.median(n_tokens):.0f} tokens: "
          f"free {fr:.1f} tok/s, constrained {gr:.1f} tok/s, ratio {gr / fr:.3f} ({(1 - gr / fr) * 100:+.1f} % slower)")
    print("call:", text.piece_bytes(out).decode("utf-8", "replace")[:160])
    return 0


if __name__ == "__main__":
    sys.exit(main())
