"""Several conversations resident at once, end to end (every process of the Procfile, the real
default model, a disk cache, the official `openai` client): a side request between two turns
of a long conversation (the same system prompt, another question; then an unrelated prompt)
leaves the long conversation in memory, so its next turn restores nothing from disk; with one
resident session (the former behaviour, RICORDO_MAX_LIVE_SESSIONS=1) the same turn comes back
from its evict checkpoint. A memory budget too small for two sessions evicts the least
recently used one to disk.

Asserted from the usage the client gets, the trace's cache decisions and /metrics; nothing
depends on which tokens the model picks (each turn's answer is sent back as the model said it).
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from .server import Server

pytestmark = pytest.mark.slow

SYSTEM = ("You are the assistant of a bicycle repair shop in Ferrara. Customers ask about tyres, brakes, "
          "gears, chains, lights, saddles, prices and opening hours. The shop is open from Tuesday to "
          "Saturday, nine to one and three to seven; a puncture costs twelve euros, a brake service "
          "twenty, a full service sixty. Answer in one short sentence, politely. ") * 3
OTHER = "You translate short English phrases into Italian. Reply with the translation only."
ENV = {"RICORDO_KV_CACHE_MIN_TOKENS": "32", "RICORDO_KV_CACHE_BOUNDARY_ALIGN_TOKENS": "32",
       "RICORDO_KV_CACHE_BOUNDARY_TRIM_TOKENS": "4"}
HIT = re.compile(r"KV cache: hit for sha1=[0-9a-f]{40} \(loaded (\d+) tokens\)")


def chat(srv: Server, messages: list[dict]):
    r = srv.client().chat.completions.create(model="x", messages=messages, max_tokens=8, temperature=0)
    return r.choices[0].message.content, r.usage


def conversation(srv: Server, trace: Path) -> tuple[object, object, str]:
    """Turn 1 of the long conversation, a side request on its system prompt, an unrelated
    request, then turn 2: (turn 1 usage, turn 2 usage, trace lines written during turn 2)."""
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How much is a puncture?"}]
    answer, u1 = chat(srv, turn1)
    _, side = chat(srv, [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": "Give this chat a three-word title."}])
    assert side.prompt_tokens_details.cached_tokens >= 0.8 * u1.prompt_tokens   # the shared system prompt
    chat(srv, [{"role": "system", "content": OTHER}, {"role": "user", "content": "Good morning"}])
    mark = len(trace.read_text())
    _, u2 = chat(srv, turn1 + [{"role": "assistant", "content": answer},
                               {"role": "user", "content": "And a brake service?"}])
    return u1, u2, trace.read_text()[mark:]


def gauge(srv: Server, name: str) -> float:
    text = srv.http().get("/metrics").text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_a_side_request_leaves_the_conversation_in_memory(tmp_path):
    trace = tmp_path / "trace.log"
    env = {**ENV, "RICORDO_KV_DISK_DIR": str(tmp_path / "kv"), "RICORDO_TRACE": str(trace)}
    with Server(env=env, name="ricordo-sessions") as srv:
        u1, u2, during = conversation(srv, trace)
        # all of turn 1 (prompt and answer) from memory, nothing restored from disk
        assert u2.prompt_tokens_details.cached_tokens >= u1.prompt_tokens, during
        assert not HIT.search(during) and "live session reused" in during, during
        assert gauge(srv, "ricordo_live_sessions") == 3
        assert gauge(srv, "ricordo_resident_kv_bytes") > 0


def test_one_resident_session_brings_the_conversation_back_from_disk(tmp_path):
    trace = tmp_path / "trace.log"
    env = {**ENV, "RICORDO_KV_DISK_DIR": str(tmp_path / "kv"), "RICORDO_TRACE": str(trace),
           "RICORDO_MAX_LIVE_SESSIONS": "1"}
    with Server(env=env, name="ricordo-one-session") as srv:
        u1, u2, during = conversation(srv, trace)
        hits = [int(n) for n in HIT.findall(during)]
        assert hits and u2.prompt_tokens_details.cached_tokens == hits[0], during   # its evict checkpoint
        assert gauge(srv, "ricordo_live_sessions") == 1


def test_a_budget_for_one_session_evicts_the_least_recently_used(tmp_path):
    """64 tokens of K/V is ~5.8 MB here (SmolLM2 f32: 46 KiB a token; bf16 half): a 2 MB budget
    holds no second session, so each new conversation sends the previous one to disk."""
    trace = tmp_path / "trace.log"
    env = {**ENV, "RICORDO_KV_DISK_DIR": str(tmp_path / "kv"), "RICORDO_TRACE": str(trace),
           "RICORDO_KV_RAM_SPACE_MB": "2"}
    with Server(env=env, name="ricordo-ram-budget") as srv:
        u1, u2, during = conversation(srv, trace)
        text = trace.read_text()
        assert "leaves memory" in text and "reason evict" in text, text[-3000:]
        assert HIT.search(during), during
        assert gauge(srv, "ricordo_live_sessions") == 1


def slots(srv: Server, idle: bool = False) -> list[dict]:
    """GET /slots; idle: until no job runs (the client has its answer before inference's
    JobDone reaches the renderer), for at most 30 s."""
    deadline = time.monotonic() + 30
    while True:
        r = srv.http().get("/slots")
        assert r.status_code == 200, r.text
        if not idle or not any(s["is_processing"] for s in r.json()) or time.monotonic() > deadline:
            return r.json()
        time.sleep(0.05)


def test_slots_list_the_resident_sessions_and_the_running_job(tmp_path):
    """GET /slots: the three resident sessions, most recent first, with what each holds and
    how much of it a checkpoint holds; a streaming answer shows as a job running in its own
    session, with its answer's tokens so far."""
    trace = tmp_path / "trace.log"
    env = {**ENV, "RICORDO_KV_DISK_DIR": str(tmp_path / "kv"), "RICORDO_TRACE": str(trace)}
    with Server(env=env, name="ricordo-slots") as srv:
        u1, u2, _ = conversation(srv, trace)
        first = slots(srv, idle=True)
        assert len(first) == 3 and not any(s["is_processing"] or s["id_task"] for s in first), first
        assert len({s["id"] for s in first}) == 3 and all(s["n_ctx"] > 0 for s in first), first
        # the latest is the conversation: its prompt and answer (the answer's last token is not run)
        assert first[0]["n_tokens"] == u2.prompt_tokens + u2.completion_tokens - 1, (first, u2)
        assert 0 < first[0]["on_disk_tokens"] <= first[0]["n_tokens"], first   # turn 1's cold checkpoint
        stream = srv.client().chat.completions.create(
            model="x", messages=[{"role": "user", "content": "Count from one to a thousand."}],
            max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True})
        during = None
        for chunk in stream:
            if during is None and chunk.choices and chunk.choices[0].delta.content:
                during = slots(srv)
        running = [s for s in during if s["is_processing"]]
        assert len(running) == 1 and running[0]["id"] is None and running[0]["id_task"], during
        assert 1 <= running[0]["n_decoded"] < 200, during
        assert [s["id"] for s in during if not s["is_processing"]] == [s["id"] for s in first], during
        after = slots(srv, idle=True)
        assert len(after) == 4 and not any(s["is_processing"] for s in after), after
        assert after[0]["id"] not in {s["id"] for s in first}, after
