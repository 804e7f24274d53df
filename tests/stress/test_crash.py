"""1. Crashes: kill -9 a process at the worst moment, start it again alone, and check that
the cache directory never shows a torn entry, that temp files are cleaned at the next
persister start, and that requests succeed again.

honcho stops everything when one process exits, so these tests use the shared `cluster`
(each Procfile process a separate subprocess on one run directory). After a restart the next
request goes out the moment the web answers anything, not once /health is 200:
a request that comes before the server is ready must wait for it, not fail or miss.
"""
from __future__ import annotations

import os
import random
import re
import threading
import time

import pytest

from .conftest import FULL, Stats, full_only, scale
from .harness import check_dir, entries, settle, temp_files, unique_prompt

JOB_SILENCE_S = 120.0     # procs/renderer/server.py: a job silent this long is failed


LONG_ANSWER = 2000        # tokens, end of text ignored: still generating seconds later on any CPU


class Call(threading.Thread):
    """One completion in the background: .result is ("ok", response) or ("error", exc).
    A long answer ignores the end of text: how long it runs must not hang on when this
    CPU's model happens to pick it (a 400-token answer once ended within 4 s)."""

    def __init__(self, cluster, prompt: str, max_tokens: int = 2, timeout: float = 600.0):
        super().__init__(daemon=True)
        self.c, self.prompt, self.max_tokens, self.timeout = cluster, prompt, max_tokens, timeout
        self.result = None
        self.t0 = self.t1 = 0.0

    def run(self):
        self.t0 = time.monotonic()
        try:
            r = self.c.client(timeout=self.timeout).completions.create(
                model=self.c.model, prompt=self.prompt, max_tokens=self.max_tokens, temperature=0,
                extra_body={"ignore_eos": True} if self.max_tokens > 2 else None)
            self.result = ("ok", r)
        except Exception as e:   # noqa: BLE001 (reported by the test)
            self.result = ("error", e)
        self.t1 = time.monotonic()

    @property
    def seconds(self) -> float:
        return self.t1 - self.t0


def ask(cluster, prompt: str, max_tokens: int = 2, timeout: float = 600.0, **extra):
    return cluster.client(timeout=timeout).completions.create(model=cluster.model, prompt=prompt,
                                                              max_tokens=max_tokens, temperature=0,
                                                              extra_body=extra or None)


def wait_for_temp(d, stop: threading.Thread, timeout: float) -> bool:
    """Poll until a `*.kv.tmp.*` file exists (a write in progress): True, or False when the
    request ended or the time ran out first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if temp_files(d):
            return True
        if not stop.is_alive():
            return bool(temp_files(d))
        time.sleep(0.001)
    return False


def test_persister_killed_while_writing(healthy):
    """kill -9 the persister mid-write (as soon as a temp file shows, or at a random delay
    after a request that triggers several saves), many times: no torn entry ever, temp
    files gone after the restart, the request and the next ones succeed, and the restarted
    persister writes again."""
    c = healthy
    rnd = random.Random(7)
    kills = scale(3, 40)
    files_checked = corrupt = leftovers_seen = mid_write = 0
    for i in range(kills):
        prompt = unique_prompt("crash", 1000 + i, n_words=rnd.choice(scale((45, 60, 90), (60, 90, 140, 200))))
        req = Call(c, prompt)
        req.start()
        if i % 2 == 0:   # the moment a temp file exists, plus 0-15 ms
            hit = wait_for_temp(c.kv_dir, req, timeout=300)
            time.sleep(rnd.uniform(0, 0.015))
        else:            # anywhere in the request (the saves come after the prefill)
            time.sleep(rnd.uniform(0.2, 6.0))
            hit = False
        tmps = temp_files(c.kv_dir)
        c.kill("persister")
        mid_write += bool(hit or tmps)
        req.join(600)
        assert req.result is not None and req.result[0] == "ok", (i, req.result)
        n, bad = check_dir(c.kv_dir)
        files_checked += n
        corrupt += len(bad)
        assert not bad, f"kill {i}: torn entries {bad}"
        left = temp_files(c.kv_dir)
        leftovers_seen += len(left)
        since = c.log_size("persister")
        c.start_persister()
        # the new persister may be writing already (a save queued while it was down): only its
        # own temp files may exist now
        mine = f".tmp.{c.procs['persister'].pid}"
        assert [x for x in temp_files(c.kv_dir) if not x.endswith(mine)] == [], f"kill {i}: temp files survived"
        for name in left:
            assert f"removed leftover {name}" in c.log("persister")[since:], (name, c.log("persister")[since:])
        n, bad = check_dir(c.kv_dir)
        files_checked += n
        assert not bad, f"kill {i}: torn entries after the restart {bad}"
    # the restarted persister stores again, and a request is served
    stored_before = c.trace().count("KV cache: stored")
    ask(c, unique_prompt("crash-after", 99, n_words=90))
    settle(c.kv_dir, c.trace_path)
    assert c.trace().count("KV cache: stored") > stored_before, "no checkpoint written after the restarts"
    n, bad = check_dir(c.kv_dir)
    files_checked += n
    assert not bad
    Stats.add("crash: persister kill -9 mid-write", kills=kills, kills_with_write_in_progress=mid_write,
              files_checked=files_checked, corrupt_found=corrupt, temp_leftovers_cleaned=leftovers_seen)


def test_inference_killed_idle_then_restarted(healthy):
    """kill -9 inference between requests, start it alone and ask at once: the others
    reconnect, and the request succeeds as the first one did. (Not the same text: the restarted
    process restores the prompt's checkpoint and prefills the rest, and outside --deterministic
    a bf16 prefill split elsewhere may tip a tiny model's greedy choice.)"""
    c = healthy
    prompt = unique_prompt("idle", 5, n_words=60)
    since = c.log_size("inference")
    first = ask(c, prompt, max_tokens=4, ignore_eos=True)     # four tokens, whichever they are
    before = first.choices[0]
    # idle = inference has logged the job's end (it decodes the last token after the client
    # has its answer; a kill before its JobDone leaves the renderer waiting, see below)
    c.wait_log("inference", r"job \w+: ", since=since, timeout=120)
    c.kill("inference")
    c.start("inference", wait=False)
    t0 = time.monotonic()
    c.wait_answering()
    second = ask(c, prompt, max_tokens=4, ignore_eos=True)
    after = second.choices[0]
    assert after.text and after.finish_reason == before.finish_reason == "length"
    assert second.usage.completion_tokens == first.usage.completion_tokens == 4
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    n, bad = check_dir(c.kv_dir)
    assert not bad
    Stats.add("crash: inference kill -9 idle", kills=1, files_checked=n, corrupt_found=len(bad),
              first_request_after_s=round(time.monotonic() - t0, 1))


@pytest.mark.parametrize("name", ["renderer", "web"])
def test_renderer_or_web_killed_idle_then_restarted(healthy, name):
    """kill -9 the renderer (or the web, master and workers) between requests, start it
    alone: the others reconnect and requests succeed."""
    c = healthy
    prompt = unique_prompt(f"idle-{name}", 6, n_words=40)
    before = ask(c, prompt, max_tokens=3).choices[0].text
    kills = scale(1, 3)
    for _ in range(kills):
        c.kill(name)
        c.start(name, wait=False)
        t0 = time.monotonic()
        c.wait_answering()
        assert ask(c, prompt, max_tokens=3).choices[0].text == before
    Stats.add(f"crash: {name} kill -9 idle", kills=kills, back_in_s=round(time.monotonic() - t0, 1))


def kill_mid_request(c, victim: str, phase: str, seed: int):
    """Start a long request, kill -9 `victim` during its prefill or its generation, start the
    victim again. Returns (the in-flight Call, seconds until a new request succeeded)."""
    prompt = unique_prompt(f"mid-{victim}", seed, n_words=1500 if phase == "prefill" else 40)
    req = Call(c, prompt, max_tokens=LONG_ANSWER if phase == "generation" else 2, timeout=JOB_SILENCE_S + 120)
    req.start()
    # a prefill of ~2000 tokens takes seconds: kill early in it; generation: after a few tokens
    time.sleep(1.5 if phase == "prefill" else 4.0)
    assert req.is_alive(), "the request ended before the kill; make it longer"
    c.kill(victim)
    c.start(victim, wait=False)
    c.wait_answering()
    t0 = time.monotonic()
    r = ask(c, unique_prompt("after", seed, n_words=20), max_tokens=2, timeout=JOB_SILENCE_S + 120)
    assert r.choices[0].finish_reason in ("stop", "length")
    back = time.monotonic() - t0
    req.join(JOB_SILENCE_S + 150)
    return req, back


@full_only
@pytest.mark.parametrize("phase", ["prefill", "generation"])
def test_inference_killed_mid_request(healthy, phase):
    """kill -9 inference while it prefills or generates: the in-flight request ends with an
    error (not a hang), later requests succeed, no torn entry. Measures how long the next
    request waits (the new inference's load, then the lost job is failed at once)."""
    c = healthy
    kills = 2
    waits = []
    for k in range(kills):
        req, back = kill_mid_request(c, "inference", phase, 300 + k)
        assert not req.is_alive(), "the in-flight request still hangs"
        assert req.result[0] == "error" and "503" in repr(req.result[1]), req.result
        waits.append(round(back, 1))
        n, bad = check_dir(c.kv_dir)
        assert not bad
    Stats.add(f"crash: inference kill -9 mid-{phase}", kills=kills, in_flight="503 once the new one is up",
              next_request_waited_s=waits)


@full_only
def test_inference_crash_does_not_stall_the_queue(healthy):
    """The renderer sees the new inference's boot id and fails the lost job at once (it
    waited JOB_SILENCE_S, 120 s, before)."""
    c = healthy
    _, back = kill_mid_request(c, "inference", "generation", 400)
    # a new inference loads in ~20 s; anything near JOB_SILENCE_S is the stall
    assert back < 60, f"the next request waited {back:.0f} s"


@full_only
def test_renderer_restart_fails_requests_in_flight(healthy):
    """The web's idle check asks the new renderer whether it holds the request; it does
    not, so the request fails with a 503 (it hung forever before)."""
    c = healthy
    req = Call(c, unique_prompt("mid-renderer", 1, n_words=40), max_tokens=LONG_ANSWER, timeout=100)
    req.start()
    time.sleep(3)
    assert req.is_alive()
    c.kill("renderer")
    c.start("renderer")
    req.join(120)
    Stats.add("crash: renderer kill -9 mid-request", kills=1,
              in_flight=repr(req.result[1])[:60] if req.result and req.result[0] == "error" else "ok")
    # an error (503) well before the client's own timeout, not a hang
    assert req.result[0] == "ok" or (req.seconds < 90 and "503" in repr(req.result[1])), (req.seconds, req.result)


@full_only
def test_inference_gone_fails_the_request_in_flight(healthy):
    """kill -9 inference mid-generation and leave it down: pings go unanswered, so the
    renderer fails the job after INFERENCE_SILENCE_S (20 s), not JOB_SILENCE_S (120 s)."""
    c = healthy
    req = Call(c, unique_prompt("gone", 1, n_words=40), max_tokens=LONG_ANSWER, timeout=200)
    req.start()
    time.sleep(4.0)
    assert req.is_alive(), "the request ended before the kill; make it longer"
    c.kill("inference")
    try:
        req.join(90)
    finally:
        c.start("inference")
    Stats.add("crash: inference kill -9, not restarted", kills=1,
              in_flight_failed_after_s=round(req.seconds - 4.0, 1) if req.result else None)
    assert req.result and req.result[0] == "error" and "503" in repr(req.result[1]), req.result
    assert req.seconds < 60, req.seconds
    assert ask(c, unique_prompt("gone", 2, n_words=20), max_tokens=2).choices[0].finish_reason


@full_only
def test_inference_killed_right_after_a_response(healthy):
    """kill -9 inference the moment the client has its answer: the next request is served at
    once. (Before commit b874df8 inference still decoded the last token after sending it, and
    a kill there, before its JobDone, stalled the queue for 120 s like a crash mid-request.)"""
    c = healthy
    ask(c, unique_prompt("just-done", 1, n_words=40), max_tokens=4)
    c.kill("inference")                      # at once: the job's end is not logged yet
    c.start("inference", wait=False)
    c.wait_answering()
    t0 = time.monotonic()
    ask(c, unique_prompt("just-done", 2, n_words=20), max_tokens=2, timeout=JOB_SILENCE_S + 120)
    back = time.monotonic() - t0
    Stats.add("crash: inference kill -9 right after a response", kills=1, next_request_waited_s=round(back, 1))
    assert back < 60, f"the next request waited {back:.0f} s"
