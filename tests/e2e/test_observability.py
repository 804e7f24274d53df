"""Issue 6 end to end: after a scripted conversation against the real processes, /metrics
parses with prometheus-client's parser and its counters equal what the conversation did,
and `ricordo cache ls --json` / `verify` see exactly the files the server wrote."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from tests.e2e.server import REPO, Server, samples, value

SYSTEM = "You are a terse assistant. " + " ".join(f"Fact {i}: item {i} is blue." for i in range(12))


def cache_cli(kv, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "RICORDO_KV_DISK_DIR": str(kv)}
    return subprocess.run([sys.executable, "-m", "procs.cli", "cache", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    kv = tmp_path_factory.mktemp("kv")
    trace = tmp_path_factory.mktemp("trace") / "trace.txt"
    env = {"RICORDO_KV_DISK_DIR": str(kv), "RICORDO_TRACE": str(trace),
           "RICORDO_KV_CACHE_MIN_TOKENS": "32", "RICORDO_KV_CACHE_BOUNDARY_ALIGN_TOKENS": "32",
           "RICORDO_KV_CACHE_BOUNDARY_TRIM_TOKENS": "4", "RICORDO_THREADS": "2"}
    with Server(env=env, name="observability") as srv:
        c = srv.client()
        model = srv.health["model"]
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which item is 3?"}]
        walls = [time.monotonic()]
        r1 = c.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
        walls.append(time.monotonic())
        msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
                 {"role": "user", "content": "And item 4?"}]
        r2 = c.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
        walls.append(time.monotonic())
        time.sleep(3)    # the persister's gauges and last writes
        with srv.http() as h:
            text = h.get("/metrics").text
        yield {"srv": srv, "kv": kv, "trace": trace, "usages": [r1.usage, r2.usage], "metrics": samples(text),
               "walls": [b - a for a, b in zip(walls, walls[1:])]}


def test_metrics_counters_equal_the_conversation(run):
    m, (u1, u2) = run["metrics"], run["usages"]
    assert value(m, "ricordo_prompt_tokens_total") == u1.prompt_tokens + u2.prompt_tokens
    assert value(m, "ricordo_cached_tokens_total") == (u1.prompt_tokens_details.cached_tokens
                                                        + u2.prompt_tokens_details.cached_tokens)
    assert value(m, "ricordo_generated_tokens_total") == u1.completion_tokens + u2.completion_tokens
    assert u2.prompt_tokens_details.cached_tokens > 0
    assert value(m, "ricordo_cache_lookups_total", outcome="miss", reason="no checkpoints") == 1
    assert value(m, "ricordo_cache_lookups_total", outcome="live", reason="") == 1
    assert value(m, "ricordo_http_requests_total", endpoint="/v1/chat/completions", method="POST",
                 status="200") == 2
    stored = re.findall(r"stored sha1=[0-9a-f]{40} \(\d+ tokens, reason (\w+)", run["trace"].read_text())
    assert stored, "the conversation stored no checkpoint"
    for reason in set(stored):
        assert value(m, "ricordo_checkpoints_stored_total", reason=reason) == stored.count(reason)
    files = [f for f in os.listdir(run["kv"]) if f.endswith(".kv")]
    assert value(m, "ricordo_cache_dir_entries") == len(files)
    assert value(m, "ricordo_cache_dir_bytes") == sum(os.path.getsize(run["kv"] / f) for f in files)
    assert value(m, "ricordo_time_to_first_token_seconds_count") == 2


def test_the_first_tokens_time_is_told_stage_by_stage(run):
    """Each request's trace line splits its time to first token into stages timed by three
    processes on one clock: none negative, each request's own (the web's stamp reached the
    renderer, inference's stamps came with the token), within the client's wall time, and
    the histograms counted both requests."""
    lines = re.findall(r"renderer first token (\S+): (.*) ms$", run["trace"].read_text(), re.M)
    assert len(lines) == 2 and lines[0][0] != lines[1][0]
    stages = ("web", "render", "queue", "wait", "place", "prefill", "sample", "back")
    for (_, text), wall in zip(lines, run["walls"]):
        words = text.split()
        got = dict(zip(words[::2], map(float, words[1::2])))
        assert tuple(got) == (*stages, "total"), text
        assert all(got[k] >= 0 for k in stages), text
        assert got["web"] > 0 and got["render"] > 0 and got["prefill"] > 0, text
        assert abs(sum(got[k] for k in stages) - got["total"]) < 0.1, text
        assert got["total"] < 1000 * wall, (text, wall)
    for stage in stages:
        assert value(run["metrics"], "ricordo_first_token_stage_seconds_count", stage=stage) == 2


def test_cache_cli_sees_the_servers_files(run):
    kv = run["kv"]
    on_disk = sorted(f[:-3] for f in os.listdir(kv) if f.endswith(".kv"))
    ls = cache_cli(kv, "ls", "--json")
    assert ls.returncode == 0, ls.stderr
    rows = json.loads(ls.stdout)
    assert sorted(r["sha1"] for r in rows) == on_disk
    for r in rows:
        assert r["size"] == os.path.getsize(kv / f"{r['sha1']}.kv") and r["tokens"] > 0
        assert r["reason"] in ("cold", "continued", "evict", "shutdown")
    ok = cache_cli(kv, "verify")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    victim = kv / f"{on_disk[0]}.kv"
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF          # a payload byte (K/V rows, before the checksum)
    victim.write_bytes(bytes(data))
    bad = cache_cli(kv, "verify")
    assert bad.returncode != 0 and on_disk[0] in bad.stdout + bad.stderr


def test_decode_measures_another_thread_count_and_says_which_it_runs_on(run):
    """Last in this file: its answer writes checkpoints the tests above do not expect."""
    srv = run["srv"]
    assert value(run["metrics"], "ricordo_decode_threads") == 2     # --threads 2, before any probe
    r = srv.client().chat.completions.create(model=srv.health["model"], max_tokens=600, temperature=0,
                                             messages=[{"role": "user", "content": "Count to fifty."}],
                                             extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 600
    m = srv.metrics()
    # a probe after 0.1 s of decode, for 0.4 s (either outcome, by this machine's load): 600 steps
    # last 0.6 s at 1,000 tokens/s
    probes = value(m, "ricordo_decode_thread_probes_total", outcome="kept") + \
        value(m, "ricordo_decode_thread_probes_total", outcome="switched")
    assert probes >= 1, [k for k in m if "thread" in k[0]]
    assert value(m, "ricordo_decode_threads") in (1, 2)
