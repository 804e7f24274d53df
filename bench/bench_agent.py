"""An agent's conversation against ricordo and against llama-cpp-python's server with its
disk prompt cache, the same GGUF, threads and context, in one run.

The conversation, as an agent sends it: a first prompt of about --system-words words of
system text and tool descriptions (3,938 tokens with the default model) and a user line; then
per turn about --turn-words words of new text (a tool result and a user line, 203 tokens)
and an answer of at most --answer-tokens tokens (temperature 0; each server's own answer is
sent back, as an agent does). Both servers are restarted before the last turn, keeping their
caches. Per turn: time to first token and total turn time (request to last chunk), medians
over --rounds conversations (each with its own text, so no round finds another's prefix);
the ratio is ricordo's figure over llama-cpp-python's.

    .venv/bin/pip install 'llama-cpp-python[server]==0.3.36'     # the peer (make bench builds it)
    .venv/bin/python bench/bench_agent.py [--model gemma3-270m] [--rounds 2] [--json]
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.llamacpp import extra_bufts_work  # noqa: E402
from bench.machine import cpu_name  # noqa: E402
from bench.report import emit, log  # noqa: E402
from common.config import Settings  # noqa: E402
from common.models import resolve  # noqa: E402
from tests.e2e.server import Clients, Server, free_port  # noqa: E402

WORDS = ("file function module test error value config request buffer cache token server client "
         "parse build run check update return import class method string list index path read write "
         "open close commit branch merge patch line column output input stream event handler").split()


def text(rng: random.Random, words: int) -> str:
    """Plausible agent text: sentences of the words above, with numbers and paths."""
    out = []
    while len(out) < words:
        n = rng.randint(6, 14)
        s = [rng.choice(WORDS) for _ in range(n)]
        s[rng.randrange(n)] = f"src/{rng.choice(WORDS)}_{rng.randint(1, 99)}.py"
        out += s
        out[-1] += "."
    return " ".join(out[:words])


def conversation(seed: int, system_words: int, turn_words: int, turns: int):
    rng = random.Random(seed)
    system = "You are a coding agent. Tools:\n" + text(rng, system_words)
    first = "Explain in detail what the module src/server.py does and how to test it."
    later = [f"Tool result:\n{text(rng, turn_words)}\nNow explain the next step in detail." for _ in range(turns - 1)]
    return system, [first] + later


PLAIN_SERVER = ("import runpy, sys; import llama_cpp.llama_cpp as lcc; dp = lcc.llama_model_default_params\n"
                "def plain():\n    p = dp()\n    p.use_extra_bufts = False\n    return p\n"
                "lcc.llama_model_default_params = plain; sys.argv[0] = 'llama_cpp.server'\n"
                "runpy.run_module('llama_cpp.server', run_name='__main__')")


class LlamaCppServer(Clients):
    """llama-cpp-python's OpenAI server with its disk cache (in its own directory, which a
    restart keeps)."""

    def __init__(self, model: str, ctx: int, threads: int):
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="llama-cpp-bench-"))
        # where ggml's extra CPU buffer types (weight repacking) crash on this file and CPU
        # (seen on an AMX Xeon), the server runs without them, as bench_model measures it
        launch = ["-m", "llama_cpp.server"] if extra_bufts_work(model, threads) else ["-c", PLAIN_SERVER]
        self.cmd = [sys.executable, *launch, "--model", model, "--n_ctx", str(ctx),
                    "--n_threads", str(threads), "--n_threads_batch", str(threads), "--cache", "True",
                    "--cache_type", "disk", "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = None

    def start(self) -> "LlamaCppServer":
        self.log = open(self.dir / "server.log", "ab")
        self.proc = subprocess.Popen(self.cmd, cwd=self.dir, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 300
        import httpx
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama_cpp.server exited: {(self.dir / 'server.log').read_text()[-2000:]}")
            try:
                if httpx.get(self.base_url + "/v1/models", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError("llama_cpp.server did not answer")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def turn(client, messages, max_tokens: int) -> dict:
    """One streamed request: time to the first content chunk, to the last, the answer."""
    t0 = time.perf_counter()
    first, parts = None, []
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens,
                                            temperature=0, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
    total = time.perf_counter() - t0
    return {"ttft_s": first if first is not None else total, "total_s": total, "chunks": len(parts),
            "answer": "".join(parts)}


def run_conversation(server, restart, system: str, users: list[str], max_tokens: int) -> list[dict]:
    messages = [{"role": "system", "content": system}]
    out = []
    for i, u in enumerate(users):
        if i == len(users) - 1:
            restart()
        messages.append({"role": "user", "content": u})
        r = turn(server.client(), messages, max_tokens)
        messages.append({"role": "assistant", "content": r["answer"]})
        out.append(r)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="GGUF path or catalogue name; empty = the default model")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=2200)       # ~3,900 tokens (SmolLM2)
    ap.add_argument("--turn-words", type=int, default=110)          # ~200 tokens
    ap.add_argument("--answer-tokens", type=int, default=128)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    s = Settings(model=a.model)
    path = resolve(s.model, s.models_path())
    kv = Path(tempfile.mkdtemp(prefix="ricordo-agent-bench-"))
    ours = Server(env={"RICORDO_MODEL": path, "RICORDO_CTX_SIZE": str(a.ctx), "RICORDO_THREADS": str(a.threads),
                       "RICORDO_KV_DISK_DIR": str(kv)}, name="agent-bench")
    peer = LlamaCppServer(path, a.ctx, a.threads)
    res = {"cpu": cpu_name(), "model": os.path.basename(path), "ctx": a.ctx, "threads": a.threads,
           "rounds": [], "settings": vars(a)}
    log(f"{res['cpu']}, {res['model']}, context {a.ctx}, {a.threads} threads")
    try:
        ours.start()
        peer.start()

        def restart_ours():
            ours.stop()
            ours.start()

        def restart_peer():
            peer.stop()
            peer.start()
        for r in range(a.rounds):
            system, users = conversation(r, a.system_words, a.turn_words, a.turns)
            got = {"ricordo": run_conversation(ours, restart_ours, system, users, a.answer_tokens),
                   "llama-cpp-python": run_conversation(peer, restart_peer, system, users, a.answer_tokens)}
            for name, turns in got.items():
                log(f"round {r + 1} {name}: " + ", ".join(
                    f"turn {i + 1} ttft {t['ttft_s']:.2f} s total {t['total_s']:.2f} s ({t['chunks']} chunks)"
                    for i, t in enumerate(turns)))
                for t in turns:
                    t.pop("answer")
            res["rounds"].append(got)
    finally:
        ours.stop()
        peer.close()
        shutil.rmtree(kv, ignore_errors=True)
    names = ("ricordo", "llama-cpp-python")
    lines = [f"agent conversation, {res['model']}, {res['cpu']}, {a.threads} threads, context {a.ctx}: "
             f"medians of {a.rounds} rounds; the servers restart before turn {a.turns}",
             "| turn | ricordo TTFT / total (s) | llama-cpp-python TTFT / total (s) | total ratio | answer chunks |",
             "|---|---|---|---|---|"]
    res["turns"] = []
    for i in range(a.turns):
        m = {n: {k: statistics.median(rd[n][i][k] for rd in res["rounds"]) for k in ("ttft_s", "total_s", "chunks")}
             for n in names}
        ratio = m["ricordo"]["total_s"] / m["llama-cpp-python"]["total_s"]
        res["turns"].append({**{n: m[n] for n in names}, "total_ratio": ratio})
        label = f"{i + 1}" + (" (after restart)" if i == a.turns - 1 else " (cold)" if i == 0 else "")
        lines.append(f"| {label} | {m['ricordo']['ttft_s']:.2f} / {m['ricordo']['total_s']:.2f} | "
                     f"{m['llama-cpp-python']['ttft_s']:.2f} / {m['llama-cpp-python']['total_s']:.2f} | "
                     f"{ratio:.2f}x | {m['ricordo']['chunks']:.0f} / {m['llama-cpp-python']['chunks']:.0f} |")
    return emit("\n".join(lines), res, a.json)


if __name__ == "__main__":
    sys.exit(main())
