"""The renderer's reuse plan for an agent's request (procs/renderer/plan.py: which resident
session, which checkpoint, the save points, which sessions need an evict save), on Claude
Code's recorded requests (tests/data/agents/claude, ~22k tokens each) rendered with Gemma 3's
template, against the resident sessions a server holds after them. The plan is made on the
renderer's one thread before a job is sent, so its time is in every request's TTFT (the
`queue` stage of the first-token trace) and in that of every request queued behind it.

    .venv/bin/python bench/bench_plan.py [--sessions 4] [--repeats 30] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import cpu_name  # noqa: E402
from bench.report import emit  # noqa: E402
from common import messages as m  # noqa: E402
from common.config import Settings  # noqa: E402
from common.models import load_text, resolve  # noqa: E402
from common.trace import Trace  # noqa: E402
from procs.frontend.anthropic_request import parse  # noqa: E402
from procs.renderer.cache import DiskIndex  # noqa: E402
from procs.renderer.plan import plan_job  # noqa: E402
from procs.renderer.prompt import render  # noqa: E402

FIXTURES = REPO / "tests" / "data" / "agents" / "claude"


def request(name: str) -> m.GenerateRequest:
    body = json.loads((FIXTURES / f"{name}.json").read_text())["body"]
    return parse(body, name).req


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=4, help="resident sessions besides the request's own")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    s = Settings(model="gemma3-270m", kv_disk_dir="/nonexistent")
    text = load_text(resolve(s.model, s.models_path()))
    index = DiskIndex(s, Trace("", "renderer"))
    index.update(m.IndexSnapshot(entries=(), version=1))
    rendered = {}
    for name in ("session1_turn1", "session1_turn2", "session2_turn1", "session2_turn2"):
        req = request(name)
        prompt = render(text, req)
        rendered[name] = (req, prompt, text.encode(prompt))
    # resident: session 1 after its first turn (prompt + an answer), session 2 after its
    # first turn, and others that share the system prompt and tools (side requests)
    answer = text.encode(" I will look at the files first.")
    s1 = rendered["session1_turn1"][2] + answer
    s2 = rendered["session2_turn1"][2] + answer
    live = {1: m.LiveSession(sid=1, tokens=tuple(s1)), 2: m.LiveSession(sid=2, tokens=tuple(s2))}
    for i in range(args.sessions - 2):
        side = s1[: len(s1) // 2] + text.encode(f" side request {i}")
        live[3 + i] = m.LiveSession(sid=3 + i, tokens=tuple(side))
    rows, res = [], {"cpu": cpu_name(), "sessions": len(live), "plans": {}}
    for name in ("session1_turn2", "session2_turn2"):
        req, prompt, full = rendered[name]
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            pl = plan_job(s, text, 32768, index, live, 4, req, prompt, full)
            times.append((time.perf_counter() - t0) * 1e3)
        med = statistics.median(times)
        res["plans"][name] = {"prompt_tokens": len(full), "reuse": pl.reuse, "session": pl.session or pl.source,
                              "ms_p50": med}
        rows.append(f"| {name} | {len(full)} | {pl.reuse} (session {pl.session or pl.source}) | {med:.2f} |")
    txt = "\n".join([f"CPU: {res['cpu']}; {len(live)} resident sessions of {min(map(len, (ls.tokens for ls in live.values())))}"
                     f"-{max(map(len, (ls.tokens for ls in live.values())))} tokens; medians of {args.repeats}", "",
                     "| request | prompt tokens | reused | plan (ms) |", "|---|---|---|---|"] + rows)
    return emit(txt, res, args.json)


if __name__ == "__main__":
    sys.exit(main())
