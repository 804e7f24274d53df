"""/v1/responses (OpenAI Responses) and /v1/messages (Anthropic Messages) against a scripted
fake backend: how requests map onto the GenerateRequest, the response shapes, the order and
numbering of streamed events, the error shapes, and the official clients parsing it all."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from common.config import Settings
from common.messages import (Accepted, Delta, Failed, Finished, SamplingParams, Started, TokenLogprob,
                             ToolCallDelta, Usage)
from procs.frontend import flow
from procs.frontend.app import create_app
from procs.frontend.fields import UNTIL_FULL
from tests.procs.frontend.fakes import MODEL, FakeBackend, Resp, drive

USAGE = Usage(prompt_tokens=70, completion_tokens=12, cached_tokens=50)
CID = "call_" + "ab" * 16
TOOLU = "toolu_" + "ab" * 16


def text_script(rid, req):
    return [Accepted(rid=rid, prompt_tokens=70), Delta(rid=rid, text="Hel"), Delta(rid=rid, text="lo!"),
            Finished(rid=rid, finish_reason="stop", usage=USAGE)]


def call_script(rid, req):
    return [Accepted(rid=rid, prompt_tokens=70), Delta(rid=rid, text="Let me look."),
            Delta(rid=rid, tool_calls=(ToolCallDelta(index=0, id=CID, name="weather"),
                                       ToolCallDelta(index=0, arguments='{"city": '),
                                       ToolCallDelta(index=0, arguments='"Paris"}'))),
            Finished(rid=rid, finish_reason="tool_calls", usage=USAGE)]


def length_script(rid, req):
    return [Accepted(rid=rid, prompt_tokens=70), Delta(rid=rid, text="abc"),
            Finished(rid=rid, finish_reason="length", usage=USAGE)]


def make(script=text_script, **settings):
    be = FakeBackend(script)
    app = create_app(be, Settings(model_id=MODEL, **settings))

    def post(path, body=None, headers=None, method="POST", content=None):
        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as hc:
                return Resp(await hc.request(method, path, json=body, content=content, headers=headers))
        return asyncio.run(go())
    return be, post, app


def events(text: str) -> list[tuple[str | None, dict | str]]:
    """(event name, data) of each SSE event; comments as (None, 'comment')."""
    out = []
    for block in text.split("\n\n"):
        name, data = None, None
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
            elif line.startswith(":"):
                data = "comment"
        if data is not None:
            out.append((name, data))
    return out


def oa_error(r: Resp, status: int, param="?", code="?") -> dict:
    assert r.status_code == status, r.text
    e = r.json["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"], e
    if param != "?":
        assert e["param"] == param, e
    if code != "?":
        assert e["code"] == code, e
    return e


def an_error(r: Resp, status: int, etype: str) -> str:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    d = r.json
    assert set(d) == {"type", "error"} and d["type"] == "error", d
    assert set(d["error"]) == {"type", "message"} and d["error"]["type"] == etype, d
    assert isinstance(d["error"]["message"], str) and d["error"]["message"]
    return d["error"]["message"]


# == /v1/responses =========================================================================

FN_TOOL = {"type": "function", "name": "weather", "description": "the weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def test_responses_request_mapping():
    be, post, _ = make()
    body = {"model": MODEL, "instructions": "be brief", "max_output_tokens": 20, "temperature": 0.5, "top_p": 0.9,
            "tools": [FN_TOOL], "tool_choice": {"type": "function", "name": "weather"}, "store": True,
            "input": [{"role": "developer", "content": "dev"},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                                      {"type": "input_text", "text": "b"}]},
                      {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                       "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
                      {"type": "function_call", "id": "fc_1", "call_id": CID, "name": "weather",
                       "arguments": '{"city": "Paris"}', "status": "completed"},
                      {"type": "function_call", "call_id": "call_2", "name": "weather", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": CID, "output": "sunny"},
                      {"type": "function_call_output", "call_id": "call_2",
                       "output": [{"type": "input_text", "text": "rain"}]},
                      {"type": "function_call", "call_id": "call_3", "name": "weather", "arguments": ""},
                      {"type": "function_call_output", "call_id": "call_3", "output": "snow"},
                      {"role": "user", "content": "thanks"}]}
    r = post("/v1/responses", body)
    assert r.status_code == 200, r.text
    req = be.requests[0]
    assert req.kind == "chat" and req.stop == () and not req.logprobs
    assert req.sampling == SamplingParams(max_tokens=20, temperature=0.5, top_p=0.9)
    assert json.loads(req.tools) == [{"type": "function", "function": {
        "name": "weather", "description": "the weather", "parameters": FN_TOOL["parameters"]}}]
    assert list(json.loads(req.tools)[0]["function"]) == ["name", "description", "parameters"]
    assert json.loads(req.tool_choice) == {"type": "function", "function": {"name": "weather"}}
    m = req.messages
    assert [x.role for x in m] == ["system", "developer", "user", "assistant", "tool", "tool", "assistant",
                                   "tool", "user"]
    assert m[0].content == "be brief" and m[1].content == "dev" and m[2].content == "a\nb"
    assert m[3].content == "Let me look."            # text and the calls after it: one answer
    assert [(c.id, c.function.name, c.function.arguments) for c in m[3].tool_calls] == [
        (CID, "weather", '{"city": "Paris"}'), ("call_2", "weather", "{}")]
    assert (m[4].tool_call_id, m[4].content, m[5].tool_call_id, m[5].content) == (CID, "sunny", "call_2", "rain")
    assert m[6].content == "" and m[6].tool_calls[0].id == "call_3" and m[8].content == "thanks"


def test_responses_string_input_and_defaults():
    be, post, _ = make()
    r = post("/v1/responses", {"input": "hi"})
    assert r.status_code == 200, r.text
    req = be.requests[0]
    assert [(x.role, x.content) for x in req.messages] == [("user", "hi")]
    assert req.sampling.max_tokens == UNTIL_FULL and req.tools == "" and req.tool_choice == ""
    post("/v1/responses", {"input": "hi", "tools": [FN_TOOL], "tool_choice": "required"})
    assert json.loads(be.requests[1].tool_choice) == "required"


def test_responses_whole_text():
    be, post, _ = make()
    d = post("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 9}).json
    assert d["id"].startswith("resp_") and d["object"] == "response" and d["model"] == MODEL
    assert isinstance(d["created_at"], int) and d["status"] == "completed" and d["incomplete_details"] is None
    assert d["error"] is None and d["max_output_tokens"] == 9
    [msg] = d["output"]
    assert msg["type"] == "message" and msg["id"].startswith("msg_") and msg["role"] == "assistant"
    assert msg["status"] == "completed"
    assert msg["content"] == [{"type": "output_text", "text": "Hello!", "annotations": [], "logprobs": []}]
    assert d["usage"] == {"input_tokens": 70, "input_tokens_details": {"cached_tokens": 50, "cache_write_tokens": 0},
                          "output_tokens": 12,
                          "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 82}


def test_responses_whole_function_call():
    be, post, _ = make(call_script)
    d = post("/v1/responses", {"input": "weather?", "tools": [FN_TOOL]}).json
    assert d["status"] == "completed"
    msg, fc = d["output"]
    assert msg["content"][0]["text"] == "Let me look."
    assert fc["type"] == "function_call" and fc["id"].startswith("fc_") and fc["status"] == "completed"
    assert (fc["call_id"], fc["name"], fc["arguments"]) == (CID, "weather", '{"city": "Paris"}')
    assert d["tools"] == [FN_TOOL]
    # the echo says what was done: one call per answer unless asked (README, constrained decoding)
    assert d["parallel_tool_calls"] is False and d["store"] is False
    both = post("/v1/responses", {"input": "weather?", "tools": [FN_TOOL], "parallel_tool_calls": True}).json
    assert both["parallel_tool_calls"] is True and be.requests[-1].parallel_tool_calls


def test_responses_incomplete():
    be, post, _ = make(length_script)
    d = post("/v1/responses", {"input": "hi", "max_output_tokens": 1}).json
    assert d["status"] == "incomplete" and d["incomplete_details"] == {"reason": "max_output_tokens"}
    assert d["output"][0]["status"] == "incomplete"
    ev = events(post("/v1/responses", {"input": "hi", "stream": True}).text)
    assert ev[-1][0] == "response.incomplete"
    assert ev[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_responses_stream_events():
    be, post, _ = make(call_script)
    r = post("/v1/responses", {"input": "weather?", "tools": [FN_TOOL], "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    ev = events(r.text)
    names = [n for n, _ in ev]
    assert names == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added",
                     "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                     "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert all(d["type"] == n for n, d in ev)
    assert [d["sequence_number"] for _, d in ev] == list(range(len(ev)))
    data = [d for _, d in ev]
    assert data[0]["response"]["status"] == "in_progress" and data[0]["response"]["output"] == []
    msg_id, fc_id = data[2]["item"]["id"], data[8]["item"]["id"]
    assert data[4]["item_id"] == msg_id and data[4]["delta"] == "Let me look." and data[4]["output_index"] == 0
    assert data[5]["text"] == "Let me look." and data[6]["part"]["text"] == "Let me look."
    assert data[8]["item"] == {"id": fc_id, "type": "function_call", "status": "in_progress", "call_id": CID,
                               "name": "weather", "arguments": ""}
    assert "".join(d["delta"] for d in data[9:11]) == '{"city": "Paris"}' and data[9]["output_index"] == 1
    assert data[11]["arguments"] == '{"city": "Paris"}' and data[11]["item_id"] == fc_id
    assert data[12]["item"]["arguments"] == '{"city": "Paris"}' and data[12]["item"]["status"] == "completed"
    final = data[-1]["response"]
    assert final["status"] == "completed" and final["id"] == data[0]["response"]["id"]
    assert [o["id"] for o in final["output"]] == [msg_id, fc_id]
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 50


def test_responses_bad_input():
    be, post, _ = make()
    cases = [({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
             ({"input": "x", "conversation": "c"}, "conversation"),
             ({}, "input"), ({"input": []}, "input"), ({"input": 3}, "input"),
             ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
             ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
             ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
             ({"input": "x", "tools": [{"name": "f"}]}, "tools[0].type"),
             ({"input": "x", "tools": [{"type": "namespace", "name": "n", "tools": "x"}]}, "tools[0].tools"),
             ({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
             ({"input": "x", "tools": [FN_TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
             ({"input": "x", "tool_choice": "required"}, "tool_choice"),
             ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
             ({"input": "x", "temperature": "hot"}, "temperature"),
             ({"input": "x", "top_p": 0}, "top_p"),
             ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": 3}}}, "text.format.schema"),
             ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type")]
    for body, param in cases:
        oa_error(post("/v1/responses", body), 400, param)
    e = oa_error(post("/v1/responses", {"input": "x", "previous_response_id": "r"}), 400, code="unsupported_parameter")
    assert "input" in e["message"]
    oa_error(make(strict_model_names=True)[1]("/v1/responses", {"model": "other", "input": "x"}), 404, "model",
             "model_not_found")
    assert be.requests == []


def test_responses_failures():
    def fail(rid, req):
        return [Failed(rid=rid, status=400, message="too long", code="context_length_exceeded", param="messages")]
    for stream in (False, True):
        be, post, _ = make(fail)
        oa_error(post("/v1/responses", {"input": "x", "stream": stream}), 400, "messages", "context_length_exceeded")

    def mid(rid, req):
        return [Accepted(rid=rid, prompt_tokens=1), Delta(rid=rid, text="a"),
                Failed(rid=rid, status=500, message="boom", err_type="server_error")]
    be, post, _ = make(mid)
    ev = events(post("/v1/responses", {"input": "x", "stream": True}).text)
    assert ev[-1][0] == "response.failed"
    assert ev[-1][1]["response"]["status"] == "failed"
    assert ev[-1][1]["response"]["error"] == {"code": "server_error", "message": "boom"}
    assert [d["sequence_number"] for _, d in ev] == list(range(len(ev)))


def test_responses_keepalive(monkeypatch):
    monkeypatch.setattr(flow, "KEEPALIVE_S", 0.02)

    def slow(rid, req):
        return [Accepted(rid=rid, prompt_tokens=1), 0.15] + text_script(rid, req)[1:]
    be, post, _ = make(slow)
    ev = events(post("/v1/responses", {"input": "x", "stream": True}).text)
    assert (None, "comment") in ev and ev[-1][0] == "response.completed"


def test_openai_client_responses():
    openai = pytest.importorskip("openai")
    be = FakeBackend(call_script)
    app = create_app(be, Settings(model_id=MODEL))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as hc:
            cl = openai.AsyncOpenAI(base_url="http://t/v1", api_key="k", http_client=hc, max_retries=0)
            r = await cl.responses.create(model=MODEL, input="weather?", tools=[FN_TOOL])
            assert r.output_text == "Let me look." and r.usage.input_tokens_details.cached_tokens == 50
            fc = r.output[1]
            assert fc.type == "function_call" and fc.call_id == CID and json.loads(fc.arguments) == {"city": "Paris"}
            s = await cl.responses.create(model=MODEL, input="weather?", tools=[FN_TOOL], stream=True)
            kinds = [e.type async for e in s]
            assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
            async with cl.responses.stream(model=MODEL, input="weather?", tools=[FN_TOOL]) as st:
                async for _ in st:
                    pass
                final = await st.get_final_response()
            assert final.output[1].call_id == CID
            with pytest.raises(openai.BadRequestError) as ei:
                await cl.responses.create(model=MODEL, input="x", previous_response_id="resp_1")
            assert ei.value.param == "previous_response_id"
    asyncio.run(go())


# == /v1/messages ==========================================================================

AN_TOOL = {"name": "weather", "description": "the weather",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def msg_body(**kw):
    return {"model": MODEL, "max_tokens": 32, "messages": [{"role": "user", "content": "hi"}], **kw}


def test_messages_request_mapping():
    be, post, _ = make()
    body = msg_body(system=[{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}},
                            {"type": "text", "text": "really"}],
                    temperature=0.5, top_p=0.9, top_k=40, stop_sequences=["\n\n", "END"],
                    tools=[AN_TOOL], tool_choice={"type": "tool", "name": "weather"},
                    messages=[{"role": "user", "content": [{"type": "text", "text": "weather?"}]},
                              {"role": "assistant", "content": [
                                  {"type": "thinking", "thinking": "hm", "signature": "s"},
                                  {"type": "text", "text": "Let me look."},
                                  {"type": "tool_use", "id": TOOLU, "name": "weather", "input": {"city": "Paris"}},
                                  {"type": "tool_use", "id": "toolu_other", "name": "weather", "input": {}}]},
                              {"role": "user", "content": [
                                  {"type": "text", "text": "here:"},
                                  {"type": "tool_result", "tool_use_id": TOOLU, "content": "sunny"},
                                  {"type": "tool_result", "tool_use_id": "toolu_other", "is_error": True,
                                   "content": [{"type": "text", "text": "no"}, {"type": "text", "text": "city"}]}]},
                              {"role": "assistant", "content": "ok"},
                              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x1"}]}])
    r = post("/v1/messages", body, headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == 200, r.text
    req = be.requests[0]
    assert req.kind == "chat" and req.stop == ("\n\n", "END") and req.logprobs
    assert req.sampling == SamplingParams(max_tokens=32, temperature=0.5, top_p=0.9, top_k=40)
    assert json.loads(req.tools) == [{"type": "function", "function": {
        "name": "weather", "description": "the weather", "parameters": AN_TOOL["input_schema"]}}]
    assert json.loads(req.tool_choice) == {"type": "function", "function": {"name": "weather"}}
    m = req.messages
    assert [x.role for x in m] == ["system", "user", "assistant", "tool", "tool", "user", "assistant", "tool"]
    assert m[0].content == "be brief\nreally" and m[1].content == "weather?"
    assert m[2].content == "Let me look."
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in m[2].tool_calls] == [
        (CID, "weather", {"city": "Paris"}), ("call_other", "weather", {})]
    assert (m[3].tool_call_id, m[3].content) == (CID, "sunny")
    assert (m[4].tool_call_id, m[4].content) == ("call_other", "Error: no\ncity")
    assert m[5].content == "here:" and m[6].content == "ok"
    assert (m[7].tool_call_id, m[7].content) == ("x1", "")


def test_a_trailing_assistant_message_is_continued():
    """Anthropic's prefill: a final assistant text is continued (the renderer cuts the prompt
    after it, tests/procs/renderer/test_prompt.py); with trailing whitespace it is Anthropic's
    400. Chat continues only with vLLM's continue_final_message."""
    be, post, _ = make()
    prefill = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": "Hel"}]}]
    assert post("/v1/messages", msg_body(messages=prefill)).status_code == 200
    assert be.requests[-1].continue_final and be.requests[-1].messages[-1].content == "Hel"
    assert post("/v1/messages", msg_body()).status_code == 200 and not be.requests[-1].continue_final
    r = post("/v1/messages", msg_body(messages=[prefill[0], {"role": "assistant", "content": "Hel "}]))
    assert r.status_code == 400 and "trailing whitespace" in r.json["error"]["message"]
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    assert post("/v1/chat/completions", {"model": "m", "messages": conv}).status_code == 200
    assert not be.requests[-1].continue_final
    assert post("/v1/chat/completions", {"model": "m", "messages": conv, "continue_final_message": True}).status_code == 200
    assert be.requests[-1].continue_final
    r = post("/v1/chat/completions", {"model": "m", "messages": conv[:1], "continue_final_message": True})
    assert r.status_code == 400 and r.json["error"]["param"] == "continue_final_message"


def test_message_threads_are_not_kept():
    """The SDK's beta threads: `continue` is the 404 on which it sends the whole conversation
    again (it was answered from the new messages alone), `create` is a request like any other."""
    be, post, _ = make()
    r = post("/v1/messages", msg_body(thread={"type": "continue", "previous_message_id": "msg_x"}))
    assert r.status_code == 404 and be.requests == []
    assert r.json["error"]["type"] == "not_found_error"
    assert r.json["error"]["details"] == {"error_code": "thread_not_found"}
    assert post("/v1/messages", msg_body(thread={"type": "create"})).status_code == 200
    assert post("/v1/messages", msg_body(thread="x")).status_code == 400


def test_messages_tool_choice_forms():
    be, post, _ = make()
    for choice, want in [({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none")]:
        assert post("/v1/messages", msg_body(tools=[AN_TOOL], tool_choice=choice)).status_code == 200
        assert json.loads(be.requests[-1].tool_choice) == want
    post("/v1/messages", msg_body())
    assert be.requests[-1].tools == "" and be.requests[-1].tool_choice == "" and not be.requests[-1].logprobs


def test_messages_whole_text():
    be, post, _ = make()
    d = post("/v1/messages", msg_body()).json
    assert d["id"].startswith("msg_") and d["type"] == "message" and d["role"] == "assistant"
    assert d["model"] == MODEL and d["content"] == [{"type": "text", "text": "Hello!"}]
    assert d["stop_reason"] == "end_turn" and d["stop_sequence"] is None
    assert d["usage"] == {"input_tokens": 20, "output_tokens": 12, "cache_creation_input_tokens": 0,
                          "cache_read_input_tokens": 50}


def test_messages_whole_tool_use():
    be, post, _ = make(call_script)
    d = post("/v1/messages", msg_body(tools=[AN_TOOL])).json
    assert d["stop_reason"] == "tool_use"
    assert d["content"] == [{"type": "text", "text": "Let me look."},
                            {"type": "tool_use", "id": TOOLU, "name": "weather", "input": {"city": "Paris"}}]
    d = make(length_script)[1]("/v1/messages", msg_body()).json
    assert d["stop_reason"] == "max_tokens" and d["stop_sequence"] is None


def lp(s: str) -> TokenLogprob:
    return TokenLogprob(token=s, bytes=tuple(s.encode()), logprob=-1.0)


def test_messages_stop_sequence():
    def stopped(rid, req):      # the sampled tokens go on past the text with the stop string
        return [Accepted(rid=rid, prompt_tokens=5), Delta(rid=rid, text="one", logprobs=(lp("one"),)),
                Delta(rid=rid, text=" two", logprobs=(lp(" two"),)), Delta(rid=rid, logprobs=(lp(" EN"),)),
                Delta(rid=rid, logprobs=(lp("D."),)), Finished(rid=rid, finish_reason="stop", usage=USAGE)]

    def eos(rid, req):
        return [Accepted(rid=rid, prompt_tokens=5), Delta(rid=rid, text="one", logprobs=(lp("one"),)),
                Delta(rid=rid, logprobs=(lp("<|im_end|>"),)), Finished(rid=rid, finish_reason="stop", usage=USAGE)]
    for stream in (False, True):
        be, post, _ = make(stopped)
        r = post("/v1/messages", msg_body(stop_sequences=["NOPE", " END", " E"], stream=stream))
        if stream:
            delta = [d for n, d in events(r.text) if n == "message_delta"][0]["delta"]
        else:
            delta = r.json
        assert (delta["stop_reason"], delta["stop_sequence"]) == ("stop_sequence", " E")
        be, post, _ = make(eos)
        d = post("/v1/messages", msg_body(stop_sequences=["x"])).json
        assert (d["stop_reason"], d["stop_sequence"]) == ("end_turn", None)


def test_messages_stream_events():
    be, post, _ = make(call_script)
    r = post("/v1/messages", msg_body(tools=[AN_TOOL], stream=True))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    ev = events(r.text)
    assert [n for n, _ in ev] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                  "content_block_stop", "content_block_start", "content_block_delta",
                                  "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert all(d["type"] == n for n, d in ev)
    d = [x for _, x in ev]
    start = d[0]["message"]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == 70 and start["model"] == MODEL
    assert d[2] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert d[3]["delta"] == {"type": "text_delta", "text": "Let me look."} and d[4]["index"] == 0
    assert d[5]["content_block"] == {"type": "tool_use", "id": TOOLU, "name": "weather", "input": {}}
    # the input streams in the pieces it came in, which concatenate to its JSON
    assert all(x["index"] == 1 and x["delta"]["type"] == "input_json_delta" for x in d[6:8])
    assert [x["delta"]["partial_json"] for x in d[6:8]] == ['{"city": ', '"Paris"}']
    assert d[9]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert d[9]["usage"] == {"input_tokens": 20, "output_tokens": 12, "cache_creation_input_tokens": 0,
                             "cache_read_input_tokens": 50}


def test_messages_ping_keepalive_and_failures(monkeypatch):
    monkeypatch.setattr(flow, "KEEPALIVE_S", 0.02)

    def slow(rid, req):
        return [Accepted(rid=rid, prompt_tokens=1), 0.15, Started(rid=rid, prompt_tokens=1, cached_tokens=0), 0.15,
                Delta(rid=rid, text="a"), Failed(rid=rid, status=500, message="boom", err_type="server_error")]
    be, post, _ = make(slow)
    ev = events(post("/v1/messages", msg_body(stream=True)).text)
    names = [n for n, _ in ev]
    first = names.index("message_start")
    # before the model begins: SSE comments (no event a client must know); after: Anthropic's ping
    assert first >= 2 and all(d == "comment" for _, d in ev[:first])
    assert names[first:].count("ping") >= 3
    assert ev[-1] == ("error", {"type": "error", "error": {"type": "api_error", "message": "boom"}})

    for status, etype in [(400, "invalid_request_error"), (429, "rate_limit_error"), (503, "overloaded_error")]:
        def fail(rid, req, status=status):
            return [Failed(rid=rid, status=status, message="no")]
        for stream in (False, True):
            an_error(make(fail)[1]("/v1/messages", msg_body(stream=stream)), status, etype)


def test_messages_bad_input():
    be, post, _ = make()
    no_max = msg_body()
    del no_max["max_tokens"]
    cases = [no_max, msg_body(max_tokens=0), msg_body(max_tokens="9"), msg_body(messages=[]),
             msg_body(messages=[{"role": "robot", "content": "x"}]),
             msg_body(messages=[{"role": "user", "content": 5}]),
             msg_body(messages=[{"role": "user", "content": [{"source": {}}]}]),
             msg_body(messages=[{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]}]),
             msg_body(messages=[{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                                   "input": "x"}]}]),
             msg_body(messages=[{"role": "user", "content": [{"type": "tool_result"}]}]),
             msg_body(tools=[{"name": "f"}]),
             msg_body(tools=[AN_TOOL], tool_choice={"type": "tool", "name": "nope"}),
             msg_body(tool_choice={"type": "any"}), msg_body(tool_choice="auto"),
             msg_body(stop_sequences="x"), msg_body(temperature=-1), msg_body(top_k=-1)]
    for body in cases:
        an_error(post("/v1/messages", body), 400, "invalid_request_error")
    assert "max_tokens" in an_error(post("/v1/messages", no_max), 400, "invalid_request_error")
    an_error(make(strict_model_names=True)[1]("/v1/messages", msg_body(model="claude-x")), 404, "not_found_error")
    an_error(post("/v1/messages", content=b"{nope", headers={"content-type": "application/json"}), 400,
             "invalid_request_error")
    an_error(post("/v1/messages", method="GET"), 405, "invalid_request_error")
    an_error(post("/v1/messages/count_tokens", {"messages": []}), 400, "invalid_request_error")
    an_error(make(max_body_bytes=64)[1]("/v1/messages", msg_body(system="x" * 100)), 413, "request_too_large")
    assert be.requests == []
    oa_error(post("/v1/nothing"), 404)              # the OpenAI paths keep their shape


def test_messages_unexpected_exception():
    def broken(rid, req):
        raise RuntimeError("bug")
    an_error(make(broken)[1]("/v1/messages", msg_body()), 500, "api_error")
    oa_error(make(broken)[1]("/v1/responses", {"input": "x"}), 500)


def test_api_key_headers():
    be, post, _ = make(api_key="sekrit")
    an_error(post("/v1/messages", msg_body()), 401, "authentication_error")
    an_error(post("/v1/messages", msg_body(), headers={"x-api-key": "nope"}), 401, "authentication_error")
    assert post("/v1/messages", msg_body(), headers={"x-api-key": "sekrit"}).status_code == 200
    assert post("/v1/messages", msg_body(), headers={"Authorization": "Bearer sekrit"}).status_code == 200
    oa_error(post("/v1/responses", {"input": "x"}), 401, code="invalid_api_key")
    assert post("/v1/responses", {"input": "x"}, headers={"x-api-key": "sekrit"}).status_code == 200
    assert len(be.requests) == 3


def test_disconnect_mid_stream_cancels():
    def hang(rid, req):
        return [Accepted(rid=rid, prompt_tokens=1), Delta(rid=rid, text="a"), None]
    for path, body in [("/v1/responses", {"input": "x", "stream": True}), ("/v1/messages", msg_body(stream=True))]:
        be, _, app = make(hang)
        assert asyncio.run(drive(app, body, after_first_body=True, path=path))["status"] == 200
        assert be.cancelled == [be.requests[0].rid]


def test_anthropic_client():
    anthropic = pytest.importorskip("anthropic")
    be = FakeBackend(call_script)
    app = create_app(be, Settings(model_id=MODEL, api_key="k"))

    try:                    # newer clients are built on httpx2, older ones on httpx
        import httpx2 as hx
    except ImportError:
        hx = httpx

    async def go():
        async with hx.AsyncClient(transport=hx.ASGITransport(app=app), base_url="http://t") as hc:
            cl = anthropic.AsyncAnthropic(base_url="http://t", api_key="k", http_client=hc, max_retries=0)
            m = await cl.messages.create(model=MODEL, max_tokens=10, tools=[AN_TOOL],
                                         messages=[{"role": "user", "content": "weather?"}])
            assert m.stop_reason == "tool_use" and m.content[0].text == "Let me look."
            assert m.content[1].id == TOOLU and m.content[1].input == {"city": "Paris"}
            assert m.usage.cache_read_input_tokens == 50 and m.usage.input_tokens == 20
            async with cl.messages.stream(model=MODEL, max_tokens=10, tools=[AN_TOOL],
                                          messages=[{"role": "user", "content": "weather?"}]) as st:
                async for _ in st:
                    pass
                final = await st.get_final_message()
            assert final.content[1].input == {"city": "Paris"} and final.stop_reason == "tool_use"
            assert final.usage.cache_read_input_tokens == 50 and final.usage.output_tokens == 12
            with pytest.raises(anthropic.BadRequestError) as ei:
                await cl.messages.create(model=MODEL, max_tokens=10, messages=[])
            assert ei.value.body["error"]["type"] == "invalid_request_error"
            other = await cl.messages.create(model="claude-x", max_tokens=10,
                                             messages=[{"role": "user", "content": "x"}])
            assert other.model == MODEL             # any name is served by the loaded model, which it names
            bad = anthropic.AsyncAnthropic(base_url="http://t", api_key="wrong", http_client=hc, max_retries=0)
            with pytest.raises(anthropic.AuthenticationError):
                await bad.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "x"}])
    asyncio.run(go())
