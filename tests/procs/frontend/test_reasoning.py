"""A reasoning model's thinking (the renderer's Delta.reasoning: Harmony's analysis channel) in
each API's shape, from renderer events (a fake backend: the frontend's layer alone; the
renderer's side is tests/procs/renderer/test_harmony.py): Chat Completions' reasoning_content,
a Responses `reasoning` item, Anthropic thinking blocks when the request enables thinking,
none otherwise; each read by the official client's own types."""
from __future__ import annotations

import json

import pytest
from pydantic import TypeAdapter

from common.messages import Accepted, Delta, Finished, ToolCallDelta, Usage
from tests.procs.frontend.test_agents import CID, events, make

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")


USAGE_R = Usage(prompt_tokens=70, completion_tokens=12, cached_tokens=50, reasoning_tokens=5)


def think_script(rid, req):
    return [Accepted(rid=rid, prompt_tokens=70), Delta(rid=rid, reasoning="The user wants "),
            Delta(rid=rid, reasoning="the weather."), Delta(rid=rid, text="Checking."),
            Delta(rid=rid, tool_calls=(ToolCallDelta(index=0, id=CID, name="weather"),
                                       ToolCallDelta(index=0, arguments='{"city": "Oslo"}'))),
            Finished(rid=rid, finish_reason="tool_calls", usage=USAGE_R)]


TOOL = {"name": "weather", "parameters": {"type": "object"}}
THOUGHT = "The user wants the weather."


def test_chat_completions_reasoning_content():
    _, post, _ = make(think_script)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": TOOL}]}
    whole = openai.types.chat.ChatCompletion.model_validate(post("/v1/chat/completions", body).json)
    assert whole.usage.completion_tokens_details.reasoning_tokens == 5
    msg = whole.choices[0].message
    assert msg.reasoning_content == THOUGHT and msg.content == "Checking." and msg.tool_calls[0].id == CID
    text = post("/v1/chat/completions", {**body, "stream": True}).text
    chunks = [openai.types.chat.ChatCompletionChunk.model_validate(json.loads(line[6:]))
              for line in text.split("\n") if line.startswith("data: {")]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == THOUGHT
    assert "".join(d.content or "" for d in deltas) == "Checking."


def test_responses_reasoning_item():
    _, post, _ = make(think_script)
    body = {"model": "m", "input": "hi", "tools": [{"type": "function", **TOOL}]}
    r = openai.types.responses.Response.model_validate(post("/v1/responses", body).json)
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
    assert r.output[0].content[0].text == THOUGHT and r.output[0].id.startswith("rs_")
    assert r.usage.output_tokens_details.reasoning_tokens == 5
    ev = events(post("/v1/responses", {**body, "stream": True}).text)
    adapter = TypeAdapter(openai.types.responses.ResponseStreamEvent)
    parsed = [adapter.validate_python(d) for n, d in ev if isinstance(d, dict)]
    assert "".join(e.delta for e in parsed if e.type == "response.reasoning_text.delta") == THOUGHT
    [done] = [e for e in parsed if e.type == "response.reasoning_text.done"]
    assert done.text == THOUGHT and done.output_index == 0
    [last] = [e for e in parsed if e.type == "response.completed"]
    assert [o.type for o in last.response.output] == ["reasoning", "message", "function_call"]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))


@pytest.mark.parametrize("thinking", [True, False])
def test_anthropic_thinking_blocks_only_when_asked(thinking):
    _, post, _ = make(think_script)
    body = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "weather", "input_schema": {"type": "object"}}]}
    if thinking:
        body["thinking"] = {"type": "enabled", "budget_tokens": 1024}
    msg = anthropic.types.Message.model_validate(post("/v1/messages", body).json)
    want = (["thinking"] if thinking else []) + ["text", "tool_use"]
    assert [b.type for b in msg.content] == want
    if thinking:
        assert msg.content[0].thinking == THOUGHT
    ev = events(post("/v1/messages", {**body, "stream": True}).text)
    adapter = TypeAdapter(anthropic.types.RawMessageStreamEvent)
    parsed = [adapter.validate_python(d) for n, d in ev if isinstance(d, dict) and n != "ping"]
    starts = [e.content_block.type for e in parsed if e.type == "content_block_start"]
    assert starts == want
    deltas = [e.delta for e in parsed if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == (THOUGHT if thinking else "")
    assert sum(d.type == "signature_delta" for d in deltas) == int(thinking)
    assert [e.index for e in parsed if e.type == "content_block_stop"] == list(range(len(want)))


def test_reasoning_effort_reaches_the_request():
    """Chat's reasoning_effort and Responses' reasoning.effort (the chat template's
    reasoning_effort); a value outside OpenAI's is a 400 naming the field."""
    be, post, _ = make(think_script)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert post("/v1/chat/completions", {**chat, "reasoning_effort": "high"}).status_code == 200
    r = post("/v1/responses", {"model": "m", "input": "hi", "reasoning": {"effort": "low", "summary": "auto"}})
    assert r.json["reasoning"]["effort"] == "low"
    post("/v1/chat/completions", chat)
    assert [q.reasoning_effort for q in be.requests] == ["high", "low", ""]
    for path, body, param in (("/v1/chat/completions", {**chat, "reasoning_effort": "max"}, "reasoning_effort"),
                              ("/v1/responses", {"model": "m", "input": "hi", "reasoning": {"effort": 3}},
                               "reasoning.effort")):
        r = post(path, body)
        assert r.status_code == 400 and r.json["error"]["param"] == param, r.json
    assert len(be.requests) == 3


def test_reasoning_sent_back_reaches_the_message():
    """An answer's thinking as each client sends it back: Chat's reasoning_content (or
    reasoning), a Responses reasoning item before the answer's items, Anthropic thinking
    blocks; it goes with that assistant message (ChatMessage.reasoning)."""
    be, post, _ = make(think_script)
    call = {"id": CID, "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    for key in ("reasoning_content", "reasoning"):
        post("/v1/chat/completions", {"model": "m", "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "", key: "I should look.",
                                                "tool_calls": [call]},
            {"role": "tool", "tool_call_id": CID, "content": "sunny"}]})
    post("/v1/responses", {"model": "m", "input": [
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "I should look."}]},
        {"type": "function_call", "call_id": CID, "name": "weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": CID, "output": "sunny"}],
        "tools": [{"type": "function", **TOOL}]})
    post("/v1/messages", {"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "I should look.", "signature": ""},
                                          {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}],
        "tools": [{"name": "weather", "input_schema": {"type": "object"}}]})
    assert len(be.requests) == 4
    for req in be.requests:
        [answer] = [x for x in req.messages if x.role == "assistant"]
        assert answer.reasoning == "I should look." and answer.tool_calls, req.messages
        assert all(not x.reasoning for x in req.messages if x.role != "assistant")
    r = post("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "reasoning_content": 3}]})
    assert r.status_code == 400 and r.json["error"]["param"] == "messages[1].reasoning_content"


def test_chat_template_kwargs_reach_the_request():
    be, post, _ = make(think_script)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert post("/v1/chat/completions", {**chat, "chat_template_kwargs": {"enable_thinking": False}}).status_code == 200
    assert json.loads(be.requests[-1].template_kwargs) == {"enable_thinking": False}
    for bad in ([1], {"messages": []}, "x"):
        r = post("/v1/chat/completions", {**chat, "chat_template_kwargs": bad})
        assert r.status_code == 400 and r.json["error"]["param"] == "chat_template_kwargs", r.json
    assert len(be.requests) == 1
