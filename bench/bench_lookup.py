"""Prompt lookup decoding (--draft-lookup) against plain decoding, in the same run on the same
machine: two servers of the real processes, one with --draft-lookup 0, asked the same
requests in turns (greedy, so both write the same answer, which is checked):

- copy: repeat a source file with one change asked for (an agent's edit of a file it read);
- free: write prose about the file (little to copy: what drafting costs when it fails).

Prints, per model and workload, the answer's decode rate (completion tokens over the time
after the first token, median of --repeats) for both servers, their ratio, and the drafts
kept of those drafted, with the CPU named.

    .venv/bin/python bench/bench_lookup.py [--models qwen2.5-coder-0.5b smollm2-135m] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import cpu_name  # noqa: E402
from bench.report import emit, log  # noqa: E402
from common.config import Settings  # noqa: E402
from tests.e2e.server import Server  # noqa: E402

SOURCE = (REPO / "procs" / "inference" / "lookup.py").read_text()
WORK = {
    "copy": "Here is a Python file. Write it out again in full, renaming the class Lookup to NgramLookup "
            "and changing nothing else:\n\n" + SOURCE,
    "free": "Here is a Python file. Without quoting it, write a short story about a programmer who "
            "wrote it:\n\n" + SOURCE,
}


def timed(srv: Server, prompt: str, max_tokens: int) -> tuple[str, float, int]:
    """(answer, decode tokens/s after the first token, completion tokens) of one streamed request."""
    c = srv.client()
    t0 = time.perf_counter()
    first, text, n = None, [], 0
    for ch in c.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}],
                                        max_tokens=max_tokens, temperature=0, stream=True,
                                        stream_options={"include_usage": True}):
        if ch.usage:
            n = ch.usage.completion_tokens
        if ch.choices and ch.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(ch.choices[0].delta.content)
    t1 = time.perf_counter()
    return "".join(text), (n - 1) / max(t1 - (first or t0), 1e-9), n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen2.5-coder-0.5b", "smollm2-135m"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--draft", type=int, default=Settings().draft_lookup)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    cpu = cpu_name()
    log(f"CPU: {cpu}")
    rows, res = [], {"cpu": cpu, "draft": a.draft, "runs": []}
    for model in a.models:
        env = {"RICORDO_MODEL": model, "RICORDO_CTX_SIZE": "4096"}
        with Server(env={**env, "RICORDO_DRAFT_LOOKUP": "0"}, name="plain") as plain, \
                Server(env={**env, "RICORDO_DRAFT_LOOKUP": str(a.draft)}, name="lookup") as look:
            for name, prompt in WORK.items():
                rate = {"plain": [], "lookup": []}
                for srv in (plain, look):       # the prompt in each server's cache first
                    timed(srv, prompt, 2)
                before = (look.metric("ricordo_draft_tokens_total"), look.metric("ricordo_draft_tokens_kept_total"))
                for _ in range(a.repeats):
                    ta, ra, na = timed(plain, prompt, a.max_tokens)
                    tb, rb, nb = timed(look, prompt, a.max_tokens)
                    if ta != tb:
                        log(f"{model} {name}: the answers differ ({na} and {nb} tokens)")
                        return 1
                    rate["plain"].append(ra)
                    rate["lookup"].append(rb)
                drafted = look.metric("ricordo_draft_tokens_total") - before[0]
                kept = look.metric("ricordo_draft_tokens_kept_total") - before[1]
                p, q = statistics.median(rate["plain"]), statistics.median(rate["lookup"])
                run = dict(model=model, work=name, tokens=na, plain=p, lookup=q, ratio=q / p,
                           drafted=drafted / a.repeats, kept=kept / a.repeats)
                res["runs"].append(run)
                log(f"{model} {name}: {na} tokens, plain {p:.1f} tok/s, lookup {q:.1f} tok/s ({q / p:.2f}x), "
                    f"{kept / a.repeats:.0f} of {drafted / a.repeats:.0f} drafted kept")
                rows.append(f"| {model} | {name} | {na} | {p:.1f} | {q:.1f} | {q / p:.2f}x | "
                            f"{kept / a.repeats:.0f} of {drafted / a.repeats:.0f} |")
    txt = "\n".join([f"prompt lookup decoding, --draft-lookup {a.draft} against 0, {cpu}, greedy, "
                     f"median of {a.repeats}", "",
                     "| model | work | answer tokens | decode tok/s, off | on | ratio | drafts kept |",
                     "|---|---|---|---|---|---|---|", *rows])
    return emit(txt, res, a.json)


if __name__ == "__main__":
    sys.exit(main())
