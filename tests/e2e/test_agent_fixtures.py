"""The requests Codex CLI and Claude Code really send (recorded from the CLIs, default settings,
in tests/data/agents/), replayed through every process of the Procfile with the real model
and a disk cache.

Only one thing is changed in a recorded body: the token limit (the agents send none or
64000; the small model would decode for minutes). The default model's server runs a 12k
context: Codex's prompt (~9.4k tokens) fits, Claude Code's (~23k, recorded from 2.1.197) does
not, so the Claude Code turns take the overflow path its own compaction needs (Anthropic's
wording), and its title request (small, with a JSON schema) is answered in full. Codex's second session reuses the
first one's cache, from the live session and, after a restart, from disk. Claude Code's
sessions do the same at 32k on Gemma 3 270M.
"""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from common.config import Settings
from common.models import ModelError, resolve

from .server import Server

DATA = Path(__file__).resolve().parents[1] / "data" / "agents"
CTX = 12288
ANSWER = 8
HEADERS = ("anthropic-beta", "anthropic-version", "content-type", "user-agent", "originator", "accept",
           "x-app", "openai-beta")


def fixture(agent: str, name: str) -> dict:
    return json.loads((DATA / agent / f"{name}.json").read_text())


def replay(srv: Server, agent: str, name: str, **changes) -> httpx.Response:
    f = fixture(agent, name)
    body = {**f["body"], **changes}
    headers = {k: v for k, v in f["headers"].items() if k.lower() in HEADERS}
    q = f.get("query") or ""
    with srv.http(timeout=600.0) as c:
        return c.post(f["path"] + (f"?{q}" if q else ""), json=body, headers=headers)


def sse(text: str) -> list[tuple[str, dict]]:
    out = []
    for block in text.split("\n\n"):
        name = data = None
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
        if data is not None:
            out.append((name, data))
    return out


def final_response(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text[:2000]
    ev = sse(r.text)
    names = [n for n, _ in ev]
    assert names[0] == "response.created" and names[-1] in ("response.completed", "response.incomplete"), names
    return ev[-1][1]["response"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    env = {"RICORDO_CTX_SIZE": str(CTX), "RICORDO_KV_DISK_DIR": str(tmp_path_factory.mktemp("kv"))}
    with Server(env=env, name="ricordo-agent-fixtures") as srv:
        yield srv


SEEN: dict = {}


def test_codex_first_session(server):
    r1 = final_response(replay(server, "codex", "session1_turn1", max_output_tokens=ANSWER))
    u1 = r1["usage"]
    assert u1["input_tokens"] > 8192 and u1["output_tokens"] <= ANSWER
    assert r1["model"] == server.health["model"]        # Codex asked for "smollm2"-or-whatever: served anyway
    # turn 2 sends back a call the capture server made up (unknown id: rendered from its JSON)
    r2 = final_response(replay(server, "codex", "session1_turn2", max_output_tokens=ANSWER))
    u2 = r2["usage"]
    print(f"codex s1: turn1 {u1}, turn2 {u2}")
    assert u2["input_tokens_details"]["cached_tokens"] >= 0.9 * u1["input_tokens"]
    SEEN["codex"] = u1["input_tokens"]


def test_codex_second_session_hits_the_live_session(server):
    shared = SEEN.get("codex") or pytest.skip("needs the first session")
    r = final_response(replay(server, "codex", "session2_turn1", max_output_tokens=ANSWER))
    cached = r["usage"]["input_tokens_details"]["cached_tokens"]
    print(f"codex s2 turn1: {r['usage']}")
    assert cached >= 0.9 * shared


def test_claude_code_title_request_answers_its_schema(server):
    r = replay(server, "claude", "session1_title", max_tokens=48)
    assert r.status_code == 200, r.text[:2000]
    ev = sse(r.text)
    names = [n for n, _ in ev]
    assert names[0] == "message_start" and names[-1] == "message_stop", names
    text = "".join(d["delta"].get("text", "") for n, d in ev if n == "content_block_delta")
    stop = [d for n, d in ev if n == "message_delta"][0]["delta"]["stop_reason"]
    if stop == "end_turn":          # the grammar closed the object: it is what the schema says
        assert set(json.loads(text)) == {"title"}
    else:
        assert stop == "max_tokens" and text.startswith("{")


def test_claude_code_main_turn_overflows_the_way_claude_code_compacts(server):
    with server.http() as c:
        n = c.post("/v1/messages/count_tokens?beta=true",
                   json={k: v for k, v in fixture("claude", "session1_turn1")["body"].items() if k != "max_tokens"},
                   headers={"anthropic-version": "2023-06-01"})
    assert n.status_code == 200, n.text
    tokens = n.json()["input_tokens"]
    assert tokens > CTX
    for name in ("session1_turn1", "session1_turn2"):
        r = replay(server, "claude", name, max_tokens=ANSWER)
        assert r.status_code == 400, r.text[:500]
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        if name == "session1_turn1":
            assert err["error"]["message"] == f"prompt is too long: {tokens} tokens > {CTX} maximum"
        else:
            assert err["error"]["message"].startswith("prompt is too long: ")


def test_codex_second_session_after_a_restart_comes_from_disk(server):
    shared = SEEN.get("codex") or pytest.skip("needs the first session")
    server.restart()
    r = final_response(replay(server, "codex", "session2_turn2", max_output_tokens=ANSWER))
    cached = r["usage"]["input_tokens_details"]["cached_tokens"]
    print(f"codex s2 turn2 after restart: {r['usage']}")
    assert cached >= 0.9 * shared


LONG_MODEL = "gemma3-270m"


def test_claude_code_second_session_reuses_the_first_at_32k(tmp_path):
    """At a context that holds Claude Code's prompt (Gemma 3 270M, trained to 32k): the second
    session's first turn is served from the first session's live state, and after a restart
    its second turn from disk."""
    try:
        resolve(LONG_MODEL, Settings().models_path())
    except ModelError as e:   # `make test` fetches it
        pytest.fail(str(e))
    env = {"RICORDO_CTX_SIZE": "32768", "RICORDO_KV_DISK_DIR": str(tmp_path / "kv"), "RICORDO_MODEL": LONG_MODEL}
    (tmp_path / "kv").mkdir()
    with Server(env=env, name="ricordo-claude-32k") as srv:
        def turn(name: str) -> dict:
            r = replay(srv, "claude", name, max_tokens=ANSWER)
            assert r.status_code == 200, r.text[:2000]
            ev = sse(r.text)
            start = ev[0][1]["message"]["usage"]
            final = [d for n, d in ev if n == "message_delta"][0]["usage"]
            assert start["cache_read_input_tokens"] == final["cache_read_input_tokens"]   # known from the start
            return final
        first = turn("session1_turn1")
        whole = first["input_tokens"] + first["cache_read_input_tokens"]
        second = turn("session2_turn1")
        print(f"claude code: session 1 {first}, session 2 {second}")
        assert whole > 20000 and second["cache_read_input_tokens"] >= 0.9 * whole
        srv.restart()
        again = turn("session2_turn2")
        print(f"claude code after a restart: {again}")
        assert again["cache_read_input_tokens"] >= 0.9 * whole
