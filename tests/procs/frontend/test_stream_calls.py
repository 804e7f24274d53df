"""Streamed tool calls in each API's shape, from renderer events (a fake backend: this is
the frontend's layer alone; tests/e2e/test_tools.py and test_tool_formats.py stream real
calls). The renderer sends a call's head once its name is whole and its arguments as they
grow, so one event may hold pieces of several calls and a call may span many events."""
from __future__ import annotations

import json

from common.messages import Accepted, Delta, Finished, ToolCallDelta
from tests.procs.frontend.test_agents import USAGE, events, make

A, B = "call_" + "a" * 32, "call_" + "b" * 32


def two_calls(rid, req):
    """Call A's head and first piece, then the rest of A with all of B in one event."""
    return [Accepted(rid=rid, prompt_tokens=70),
            Delta(rid=rid, tool_calls=(ToolCallDelta(index=0, id=A, name="f"), ToolCallDelta(index=0, arguments='{"x": '))),
            Delta(rid=rid, tool_calls=(ToolCallDelta(index=0, arguments="1}"), ToolCallDelta(index=1, id=B, name="g"),
                                       ToolCallDelta(index=1, arguments='{"y": '), ToolCallDelta(index=1, arguments="2}"))),
            Finished(rid=rid, finish_reason="tool_calls", usage=USAGE)]


def string_args(rid, req):
    return [Accepted(rid=rid, prompt_tokens=70),
            Delta(rid=rid, tool_calls=(ToolCallDelta(index=0, id=A, name="f"), ToolCallDelta(index=0, arguments="ls -"))),
            Delta(rid=rid, tool_calls=(ToolCallDelta(index=0, arguments="la"),)),
            Finished(rid=rid, finish_reason="tool_calls", usage=USAGE)]


def chat(tools_stream: bool = True) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": tools_stream,
            "tools": [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
                      for n in ("f", "g")]}


def test_chat_chunks_hold_one_entry_each():
    """A hand-written client reading delta.tool_calls[0] gets every piece: no chunk holds two
    entries (the same call's pieces are merged, another call goes in a chunk of its own)."""
    _, post, _ = make(two_calls)
    text = post("/v1/chat/completions", chat()).text
    ev = [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: {")]
    entries = [ch["choices"][0]["delta"].get("tool_calls") for ch in ev if ch["choices"]]
    entries = [e for e in entries if e]
    assert all(len(e) == 1 for e in entries)
    assert [e[0] for e in entries] == [
        {"index": 0, "id": A, "type": "function", "function": {"name": "f", "arguments": '{"x": '}},
        {"index": 0, "function": {"arguments": "1}"}},
        {"index": 1, "id": B, "type": "function", "function": {"name": "g", "arguments": '{"y": 2}'}}]
    whole = post("/v1/chat/completions", chat(False)).json["choices"][0]["message"]["tool_calls"]
    assert [(c["id"], c["function"]["arguments"]) for c in whole] == [(A, '{"x": 1}'), (B, '{"y": 2}')]


def test_responses_arguments_delta_per_piece():
    _, post, _ = make(two_calls)
    body = {"model": "m", "input": "hi", "stream": True,
            "tools": [{"type": "function", "name": n, "parameters": {"type": "object"}} for n in ("f", "g")]}
    ev = events(post("/v1/responses", body).text)
    deltas = [(d["output_index"], d["delta"]) for n, d in ev if n == "response.function_call_arguments.delta"]
    assert deltas == [(0, '{"x": '), (0, "1}"), (1, '{"y": '), (1, "2}")]
    done = [d["arguments"] for n, d in ev if n == "response.function_call_arguments.done"]
    assert done == ['{"x": 1}', '{"y": 2}']
    names = [n for n, _ in ev]
    assert names.index("response.function_call_arguments.delta") < names.index("response.output_item.done")


def test_messages_input_json_streams_objects_and_wraps_the_rest():
    """An object's pieces go out as they come and concatenate to the input; arguments that
    are not an object go out once, at the block's end, wrapped as {"arguments": ...}."""
    tools = [{"name": n, "input_schema": {"type": "object"}} for n in ("f", "g")]
    body = {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}], "tools": tools,
            "stream": True}
    _, post, _ = make(two_calls)
    ev = events(post("/v1/messages", body).text)
    parts = [(d["index"], d["delta"]["partial_json"]) for n, d in ev
             if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]
    assert parts == [(0, '{"x": '), (0, "1}"), (1, '{"y": '), (1, "2}")]
    _, post, _ = make(string_args)
    ev = events(post("/v1/messages", body).text)
    parts = [d["delta"]["partial_json"] for n, d in ev
             if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]
    assert [json.loads(p) for p in parts] == [{"arguments": "ls -la"}]

