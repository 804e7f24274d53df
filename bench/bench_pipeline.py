"""Pipeline overhead benchmark: what the four processes and HTTP add on top of the
model's own work, and how many plain HTTP requests the web tier serves.

(a) time to first token of a short, fully cached chat prompt (max_tokens 1, temperature 0,
    the same prompt every time so the live session covers it) through the whole server
    (`honcho start` of the Procfile) with the official openai client -- streamed (time to the
    first chunk with content) and non-streamed (whole response) -- against the same work done
    in-process (procs.inference.runtime.build + KVSession: prefill the prompt once, then per
    step truncate to len-1, prefill the last token, sample one token -- or, when the server
    reports every prompt token cached, only sample from the kept logits, which is then what
    it does; see --reference). Server requests and
    in-process steps are interleaved so both see the same machine; overhead = median(server)
    - median(in-process) of the same cell. Two ways of sending: back to back (blocks of
    --block requests, the next right after the previous answer) and with --pause seconds
    before each request (so work the server still does after answering stays out of the
    next request's time). Each server process's CPU time per request (psutil) is reported
    too: it does not stretch with the machine's load the way wall time does.
    The server runs with RICORDO_KV_CACHE_MIN_TOKENS=--min-tokens (1): with the default (512)
    the renderer does not reuse a live session that runs past a short prompt (see --help).
(b) GET /v1/models requests/s with WEB_CONCURRENCY=1 and 4: `wrk -t1 -c32` when wrk is on the
    PATH (else an asyncio httpx load of 32 connections), several runs, median.

    .venv/bin/python bench/bench_pipeline.py [--threads N] [--pause 0.3] [--requests 30]
        [--rounds 3] [--rps-runs 3] [--skip-ttft | --skip-rps] [--json]

Every figure is a median; the machine is shared, so several rounds run. The table goes to
stdout (with --json: a JSON object to stdout, the table to stderr).

The `Server` class here is also what bench_cache.py uses to start and stop the server.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from tests.e2e.server import Server as E2EServer  # noqa: E402
from bench.report import emit, log  # noqa: E402

SYSTEM = "You are a helpful assistant."
QUESTION = "What is the capital of France? Answer with one word."


def med(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


# --- starting and stopping the real server ------------------------------------------------

class Server(E2EServer):
    """The tests' `honcho start` of the Procfile (tests/e2e/server.py) with the bench's
    habits: start() returns the seconds until /health was 200, clients wait up to 600 s,
    stop() gives the shutdown checkpoint 30 s."""

    def __init__(self, env: dict | None = None):
        super().__init__(env, start_timeout=180.0, name="ricordo-bench")

    def start(self) -> float:
        t0 = time.monotonic()
        super().start()
        return time.monotonic() - t0

    def client(self):
        return super().client(timeout=600.0)

    def stop(self, kill_after: float = 30.0) -> float:
        return super().stop(kill_after)


# --- (a) fully cached prompt: server vs in-process ------------------------------------------

def messages() -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


def one_request(client, model: str, stream: bool) -> tuple[float, dict]:
    """One request of the fixed prompt (max_tokens 1, temperature 0): seconds to the first
    content chunk (stream) or to the whole response."""
    t0 = time.perf_counter()
    if stream:
        dt, info = None, {}
        for ch in client.chat.completions.create(model=model, messages=messages(), max_tokens=1,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}):
            if dt is None and ch.choices and ch.choices[0].delta.content:
                dt = time.perf_counter() - t0
                info["text"] = ch.choices[0].delta.content
            if ch.usage is not None:
                u = ch.usage
                info.update(prompt_tokens=u.prompt_tokens, cached_tokens=u.prompt_tokens_details.cached_tokens
                            if u.prompt_tokens_details else None)
        if dt is None:
            raise RuntimeError("the stream had no content chunk (the model answered a stop token?)")
        return dt, info
    r = client.chat.completions.create(model=model, messages=messages(), max_tokens=1, temperature=0)
    dt = time.perf_counter() - t0
    u = r.usage
    return dt, {"text": r.choices[0].message.content, "prompt_tokens": u.prompt_tokens,
                "cached_tokens": u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else None}


class InProcess:
    """The model's share of a fully cached request, as the inference process does it."""

    def __init__(self):
        import torch
        from common.config import Settings
        from common.messages import SamplingParams
        from common.models import load_text, resolve
        from procs.inference.kvsession import KVSession
        from procs.inference.runtime import build
        from procs.inference.sampling import Sampler
        s = Settings.load("inference", [])
        self.model, self.n_ctx, _ = build(s)
        text = load_text(resolve(s.model, s.models_path()))
        self.ids = text.encode(text.bos_text() + text.render_chat(messages(), add_generation_prompt=True).encode())
        self.sess = KVSession(self.model, self.n_ctx, s.chunk_size)
        self.sess.prefill(self.ids)
        self.params = SamplingParams(max_tokens=1, temperature=0.0)
        self.Sampler = Sampler
        self.threads = torch.get_num_threads()
        self.dtype = str(self.model.dtype).replace("torch.", "")

    def step(self, kind: str = "prefill1") -> tuple[float, float]:
        """(wall s, CPU s of this process) of the model's share of a fully cached request:
        'prefill1' = truncate to len-1, prefill the last token, sample (the server's work when
        it re-runs the last prompt token); 'sample' = sample from the logits kept after the
        prompt (its work when the live session is exactly the prompt, logits included)."""
        c0, t0 = time.process_time(), time.perf_counter()
        if kind == "prefill1":
            self.sess.truncate(len(self.ids) - 1)
            self.sess.prefill(self.ids[-1:])
        self.Sampler(self.params)(self.sess.logits)
        return time.perf_counter() - t0, time.process_time() - c0


def server_processes(srv: Server) -> dict:
    """The server's processes by role (web = gunicorn master and workers)."""
    import psutil
    out: dict = {"web": [], "renderer": [], "inference": [], "persister": [], "other": []}
    root = psutil.Process(srv.proc.pid)
    for p in [root] + root.children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        role = next((r for r in ("renderer", "inference", "persister") if f"ricordo {r}" in cmd and "/bin/sh" not in cmd),
                    "web" if "gunicorn" in cmd else "other")
        out[role].append(p)
    return out


def cpu_of(procs: dict) -> dict:
    import psutil
    out = {}
    for role, ps in procs.items():
        tot = 0.0
        for p in ps:
            try:
                t = p.cpu_times()
                tot += t.user + t.system
            except psutil.Error:
                pass
        out[role] = tot
    return out


def run_mode(client, model: str, ip: InProcess, procs: dict, n: int, stream: bool, pause: float,
             block: int, ref: str) -> dict:
    """n server requests and n in-process steps, interleaved in blocks of `block` (so both see the
    same machine), `pause` seconds before each server request and before the in-process block
    that follows (so the server's leftover work does not overlap it). With pause 0 the server
    requests of a block go back to back."""
    for _ in range(2):                         # the live session is the prompt; warm paths
        one_request(client, model, stream)
        ip.step(ref)
    server, inproc, client_cpu, inproc_cpu, info = [], [], [], [], {}
    c0 = cpu_of(procs)
    while len(server) < n:
        for _ in range(min(block, n - len(server))):
            if pause:
                time.sleep(pause)
            p0 = time.process_time()
            dt, info = one_request(client, model, stream)
            client_cpu.append(time.process_time() - p0)
            server.append(dt)
        if pause:
            time.sleep(pause)
        for _ in range(block):
            w, c = ip.step(ref)
            inproc.append(w)
            inproc_cpu.append(c)
    c1 = cpu_of(procs)
    cpu = {role: 1e3 * (c1[role] - c0[role]) / n for role in c0}
    cpu["client"] = 1e3 * med(client_cpu)
    cpu["in-process"] = 1e3 * med(inproc_cpu)
    return {"server": server, "inproc": inproc, "overhead_ms": 1e3 * (med(server) - med(inproc)),
            "cpu_ms": cpu, "info": info, "ref": ref}


# --- (b) GET /v1/models requests/s -----------------------------------------------------------

def rps_wrk(url: str, conns: int, seconds: float) -> float:
    out = subprocess.run(["wrk", "-t1", f"-c{conns}", f"-d{seconds:g}s", url], capture_output=True,
                         text=True, timeout=seconds + 30).stdout
    m = re.search(r"Requests/sec:\s*([\d.]+)", out)
    non2xx = re.search(r"Non-2xx or 3xx responses:\s*(\d+)", out)
    if not m or non2xx:
        raise RuntimeError("wrk: " + out)
    return float(m.group(1))


def rps_httpx(url: str, conns: int, seconds: float) -> float:
    async def go() -> float:
        limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
        async with httpx.AsyncClient(limits=limits, timeout=10.0) as c:
            done, bad = 0, 0
            end = time.perf_counter() + seconds

            async def worker():
                nonlocal done, bad
                while time.perf_counter() < end:
                    r = await c.get(url)
                    done += 1
                    bad += r.status_code != 200
            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(conns)))
            if bad:
                raise RuntimeError(f"{bad} non-200 answers")
            return done / (time.perf_counter() - t0)
    return asyncio.run(go())


def bench_rps(workers: int, runs: int, conns: int, seconds: float, tool: str) -> dict:
    srv = Server({"WEB_CONCURRENCY": workers})
    try:
        srv.start()
        url = srv.base_url + "/v1/models"
        fn = rps_wrk if tool == "wrk" else rps_httpx
        fn(url, conns, 1.0)                           # warm every worker's connections
        got = []
        for i in range(runs):
            got.append(fn(url, conns, seconds))
            log(f"  WEB_CONCURRENCY={workers} run {i + 1}/{runs} ({tool}): {got[-1]:.0f} req/s")
        return {"workers": workers, "tool": tool, "runs": got, "median": med(got)}
    finally:
        srv.close()


# --- main -----------------------------------------------------------------------------------

MODES = (("stream_b2b", True, False), ("whole_b2b", False, False),
         ("stream_pause", True, True), ("whole_pause", False, True))


def bench_ttft(args) -> dict:
    log("in-process model (build, prefill the prompt once)")
    ip = InProcess()
    rounds = []
    env = {"RICORDO_KV_CACHE_MIN_TOKENS": args.min_tokens} if args.min_tokens else {}
    srv = Server(env)
    try:
        log("starting the server")
        log(f"  healthy after {srv.start():.1f} s")
        client, model = srv.client(), srv.health["model"]
        procs = server_processes(srv)
        # which work the server does for a repeat of the prompt decides the in-process reference:
        # all prompt tokens cached = it samples from kept logits; one fewer = it re-runs the last
        for _ in range(3):
            _, probe = one_request(client, model, False)
        ref = args.reference if args.reference != "auto" else \
            ("sample" if probe.get("cached_tokens") == len(ip.ids) else "prefill1")
        log(f"  server reports {probe.get('cached_tokens')} of {len(ip.ids)} prompt tokens cached: "
            f"in-process reference '{ref}'")
        for rnd in range(args.rounds):
            r = {}
            for key, stream, pause in MODES:
                r[key] = run_mode(client, model, ip, procs, args.requests, stream,
                                  args.pause if pause else 0.0, 1 if pause else args.block, ref)
            rounds.append(r)
            info = r["whole_b2b"]["info"]
            log(f"  round {rnd + 1}/{args.rounds}: " + ", ".join(
                f"{k} {1e3 * med(r[k]['server']):.1f} ms vs in-process {1e3 * med(r[k]['inproc']):.1f} ms "
                f"(+{r[k]['overhead_ms']:.1f})" for k, _, _ in MODES)
                + f"; prompt {info.get('prompt_tokens')} tokens, cached {info.get('cached_tokens')}, "
                  f"answer {info.get('text')!r}")
    finally:
        srv.close()
    return {"rounds": rounds, "prompt_tokens_inproc": len(ip.ids), "threads": ip.threads, "dtype": ip.dtype,
            "reference": ref}


def table(res: dict) -> str:
    out = []
    if "ttft" in res:
        t = res["ttft"]
        st = res["settings"]
        names = {"stream_b2b": "streamed, back to back", "whole_b2b": "non-streamed, back to back",
                 "stream_pause": f"streamed, {st['pause'] * 1e3:.0f} ms pause",
                 "whole_pause": f"non-streamed, {st['pause'] * 1e3:.0f} ms pause"}
        info = t["rounds"][-1]["whole_b2b"]["info"]
        out.append(f"(a) fully cached prompt ({t['prompt_tokens_inproc']} tokens, server reports "
                   f"{info.get('cached_tokens')} cached, max_tokens 1, {t['dtype']}, {t['threads']} torch threads, "
                   f"RICORDO_KV_CACHE_MIN_TOKENS={st['min_tokens'] or 'default'}; in-process reference: "
                   + {"prefill1": "truncate to len-1, prefill the last token, sample",
                      "sample": "sample from the kept logits"}.get(t.get("reference", "prefill1"), "?")
                   + f"); {st['requests']} requests and "
                   f"{st['requests']} in-process steps per cell, interleaved; wall ms, median; overhead = server - "
                   f"in-process of the same cell")
        out.append("")
        nr = len(t["rounds"])
        out += ["| mode | " + " | ".join(f"round {i + 1}: server / in-process (+overhead)" for i in range(nr)) +
                " | median overhead | target < 10 ms |", "|" + "---|" * (nr + 3)]
        for key, _, _ in MODES:
            rs = [r[key] for r in t["rounds"]]
            ov = med([x["overhead_ms"] for x in rs])
            out.append(f"| {names[key]} | " + " | ".join(
                f"{1e3 * med(x['server']):.1f} / {1e3 * med(x['inproc']):.1f} (+{x['overhead_ms']:.1f})" for x in rs)
                + f" | +{ov:.1f} | {'yes' if ov < 10 else 'NO'} |")
        out.append("")
        out.append("CPU ms per request (median of rounds): each server process's CPU time over the cell / "
                   "requests; client = this process during a request; in-process = one step's CPU")
        out.append("")
        roles = ("web", "renderer", "inference", "persister", "other", "client", "in-process")
        out += ["| mode | " + " | ".join(roles) + " | web+renderer+client | inference - in-process |",
                "|" + "---|" * (len(roles) + 3)]
        for key, _, _ in MODES:
            c = {k: med([r[key]["cpu_ms"][k] for r in t["rounds"]]) for k in roles}
            out.append(f"| {names[key]} | " + " | ".join(f"{c[k]:.1f}" for k in roles) +
                       f" | {c['web'] + c['renderer'] + c['client']:.1f} | {c['inference'] - c['in-process']:.1f} |")
        out.append("")
    if "rps" in res:
        out.append(f"(b) GET /v1/models, {res['settings']['conns']} connections, "
                   f"{res['settings']['seconds']:g} s per run")
        out.append("")
        out += ["| WEB_CONCURRENCY | tool | runs (req/s) | median req/s |", "|---|---|---|---|"]
        for r in res["rps"]:
            out.append(f"| {r['workers']} | {r['tool']} | {', '.join(f'{x:.0f}' for x in r['runs'])} | "
                       f"{r['median']:.0f} |")
        out.append("")
    m = res["machine"]
    out.append(f"machine: {m['cpus']} CPUs, loadavg {m['loadavg_start']:.2f} -> {m['loadavg_end']:.2f}, "
               f"wall {res['wall_s']:.0f} s")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--requests", type=int, default=30, help="requests per cell (median)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (a), each with its own in-process median")
    ap.add_argument("--pause", type=float, default=0.3, help="seconds between requests in the 'pause' modes")
    ap.add_argument("--block", type=int, default=5,
                    help="back-to-back modes: server requests per block between in-process blocks")
    ap.add_argument("--rps-runs", type=int, default=3)
    ap.add_argument("--conns", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds per requests/s run")
    ap.add_argument("--workers", type=int, nargs="*", default=[1, 4], help="WEB_CONCURRENCY values for (b)")
    ap.add_argument("--tool", choices=("auto", "wrk", "httpx"), default="auto")
    ap.add_argument("--skip-ttft", action="store_true")
    ap.add_argument("--skip-rps", action="store_true")
    ap.add_argument("--min-tokens", type=int, default=1,
                    help="RICORDO_KV_CACHE_MIN_TOKENS for (a); 0 = the server's default (512). The renderer "
                         "keeps a live session that runs past the prompt (the prompt + the token it answered "
                         "last time) only when the common prefix reaches this many tokens, so with the default "
                         "a short repeated prompt is prefilled again in full")
    ap.add_argument("--reference", choices=("auto", "prefill1", "sample"), default="auto",
                    help="the in-process work compared with: auto = what the server's cached_tokens says it "
                         "does (all prompt tokens cached: sample from kept logits; one fewer: prefill 1 + sample)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads for the server's inference process and the in-process model "
                         "(RICORDO_THREADS; 0 = torch's default, one per core)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        os.environ["RICORDO_THREADS"] = str(args.threads)    # Server keeps it, Settings reads it
    tool = args.tool if args.tool != "auto" else ("wrk" if shutil.which("wrk") else "httpx")
    res = {"settings": {"requests": args.requests, "rounds": args.rounds, "pause": args.pause,
                        "conns": args.conns, "seconds": args.seconds, "threads": args.threads,
                        "min_tokens": args.min_tokens},
           "machine": {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()[0]}}
    t0 = time.perf_counter()
    if not args.skip_ttft:
        res["ttft"] = bench_ttft(args)
    if not args.skip_rps:
        res["rps"] = [bench_rps(w, args.rps_runs, args.conns, args.seconds, tool) for w in args.workers]
    res["machine"]["loadavg_end"] = os.getloadavg()[0]
    res["wall_s"] = time.perf_counter() - t0
    return emit(table(res), res, args.json)


if __name__ == "__main__":
    sys.exit(main())
