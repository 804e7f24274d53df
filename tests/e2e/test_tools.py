"""Tool calls end to end: every process of the Procfile with the real default model, a disk KV
cache and a trace file in temp dirs, the official `openai` client, greedy decoding.

One server, started three times (starts are what costs: the model loads each time). The tests
run in file order and share what they learn in `FLOW`:

1. replay on, cache dir D1: a forced call (named tool_choice) whole (exchange X) and streamed
   (exchange Y); X's turn 2 sends the call back with its arguments re-serialized and is served
   from the live session up to the end of the sampled call (replayed from memory); the
   checkpoint of X's session shows the bytes before the tool result are the sampled ones;
   bad input. Then X's turn 1 once more with exactly as many tokens as the sampled call took
   (exchange Z, so the model has nothing to add after it);
2. restart on D1: Z's turn 2 replays the call from the shutdown checkpoint's KTM section and
   restores that checkpoint whole; Y's turn 2 too (its turn 1 went on after the call);
3. restart with RICORDO_DISABLE_EXACT_TOOL_REPLAY=1 on a fresh dir: X again, turn 2 rendered
   from the client's JSON reuses less.

The small default model is poor at tool calls, so every call here is forced by name and
constrained by the tool's schema: it is a closed call on any CPU, and after `</tool_call>`
the grammar allows only an end-of-turn token, which the live session keeps (run_last). The
tool has two required keys, so a client that sends the arguments back with the keys reversed
changes the bytes a call renders to from JSON.
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from common import kvfile as kf
from procs.renderer.tools import CLOSE, OPEN, opener

from .server import Server

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

# one resident session: each exchange evicts the other's to disk, which these tests read back
CACHE_ENV = {"RICORDO_KV_CACHE_MIN_TOKENS": "32", "RICORDO_KV_CACHE_BOUNDARY_ALIGN_TOKENS": "32",
             "RICORDO_KV_CACHE_BOUNDARY_TRIM_TOKENS": "4", "RICORDO_MAX_LIVE_SESSIONS": "1"}
CALL_TOKENS = 40            # room for the small model to close its call
CITIES = ("Tokyo", "London", "Berlin", "Oslo", "Madrid", "Cairo", "Paris", "Lima", "Rome")
EXAMPLE = ('You answer by calling a tool. Example call:\n<tool_call>\n'
           '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "Get the weather for a city",
                       "parameters": {"type": "object",
                                      "properties": {"city": {"type": "string"},
                                                     "unit": {"type": "string", "enum": ["C", "F"]}},
                                      "required": ["city", "unit"]}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
OPENER = opener(NAMED).encode()
RESULT = "sunny, 21 C"
RESULTS = {"Z": "cloudy, 12 C"}   # not X's: X's turn 2 renders the same bytes up to the result
ID_RE = re.compile(r"call_[0-9a-f]{32}")
TOOL_LINE = re.compile(r"request (\w+): tool calls: (\d+) replayed from memory, (\d+) from disk, "
                       r"(\d+) rendered from JSON \((\d+) ids unknown\)")
HIT = re.compile(r"KV cache: hit for sha1=([0-9a-f]{40}) \(loaded (\d+) tokens\)")
LIVE = re.compile(r"KV cache: live session reused for sha1=([0-9a-f]{40}) \((\d+) tokens[,)]")

FLOW: dict = {}             # what earlier tests learned, for the later ones
USED: set = set()


def need(*keys):
    missing = [k for k in keys if k not in FLOW]
    if missing:
        pytest.skip(f"an earlier test of this file did not get {missing}")
    return [FLOW[k] for k in keys]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    kv = tmp_path_factory.mktemp("kv")
    trace = tmp_path_factory.mktemp("trace") / "trace.log"
    env = {"RICORDO_KV_DISK_DIR": str(kv), "RICORDO_TRACE": str(trace), **CACHE_ENV}
    with Server(env=env, name="ricordo-tools", start_timeout=240) as srv:
        srv.kv, srv.trace = Path(kv), Path(trace)
        yield srv


# -- helpers -----------------------------------------------------------------------------------

def trace_text(srv) -> str:
    try:
        return srv.trace.read_text()
    except FileNotFoundError:
        return ""


def tool_line(srv, rid: str) -> tuple[int, int, int, int]:
    """(memory, disk, json, unknown) of the trace line of request rid."""
    for found in TOOL_LINE.finditer(trace_text(srv)):
        if found.group(1) == rid:
            return tuple(int(x) for x in found.groups()[1:])
    raise AssertionError(f"no tool-call trace line for request {rid}:\n{trace_text(srv)[-3000:]}")


def rid_of(resp) -> str:
    return resp.id.split("-", 1)[1]


def turn1_messages(city: str) -> list[dict]:
    return [{"role": "system", "content": EXAMPLE}, {"role": "user", "content": f"What is the weather in {city}?"}]


def ask(srv, messages, max_tokens=CALL_TOKENS, **kw):
    return srv.client().chat.completions.create(model=srv.health["model"], messages=messages, tools=TOOLS,
                                                max_tokens=max_tokens, temperature=0, **kw)


def ask_streamed(srv, messages, max_tokens=CALL_TOKENS, **kw) -> list:
    return list(srv.client().chat.completions.create(
        model=srv.health["model"], messages=messages, tools=TOOLS, max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, **kw))


def first_call(try_city, has_call):
    """(city, answer) of a city not asked before; the answer must hold a closed call."""
    city = next(c for c in CITIES if c not in USED)
    USED.add(city)
    answer = try_city(city)
    assert has_call(answer), answer
    return city, answer


def reserialized(arguments: str) -> str:
    """The arguments as another client would send them back: keys reversed, other spacing."""
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    if isinstance(args, dict):
        args = dict(reversed(list(args.items())))
    out = json.dumps(args, separators=(",", ":"))
    assert out != arguments
    return out


def turn2_messages(city: str, cid: str, arguments: str, result: str = RESULT) -> list[dict]:
    return turn1_messages(city) + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": cid, "type": "function",
                         "function": {"name": "get_weather", "arguments": reserialized(arguments)}}]},
        {"role": "tool", "tool_call_id": cid, "content": result}]


def files_with_id(kv: Path, cid: str) -> list[Path]:
    out = []
    for p in sorted(kv.glob("*.kv")):
        try:
            if cid in kf.read_ktm(p):
                out.append(p)
        except (OSError, kf.KVFileError):
            pass
    return out


def wait_files_with_id(kv: Path, cid: str, reason: int, timeout: float = 60.0) -> list[Path]:
    """The checkpoints of one save reason with cid in their KTM section, waiting for one: they
    are written by the persister after the request that caused them."""
    deadline = time.monotonic() + timeout
    while True:
        found = [p for p in files_with_id(kv, cid) if kf.read_meta(p).header.reason == reason]
        if found or time.monotonic() > deadline:
            assert found, f"no {kf.REASON_NAMES[reason]} checkpoint in {kv} has {cid} in its KTM section"
            return found
        time.sleep(0.2)


def separator(text_model) -> bytes:
    """What the template puts between an assistant message's content and a tool result."""
    a, b = "\x01AAA\x01", "\x01BBB\x01"
    out = text_model.render_chat([{"role": "user", "content": "u"}, {"role": "assistant", "content": a},
                                  {"role": "tool", "content": b}], add_generation_prompt=False)
    return out.split(a)[1].split(b)[0].encode()


def tokens_through(text_model, tokens, n_bytes: int) -> int:
    """How many of a checkpoint's tokens spell exactly its first n_bytes of text."""
    total = 0
    for k, tok in enumerate(tokens):
        if total == n_bytes:
            return k
        assert total < n_bytes, f"no token ends at byte {n_bytes}"
        total += len(text_model.pieces[int(tok)])
    assert total == n_bytes, "no token ends there"
    return len(tokens)


def check_block(block: bytes, arguments: str) -> None:
    """A KTM block: the opener of the forced call (it was in the prompt), then what the model
    sampled, ending with the closing tag; it parses to the call the client got."""
    assert block.startswith(OPENER) and block.endswith(CLOSE.encode()), block
    body = json.loads(block[len(OPEN):-len(CLOSE)])
    assert body["name"] == "get_weather" and body["arguments"] == json.loads(arguments)


def check_arguments(arguments: str) -> None:
    """The arguments fit the tool's schema: both keys, in its order, the enum kept."""
    args = json.loads(arguments)
    assert list(args) == ["city", "unit"] and isinstance(args["city"], str) and args["unit"] in ("C", "F"), args


def usage_line(label: str, u) -> str:
    return (f"{label}: prompt {u.prompt_tokens}, completion {u.completion_tokens}, "
            f"cached {u.prompt_tokens_details.cached_tokens}")


# -- 1. replay on ---------------------------------------------------------------------------------

def test_named_tool_choice_gives_a_call(server):
    city, r = first_call(lambda c: ask(server, turn1_messages(c), tool_choice=NAMED),
                         lambda r: bool(r.choices[0].message.tool_calls))
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content is None and ch.message.role == "assistant"
    [c] = ch.message.tool_calls
    assert ID_RE.fullmatch(c.id), c.id
    assert c.type == "function" and c.function.name == "get_weather"
    check_arguments(c.function.arguments)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    print(usage_line(f"X turn 1 ({city})", r.usage), "->", c.function.arguments)
    FLOW["X"] = (city, c.id, c.function.arguments, r.usage)


def test_turn2_replays_the_call_from_memory(server):
    (city, cid, arguments, u1), = need("X")
    mark = len(trace_text(server))
    r = ask(server, turn2_messages(city, cid, arguments), max_tokens=6)
    u2 = r.usage
    cached = u2.prompt_tokens_details.cached_tokens
    print(usage_line("X turn 2", u2))
    assert tool_line(server, rid_of(r)) == (1, 0, 0, 0)
    # served from the live session (turn 1's prompt and sampled tokens), as far as the trace says
    reused = [int(x.group(2)) for x in LIVE.finditer(trace_text(server)[mark:])]
    assert reused == [cached]
    assert u2.prompt_tokens > u1.prompt_tokens + u1.completion_tokens
    # the whole of turn 1: the prompt, the call and the end-of-turn token after it (one less if
    # the model ended with another stop token than the one the template renders)
    assert u1.prompt_tokens + u1.completion_tokens - 1 <= cached <= u1.prompt_tokens + u1.completion_tokens, (u1, u2)
    FLOW["X2"] = (cid, u2)


def test_streamed_call_deltas(server):
    def streamed(city):
        return ask_streamed(server, turn1_messages(city), tool_choice=NAMED)

    def calls(chunks):
        return [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or ())]

    city, chunks = first_call(streamed, lambda ch: bool(calls(ch)))
    pieces = calls(chunks)
    first, rest = pieces[0], pieces[1:]
    assert first.index == 0 and ID_RE.fullmatch(first.id) and first.type == "function"
    assert first.function.name == "get_weather"
    assert rest and all(p.index == 0 and p.id is None and p.function.name is None and p.function.arguments
                        for p in rest)
    # one entry per chunk (a client may read delta.tool_calls[0] alone), and the arguments
    # stream while the model writes them: in as many chunks as it took tokens, not one
    assert all(len(ch.choices[0].delta.tool_calls or ()) <= 1 for ch in chunks if ch.choices)
    assert len(rest) >= 3, [p.function.arguments for p in pieces]
    arguments = "".join(p.function.arguments or "" for p in pieces)
    check_arguments(arguments)
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == ["tool_calls"]
    assert all(not ch.choices[0].delta.content for ch in chunks if ch.choices)   # forced call: no text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= CALL_TOKENS
    print(usage_line(f"Y turn 1 ({city}, streamed)", chunks[-1].usage), "->", arguments)
    FLOW["Y"] = (city, first.id, arguments, chunks[-1].usage)


def test_checkpoint_holds_turn1_prompt_and_the_exact_sampled_block(server, text_model):
    """Y's request evicted X's session (turn 2) to disk: its text shows the bytes before the
    tool result were turn 1's prompt and what the model sampled, byte for byte."""
    (city, cid, arguments, u1), (_, u2) = need("X", "X2")
    sessions = wait_files_with_id(server.kv, cid, kf.EVICT)
    assert len(sessions) == 1, sessions
    path = sessions[0]
    e = kf.read(path)
    assert e.header.flags & kf.FLAG_KTM and e.header.reason == kf.EVICT
    block = e.ktm[cid]
    check_block(block, arguments)
    text, tokens = e.text, [int(x) for x in e.tokens]
    pos = text.find(block)
    assert pos > 0 and text.count(block) == 1
    end = pos + len(block)
    assert text[end:].startswith(separator(text_model) + RESULT.encode())
    cached = u2.prompt_tokens_details.cached_tokens
    # the session's first tokens are turn 1's prompt, ending with the call's opener ...
    assert text_model.piece_bytes(tokens[:u1.prompt_tokens]) == text[:pos + len(OPENER)]
    # ... and turn 2 kept turn 1's tokens exactly through the end of the sampled block, and the
    # end-of-turn token after it when it is the one the template renders there
    through = tokens_through(text_model, tokens, end)
    assert cached in (through, through + 1), (cached, through)
    assert text_model.piece_bytes(tokens[:cached]) == text[:end + len(text_model.pieces[tokens[cached - 1]])
                                                            * (cached - through)]
    n_block = through - u1.prompt_tokens
    after = u1.completion_tokens - n_block
    print(f"X: sampled block {n_block} tokens, then {after} end-of-turn token")
    assert after == 1           # the grammar allows nothing but a stop token after the call
    FLOW["n_block"] = n_block


def test_unknown_call_id_renders_from_json(server):
    (city, _, arguments, _), = need("X")
    for cid in ("call_" + "0" * 32, "toolu_01abc"):
        r = ask(server, turn2_messages(city, cid, arguments), max_tokens=2)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert tool_line(server, rid_of(r)) == (0, 0, 1, 1)


@pytest.mark.parametrize("change,param", [
    (dict(tools=[{"type": "function", "function": {"description": "no name", "parameters": {}}}]),
     "tools[0].function.name"),
    (dict(tools=[{"type": "function", "function": {"name": "get_weather", "parameters": "city"}}]),
     "tools[0].function.parameters"),
    (dict(tool_choice={"type": "function", "function": {"name": "get_time"}}), "tool_choice"),
    (dict(messages=turn1_messages("Oslo") + [{"role": "tool", "content": RESULT}]), "messages[2].tool_call_id"),
])
def test_bad_tool_input_is_a_400(server, change, param):
    body = {**dict(model=server.health["model"], messages=turn1_messages("Oslo"), tools=TOOLS, max_tokens=2),
            **change}
    with pytest.raises(openai.BadRequestError) as ei:
        server.client().chat.completions.create(**body)
    assert ei.value.status_code == 400 and ei.value.param == param, ei.value.body


def test_call_with_exactly_its_tokens(server):
    """X's turn 1 again with max_tokens = the sampled block's tokens: the same call, and the
    model has no room to add anything after it (exchange Z, for the restart)."""
    (city, _, arguments, u1), n_block = need("X", "n_block")
    r = ask(server, turn1_messages(city), max_tokens=n_block, tool_choice=NAMED)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and r.usage.completion_tokens == n_block
    [c] = ch.message.tool_calls
    assert ID_RE.fullmatch(c.id) and c.function.name == "get_weather" and c.function.arguments == arguments
    FLOW["Z"] = (city, c.id, arguments, r.usage)


# -- 2. after a restart ---------------------------------------------------------------------------

def turn2_from_disk(srv, key: str):
    """Turn 2 of exchange `key` after the restart: (usage, restored sha1, tokens loaded)."""
    city, cid, arguments, u1 = FLOW[key]
    mark = len(trace_text(srv))
    r = ask(srv, turn2_messages(city, cid, arguments, RESULTS.get(key, RESULT)), max_tokens=6)
    print(usage_line(f"{key} turn 2 after restart", r.usage))
    assert tool_line(srv, rid_of(r)) == (0, 1, 0, 0)
    hits = [(x.group(1), int(x.group(2))) for x in HIT.finditer(trace_text(srv)[mark:])]
    assert len(hits) == 1, trace_text(srv)[mark:]
    (sha1, loaded), = hits
    assert r.usage.prompt_tokens_details.cached_tokens == loaded       # the restored checkpoint, whole
    return r.usage, sha1, loaded


def test_restart_replays_the_call_from_disk(server, text_model):
    (city, cid, arguments, u1), n_block = need("Z", "n_block")
    server.restart()
    files = files_with_id(server.kv, cid)
    assert files, "Z's id is in no checkpoint's KTM section"
    for p in files:
        assert kf.read_meta(p).header.flags & kf.FLAG_KTM
        check_block(kf.read_ktm(p)[cid], arguments)
    u2, sha1, loaded = turn2_from_disk(server, "Z")
    # the shutdown checkpoint of Z's session: turn 1's prompt and the sampled call, nothing else
    e = kf.read(server.kv / f"{sha1}.kv")
    assert e.header.reason == kf.SHUTDOWN and cid in e.ktm
    assert e.text.endswith(e.ktm[cid]) and text_model.piece_bytes([int(x) for x in e.tokens]) == e.text
    assert loaded == u1.prompt_tokens + u1.completion_tokens == u1.prompt_tokens + n_block
    assert u2.prompt_tokens > loaded


def test_restart_replays_a_call_the_model_went_on_after(server, text_model):
    """Y's turn 1 ended with the end-of-turn token after its call; its session went to disk
    with it."""
    (city, cid, arguments, u1), = need("Y")
    u2, sha1, loaded = turn2_from_disk(server, "Y")
    e = kf.read(wait_files_with_id(server.kv, cid, kf.EVICT, timeout=1)[0])
    block = e.ktm[cid]
    check_block(block, arguments)
    pos = e.text.find(block)
    n_block = tokens_through(text_model, e.tokens, pos + len(block)) - u1.prompt_tokens
    whole = u1.prompt_tokens + n_block
    print(f"Y: turn 1 = {u1.prompt_tokens} prompt + {n_block} call tokens; turn 2 restored {loaded} "
          f"(sha1={sha1}); Y's session on disk has {e.text[pos + len(block):]!r} after the call")
    if loaded < whole and not e.text[pos + len(block):].startswith(separator(text_model)):
        pytest.xfail("known bug: the tokens sampled after a closed call stay in the live session "
                     "(procs/renderer/server.py on_token: close_block + CancelJob), so the evict/"
                     "shutdown checkpoint of that session is no byte prefix of turn 2 and only a "
                     f"shorter checkpoint is restored ({loaded} < {whole} tokens)")
    assert loaded >= whole


# -- 3. replay off --------------------------------------------------------------------------------

def test_without_replay_less_is_reused(server, tmp_path):
    (city, _, arguments, _), (_, u2_replay) = need("X", "X2")
    server.restart(RICORDO_DISABLE_EXACT_TOOL_REPLAY="1", RICORDO_KV_DISK_DIR=str(tmp_path))
    r1 = ask(server, turn1_messages(city), tool_choice=NAMED)
    [c] = r1.choices[0].message.tool_calls
    assert ID_RE.fullmatch(c.id) and c.function.arguments == arguments   # the same call as with replay
    r2 = ask(server, turn2_messages(city, c.id, c.function.arguments), max_tokens=6)
    assert tool_line(server, rid_of(r2)) == (0, 0, 1, 0)
    with_replay = u2_replay.prompt_tokens_details.cached_tokens
    without = r2.usage.prompt_tokens_details.cached_tokens
    print(f"turn 2 cached_tokens: {with_replay} with exact replay, {without} without "
          f"(turn 1 prompt {r1.usage.prompt_tokens})")
    assert without < with_replay
    # of the sampled call only what the JSON rendering repeats: the session's tokens whose text
    # the prompt starts with end where the client's reversed keys begin (its first token or so)
    assert without <= r1.usage.prompt_tokens + 2
