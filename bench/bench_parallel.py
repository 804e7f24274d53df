"""Several agent conversations at once against one ricordo server, against one conversation
alone on the same server, in one run (issue 18's figures).

Each conversation is an agent's: a first prompt of about --system-words words (about 4,000
tokens with the default model), then turns of about --turn-words new words and an answer of
exactly --answer-tokens tokens (temperature 0, ignore_eos, so every run decodes the same
amount). Phase one runs one conversation alone; phase two runs --conversations others at once
(each in its own thread, turn after turn, so their turns interleave as agents' do). In each
phase the first turns (cold prompts) run first; the figures are of the later turns, whose
conversations are resident:

- aggregate answer tokens/s: every later turn's answer tokens over the phase's wall time
  (their prompts' new tokens are prefilled inside it); the ratio is phase two over phase one;
- the same tokens over the seconds the inference loop spent in decode steps in the phase
  (its `ricordo_inference_busy_seconds_total{phase="decode"}`): decode throughput alone,
  the prefills of the turns' new tokens left out;
- p50 time to first token of those turns; the ratio is phase two over phase one;
- restores from disk during those turns (the trace's hits: 0 when every conversation stays
  resident) and the tokens reported cached;
- the inference process's peak RSS, against its RSS after the first turns plus the K/V budget.

    .venv/bin/python bench/bench_parallel.py [--conversations 4] [--turns 4] [--shared-system] [--tool-ms 0] [--json]

Without --tool-ms every answer has the same length and the next turn follows at once, so
the conversations' turns arrive together, their prefills queue, and the TTFT ratio is that
of a burst. --tool-ms N puts 0.5-1.5 x N ms (seeded per conversation) before each later turn,
as an agent running a tool does, so turns arrive apart; the waits count in both phases' wall
time, which lowers the aggregate figures of one conversation more than those of several.

--shared-system gives every conversation the same system prompt, as one agent's sessions
have (their own first task and turns after it): their sessions start from copies of its rows,
and the batched decode step reads those rows once for all of them.
"""
from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_agent import conversation  # noqa: E402
from bench.machine import cpu_name  # noqa: E402
from bench.report import emit, log  # noqa: E402
from common.config import Settings  # noqa: E402
from tests.e2e.server import Server, value  # noqa: E402

HIT = re.compile(r"KV cache: hit for sha1=")
FIRST = re.compile(r"renderer first token \S+: (.*) ms$", re.M)
STAGES = ("web", "render", "queue", "wait", "place", "prefill", "sample", "back", "total")


def stages(text: str) -> dict:
    """The p50 of each stage of the time to first token, in ms, over the trace's `first
    token` lines (the renderer's; procs/renderer/answer.py)."""
    rows = [dict(zip(line.split()[::2], map(float, line.split()[1::2]))) for line in FIRST.findall(text)]
    return {k: statistics.median(r[k] for r in rows) for k in STAGES if rows and all(k in r for r in rows)}


def total(m: dict, name: str) -> float:
    """A metric's samples summed over their labels (0 when absent: the CPU has no graphs)."""
    return sum(v for (n, _), v in m.items() if n == name)


def graph_counts(srv: Server) -> tuple[float, float]:
    """CUDA graphs captured and sessions copied into the graphs' pools so far."""
    m = srv.metrics()
    return total(m, "ricordo_cuda_graph_captures_total"), total(m, "ricordo_cuda_graph_pool_copies_total")


def decode_seconds(srv: Server) -> float:
    """Seconds the inference loop has spent in decode steps (its /metrics counter)."""
    return srv.metric("ricordo_inference_busy_seconds_total", phase="decode")


def turn(client, messages, n: int) -> dict:
    t0 = time.perf_counter()
    first, parts, usage = None, [], None
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=n, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    return {"ttft_s": first or 0.0, "total_s": time.perf_counter() - t0, "answer": "".join(parts),
            "tokens": usage.completion_tokens, "prompt": usage.prompt_tokens,
            "cached": usage.prompt_tokens_details.cached_tokens}


class Peak:
    """The peak RSS of a process, sampled every 50 ms in a thread."""

    def __init__(self, proc: psutil.Process):
        self.proc, self.peak, self.stop = proc, 0, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(0.05)


def phase(srv: Server, trace: Path, seeds: list[int], args) -> dict:
    """Conversations seeds at once: their first turns, then their later turns interleaved."""
    convs = []
    for seed in seeds:
        system, users = conversation(seed, args.system_words, args.turn_words, args.turns)
        if args.shared_system:     # one agent's sessions: its system prompt, their own tasks
            system = conversation(0, args.system_words, args.turn_words, 1)[0]
            users[0] = f"Explain in detail what the module src/part{seed}.py does and how to test it."
        convs.append({"messages": [{"role": "system", "content": system}], "users": users, "turns": [],
                      "rng": random.Random(seed)})

    def run_turns(c, turns):
        for u in turns:
            if args.tool_ms and c["turns"]:     # the agent runs a tool on the last answer first
                time.sleep(c["rng"].uniform(0.5, 1.5) * args.tool_ms / 1000)
            c["messages"].append({"role": "user", "content": u})
            r = turn(srv.client(), c["messages"], args.answer_tokens)
            c["messages"].append({"role": "assistant", "content": r["answer"]})
            c["turns"].append(r)

    def together(turns_of):
        threads = [threading.Thread(target=run_turns, args=(c, turns_of(c))) for c in convs]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0
    together(lambda c: c["users"][:1])                       # the cold first turns
    mark = len(trace.read_text())
    busy, graphs = decode_seconds(srv), graph_counts(srv)
    wall = together(lambda c: c["users"][1:])
    busy = decode_seconds(srv) - busy
    graphs = [b - a for a, b in zip(graphs, graph_counts(srv))]
    traced = trace.read_text()[mark:]
    later = [t for c in convs for t in c["turns"][1:]]
    assert all(t["tokens"] == args.answer_tokens for t in later), [t["tokens"] for t in later]
    return {"conversations": len(seeds), "wall_s": wall, "answer_tokens": sum(t["tokens"] for t in later),
            "aggregate_tok_s": sum(t["tokens"] for t in later) / wall,
            "decode_s": busy, "decode_tok_s": sum(t["tokens"] for t in later) / max(busy, 1e-9),
            "ttft_p50_s": statistics.median(t["ttft_s"] for t in later),
            "stream_tok_s_p50": statistics.median((t["tokens"] - 1) / max(t["total_s"] - t["ttft_s"], 1e-9)
                                                  for t in later),
            "disk_restores": len(HIT.findall(traced)), "stages_p50_ms": stages(traced),
            "graph_captures": graphs[0], "pool_copies": graphs[1],
            "cached_share_min": min(t["cached"] / t["prompt"] for t in later),
            "first_prompt_tokens": statistics.median(c["turns"][0]["prompt"] for c in convs)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="GGUF path or catalogue name; empty = the default model")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=2600)
    ap.add_argument("--turn-words", type=int, default=140)
    ap.add_argument("--answer-tokens", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--shared-system", action="store_true",
                    help="every conversation has the same system prompt (one agent's sessions); their "
                         "batched decode then reads its rows once a step")
    ap.add_argument("--tool-ms", type=int, default=0,
                    help="after each answer a conversation waits 0.5-1.5x this many ms (its agent running a "
                         "tool), so the turns of several conversations arrive apart, not together; the "
                         "waits are inside the wall time of both phases")
    ap.add_argument("--kv-ram-mb", type=int, default=1024, help="the K/V budget of resident sessions")
    ap.add_argument("--trace", default="", help="keep the cache trace in this file")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    n = args.conversations
    with tempfile.TemporaryDirectory(prefix="ricordo-parallel-") as tmp:
        trace = Path(args.trace or Path(tmp) / "trace.log")
        env = {"RICORDO_MODEL": args.model, "RICORDO_CTX_SIZE": str(args.ctx), "RICORDO_TRACE": str(trace),
               "RICORDO_KV_DISK_DIR": str(Path(tmp) / "kv"), "RICORDO_PARALLEL": str(n),
               "RICORDO_MAX_LIVE_SESSIONS": str(n + 1), "RICORDO_KV_RAM_SPACE_MB": str(args.kv_ram_mb)}
        with Server(env=env, name="ricordo-bench-parallel") as srv:
            # the inference process itself (honcho starts it through a shell): the largest one
            inference = max((p for p in srv.processes() if "inference" in " ".join(p.cmdline())),
                            key=lambda p: p.memory_info().rss)
            # one short answer first, so the model's mapped pages count in the base
            srv.client().chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
            base = inference.memory_info().rss
            peak = Peak(inference)
            log(f"one conversation alone ({args.turns} turns) ...")
            alone = phase(srv, trace, [1000], args)
            log(f"{n} conversations at once ...")
            many = phase(srv, trace, [2000 + i for i in range(n)], args)
            peak.stop.set()
            info = srv.http().get("/health").json()
            after = srv.metrics()
    device_peak = total(after, "ricordo_device_memory_peak_bytes")
    pools = total(after, "ricordo_cuda_graph_pool_bytes")
    fused = {k: value(after, "ricordo_cuda_graph_fused_attention", kind=k) for k in ("decode", "prefill")}
    device = info.get("device", "cpu")
    if device.startswith("cuda"):     # the GPU, named beside the CPU that launches its work
        import torch
        graphs = Settings.parser("inference").parse_args([]).cuda_graphs    # as the server reads it
        device += f" ({torch.cuda.get_device_name()}, CUDA graphs {'on' if graphs else 'off'})"
    res = {"cpu": cpu_name(), "device": device, "shared_system": args.shared_system, "tool_ms": args.tool_ms, "dtype": info.get("dtype"), "model": info.get("model"), "alone": alone, "many": many,
           "aggregate_ratio": many["aggregate_tok_s"] / alone["aggregate_tok_s"],
           "ttft_ratio": many["ttft_p50_s"] / alone["ttft_p50_s"],
           "decode_ratio": many["decode_tok_s"] / alone["decode_tok_s"],
           "peak_rss_mib": peak.peak / 2**20, "device_peak_mib": device_peak / 2**20,
           "graph_pools_mib": pools / 2**20, "rss_after_load_mib": base / 2**20, "kv_budget_mib": args.kv_ram_mb}
    rows = [("later turns", f"{alone['conversations']} conversation", f"{n} at once", "ratio"),
            ("aggregate answer tok/s", f"{alone['aggregate_tok_s']:.1f}", f"{many['aggregate_tok_s']:.1f}",
             f"{res['aggregate_ratio']:.2f}x"),
            ("answer tok/s over the decode steps' time", f"{alone['decode_tok_s']:.1f}",
             f"{many['decode_tok_s']:.1f}", f"{res['decode_ratio']:.2f}x"),
            ("p50 TTFT (s)", f"{alone['ttft_p50_s']:.3f}", f"{many['ttft_p50_s']:.3f}", f"{res['ttft_ratio']:.2f}x"),
            ("p50 stream tok/s", f"{alone['stream_tok_s_p50']:.1f}", f"{many['stream_tok_s_p50']:.1f}", ""),
            ("restores from disk", str(alone["disk_restores"]), str(many["disk_restores"]), ""),
            ("least cached share", f"{alone['cached_share_min']:.3f}", f"{many['cached_share_min']:.3f}", "")]
    txt = "\n".join([f"CPU: {res['cpu']}; device {res['device']}; dtype {res['dtype']}; model {res['model']}; first prompts "
                     f"~{many['first_prompt_tokens']:.0f} tokens"
                     f"{' (one system prompt)' if args.shared_system else ''}; {args.turns - 1} later turns each, "
                     f"{args.answer_tokens} answer tokens"
                     f"{f'; {args.tool_ms} ms (0.5-1.5x) of tool time after each answer' if args.tool_ms else ''}",
                     ""] +
                    [f"| {' | '.join(r)} |" for r in rows[:1]] + ["|---|---|---|---|"] +
                    [f"| {' | '.join(r)} |" for r in rows[1:]] +
                    ["", f"inference peak RSS {res['peak_rss_mib']:.0f} MiB; after load and one short answer "
                         f"{res['rss_after_load_mib']:.0f} "
                         f"MiB + K/V budget {args.kv_ram_mb} MiB = "
                         f"{res['rss_after_load_mib'] + args.kv_ram_mb:.0f} MiB", "",
                     "p50 of each stage of the later turns' time to first token, in the server (ms; the "
                     "renderer's trace):", "",
                     "| | " + " | ".join(STAGES) + " |", "|---|" + "---|" * len(STAGES)] +
                    [f"| {label} | " + " | ".join(f"{ph['stages_p50_ms'].get(k, float('nan')):.1f}" for k in STAGES)
                     + " |" for label, ph in (("1 conversation", alone), (f"{n} at once", many))] +
                    ([] if not device.startswith("cuda") else
                     ["", f"device memory: peak {res['device_peak_mib']:.0f} MiB (the model, K/V budget "
                          f"{args.kv_ram_mb} MiB, and the graphs' K/V pools {res['graph_pools_mib']:.0f} MiB "
                          "outside it); the graphs' attention: " + ", ".join(
                              f"{k} {'fused' if v else 'product'}" for k, v in fused.items()),
                      "", f"during the later turns: CUDA graphs captured {alone['graph_captures']:.0f} and "
                          f"{many['graph_captures']:.0f}, sessions copied into the graphs' pools "
                          f"{alone['pool_copies']:.0f} and {many['pool_copies']:.0f} (1 conversation, {n} at once)"]))
    return emit(txt, res, args.json)


if __name__ == "__main__":
    sys.exit(main())
