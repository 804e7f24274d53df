"""What Codex CLI and Claude Code send, at the level of one layer (fake backend): the tool
types of the Responses API (namespace, custom, built-ins left out), items they leave in the
input, Anthropic's mid-conversation system messages, blocks the model cannot read,
count_tokens, the context-overflow wording, message_start's cached split, structured output
of the title request, model names and the prompt normalization rules. The real agents'
recorded requests go through the real server in tests/e2e/test_agent_fixtures.py."""
from __future__ import annotations

import json

from common.messages import Accepted, Delta, Failed, Finished, Started, ToolCallDelta, Usage
from procs.frontend import normalize
from tests.procs.frontend.fakes import MODEL
from tests.procs.frontend.test_agents import an_error, events, make, msg_body, oa_error, text_script

USAGE = Usage(prompt_tokens=70, completion_tokens=12, cached_tokens=50)
CID = "call_" + "cd" * 16
SPAWN = {"type": "function", "name": "spawn_agent", "description": "spawn",
         "parameters": {"type": "object", "properties": {"task": {"type": "string"}}}}
NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "sub-agents", "tools": [SPAWN]}
EXEC = {"type": "function", "name": "exec_command", "parameters": {"type": "object", "properties": {}}}
PATCH = {"type": "custom", "name": "apply_patch", "description": "edit files",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}


def calls_script(*calls):
    def script(rid, req):
        evs = [Accepted(rid=rid, prompt_tokens=70)]
        for i, (name, args) in enumerate(calls):
            evs.append(Delta(rid=rid, tool_calls=(ToolCallDelta(index=i, id=CID[:-1] + str(i), name=name),
                                                  ToolCallDelta(index=i, arguments=args))))
        return evs + [Finished(rid=rid, finish_reason="tool_calls", usage=USAGE)]
    return script


def rendered_tools(req) -> dict:
    return {t["function"]["name"]: t["function"] for t in json.loads(req.tools)}


# -- /v1/responses ---------------------------------------------------------------------------

def test_codex_tool_types_namespace_custom_and_builtins():
    be, post, _ = make(calls_script(("spawn_agent", '{"task": "t"}'), ("apply_patch", '{"input": "*** Begin"}')))
    body = {"model": "gpt-5-codex", "input": "x", "parallel_tool_calls": True,
            "tools": [EXEC, NAMESPACE, PATCH, {"type": "web_search", "external_web_access": False},
                      {"type": "image_generation"}, {"type": "some_future_tool", "x": 1}],
            "tool_choice": "auto", "store": False, "include": ["reasoning.encrypted_content"],
            "reasoning": {"summary": "auto"}, "prompt_cache_key": "k", "truncation": "auto",
            "metadata": {"a": "b"}, "user": "u", "client_metadata": {"turn_id": "t"}}
    r = post("/v1/responses", body)
    assert r.status_code == 200, r.text
    tools = rendered_tools(be.requests[0])
    assert list(tools) == ["exec_command", "spawn_agent", "apply_patch"]     # built-ins left out
    assert tools["apply_patch"]["parameters"]["required"] == ["input"]
    assert "start: /.+/" in tools["apply_patch"]["description"]             # the grammar is shown
    out = r.json["output"]
    assert out[0]["type"] == "function_call" and out[0]["namespace"] == "multi_agent_v1"
    assert out[0]["name"] == "spawn_agent" and json.loads(out[0]["arguments"]) == {"task": "t"}
    assert out[1] == {"id": out[1]["id"], "type": "custom_tool_call", "status": "completed",
                      "call_id": CID[:-1] + "1", "name": "apply_patch", "input": "*** Begin"}
    assert r.json["model"] == MODEL

    # the same calls, streamed: a custom call's input goes out decoded, never as the JSON the prompt used
    body["stream"] = True
    ev = events(post("/v1/responses", body).text)
    kinds = [n for n, _ in ev]
    assert "response.custom_tool_call_input.done" in kinds
    done = [d for n, d in ev if n == "response.output_item.done"]
    assert [d["item"]["type"] for d in done] == ["function_call", "custom_tool_call"]
    assert done[0]["item"]["namespace"] == "multi_agent_v1" and done[1]["item"]["input"] == "*** Begin"
    assert not any(n == "response.function_call_arguments.delta" and d["item_id"] == done[1]["item"]["id"]
                   for n, d in ev)


def test_codex_items_come_back_as_the_calls_the_prompt_showed():
    be, post, _ = make(text_script)
    body = {"input": [
        {"type": "message", "id": "msg_1", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "look"},
                                                        {"type": "input_image", "image_url": "data:..."}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "spawn_agent",
         "namespace": "multi_agent_v1", "arguments": '{"task": "t"}'},
        {"type": "custom_tool_call", "id": "ctc_1", "call_id": "c2", "name": "apply_patch", "input": "*** Begin"},
        {"type": "web_search_call", "id": "ws_1", "status": "completed"},
        {"type": "function_call_output", "call_id": "c1", "output": "spawned"},
        {"type": "custom_tool_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "patched"}]}],
        "tools": [NAMESPACE, PATCH]}
    r = post("/v1/responses", body)
    assert r.status_code == 200, r.text
    msgs = be.requests[0].messages
    assert [m.role for m in msgs] == ["developer", "user", "assistant", "tool", "tool"]
    assert msgs[1].content == "look"                                  # the image left out
    calls = msgs[2].tool_calls
    assert [(c.id, c.function.name) for c in calls] == [("c1", "spawn_agent"), ("c2", "apply_patch")]
    assert calls[1].function.arguments == '{"input": "*** Begin"}'    # json.dumps spacing, the grammar's
    assert (msgs[3].tool_call_id, msgs[3].content, msgs[4].content) == ("c1", "spawned", "patched")


def test_namespace_member_named_like_another_tool_is_qualified():
    be, post, _ = make(calls_script(("multi_agent_v1.exec_command", "{}")))
    ns = {**NAMESPACE, "tools": [dict(EXEC)]}
    r = post("/v1/responses", {"input": "x", "tools": [EXEC, ns]})
    assert list(rendered_tools(be.requests[0])) == ["exec_command", "multi_agent_v1.exec_command"]
    [o] = r.json["output"]
    assert (o["name"], o["namespace"]) == ("exec_command", "multi_agent_v1")
    oa_error(post("/v1/responses", {"input": "x", "tools": [EXEC, EXEC]}), 400, "tools[1]")


def test_responses_tool_choice_forms():
    be, post, _ = make()
    for choice, want in [({"type": "custom", "name": "apply_patch"}, {"type": "function", "function": {"name": "apply_patch"}}),
                         ({"type": "function", "name": "spawn_agent", "namespace": "multi_agent_v1"},
                          {"type": "function", "function": {"name": "spawn_agent"}}),
                         ({"type": "allowed_tools", "mode": "required", "tools": []}, "required"),
                         ({"type": "web_search"}, "auto")]:
        r = post("/v1/responses", {"input": "x", "tools": [NAMESPACE, PATCH], "tool_choice": choice})
        assert r.status_code == 200, r.text
        assert json.loads(be.requests[-1].tool_choice) == want


def test_cut_call_is_an_incomplete_function_call_not_text():
    def cut(rid, req):
        return [Accepted(rid=rid, prompt_tokens=9),
                Delta(rid=rid, tool_calls=(ToolCallDelta(index=0, id=CID, name="exec_command"),
                                           ToolCallDelta(index=0, arguments='{"cmd": "l'))),
                Finished(rid=rid, finish_reason="length", usage=USAGE)]
    be, post, _ = make(cut)
    r = post("/v1/responses", {"input": "x", "tools": [EXEC], "tool_choice": "required", "max_output_tokens": 5})
    [o] = r.json["output"]
    assert r.json["status"] == "incomplete" and o["type"] == "function_call" and o["status"] == "incomplete"
    ev = events(post("/v1/responses", {"input": "x", "tools": [EXEC], "stream": True}).text)
    done = [d["item"] for n, d in ev if n == "response.output_item.done"]
    assert [(d["type"], d["status"]) for d in done] == [("function_call", "incomplete")]


# -- /v1/messages ------------------------------------------------------------------------------

BILLING = "x-anthropic-billing-header: cc_version=2.1.197.8a5; cc_entrypoint=sdk-cli;"


def test_claude_code_system_messages_blocks_and_billing_header():
    be, post, _ = make()
    body = msg_body(
        system=[{"type": "text", "text": BILLING}, {"type": "text", "text": "You are an agent."},
                {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "<system-reminder>date</system-reminder>"},
                                               {"type": "image", "source": {"type": "base64", "data": "x"}},
                                               {"type": "document", "source": {"type": "text", "data": "doc"}},
                                               {"type": "text", "text": "list files"}]},
                  {"role": "system", "content": "Available agent types: claude"},
                  {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                    {"type": "server_tool_use", "id": "s", "name": "web_search",
                                                     "input": {}},
                                                    {"type": "web_search_tool_result", "tool_use_id": "s",
                                                     "content": []},
                                                    {"type": "text", "text": "ok"}]},
                  {"role": "user", "content": [{"type": "container_upload", "file_id": "f"},
                                               {"type": "text", "text": "go"}]}],
        tools=[{"name": "Bash", "input_schema": {"type": "object"}},
               {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
               {"type": "bash_20250124", "name": "bash"}],
        thinking={"type": "adaptive"}, context_management={"edits": []}, output_config={"effort": "high"},
        metadata={"user_id": "{\"session_id\": \"s\"}"})
    r = post("/v1/messages?beta=true", body,
             headers={"anthropic-beta": "claude-code-20250219,mid-conversation-system-2026-04-07",
                      "anthropic-version": "2023-06-01"})
    assert r.status_code == 200, r.text
    msgs = be.requests[0].messages
    assert [m.role for m in msgs] == ["system", "user", "system", "assistant", "user"]
    assert msgs[0].content == "You are an agent.\nBe brief."          # the billing header is gone
    assert msgs[1].content == "<system-reminder>date</system-reminder>\ndoc\nlist files"
    assert msgs[2].content == "Available agent types: claude" and msgs[3].content == "ok"
    assert msgs[4].content == "go"
    assert list(rendered_tools(be.requests[0])) == ["Bash"]


def test_two_sessions_differing_only_in_the_billing_header_render_alike():
    be, post, _ = make()
    for suffix in ("8a5", "4a7"):
        post("/v1/messages", msg_body(system=[{"type": "text", "text": BILLING.replace("8a5", suffix)},
                                              {"type": "text", "text": "You are an agent."}]))
    a, b = be.requests
    assert a.messages == b.messages


def test_title_request_gets_its_json_schema():
    be, post, _ = make()
    schema = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"],
              "additionalProperties": False}
    r = post("/v1/messages", msg_body(thinking={"type": "disabled"},
                                      output_config={"effort": "high", "format": {"type": "json_schema",
                                                                                  "schema": schema}}))
    assert r.status_code == 200
    assert json.loads(be.requests[0].response_format) == {"type": "json_schema", "schema": schema, "strict": True}
    an_error(post("/v1/messages", msg_body(output_config={"format": {"type": "xml"}})), 400, "invalid_request_error")


def test_count_tokens():
    def count(rid, req):
        assert req.count_only
        return [Finished(rid=rid, finish_reason="count", usage=Usage(prompt_tokens=1234, completion_tokens=0,
                                                                     cached_tokens=0))]
    be, post, _ = make(count)
    body = msg_body(tools=[{"name": "Bash", "input_schema": {"type": "object"}}])
    del body["max_tokens"]
    r = post("/v1/messages/count_tokens?beta=true", body)
    assert r.status_code == 200 and r.json == {"input_tokens": 1234}
    assert rendered_tools(be.requests[0]) and be.requests[0].count_only


def test_context_overflow_reads_like_anthropic():
    def too_long(rid, req):
        return [Failed(rid=rid, status=400, message="This model's maximum context length is 8192 tokens, ...",
                       code="context_length_exceeded", param="messages", prompt_tokens=25000, limit=8192)]
    for stream in (False, True):
        be, post, _ = make(too_long)
        msg = an_error(post("/v1/messages", msg_body(stream=stream)), 400, "invalid_request_error")
        assert msg == "prompt is too long: 25000 tokens > 8192 maximum"
    # the OpenAI paths keep OpenAI's wording
    e = oa_error(make(too_long)[1]("/v1/responses", {"input": "x"}), 400, code="context_length_exceeded")
    assert "maximum context length" in e["message"]


def test_message_start_carries_the_cached_split():
    def script(rid, req):
        return [Accepted(rid=rid, prompt_tokens=3000), Started(rid=rid, prompt_tokens=3000, cached_tokens=2816),
                Delta(rid=rid, text="ok"),
                Finished(rid=rid, finish_reason="stop", usage=Usage(prompt_tokens=3000, completion_tokens=1,
                                                                    cached_tokens=2816))]
    be, post, _ = make(script)
    ev = events(post("/v1/messages", msg_body(stream=True)).text)
    start = ev[0][1]["message"]["usage"]
    assert (start["input_tokens"], start["cache_read_input_tokens"]) == (184, 2816)
    final = [d for n, d in ev if n == "message_delta"][0]["usage"]
    assert (final["input_tokens"], final["cache_read_input_tokens"]) == (184, 2816)


# -- model names ----------------------------------------------------------------------------------

def test_any_model_name_is_served_unless_strict():
    be, post, _ = make()
    for path, body in [("/v1/chat/completions", {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}),
                       ("/v1/completions", {"model": "davinci", "prompt": "x"}),
                       ("/v1/responses", {"model": "gpt-5-codex", "input": "x"}),
                       ("/v1/messages", msg_body(model="claude-sonnet-4-5"))]:
        r = post(path, body)
        assert r.status_code == 200 and r.json["model"] == MODEL, (path, r.text)
        strict = make(strict_model_names=True)[1](path, body)
        assert strict.status_code == 404, (path, strict.text)
    oa_error(post("/v1/chat/completions", {"model": 3, "messages": [{"role": "user", "content": "x"}]}), 400, "model")


# -- normalization rules --------------------------------------------------------------------------

def test_normalize_rules():
    assert normalize.system_text(BILLING) == ""
    assert normalize.system_text(f"{BILLING}\nYou are Claude Code.") == "You are Claude Code."
    keep = "Quote: x-anthropic-billing-header: is a header name"       # not a whole line of it
    assert normalize.system_text(keep) == keep
    assert normalize.system_text("no header here") == "no header here"
    assert all(r.why and r.agent for r in normalize.RULES)


def test_normalize_applies_to_the_system_text_of_every_api():
    be, post, _ = make()
    post("/v1/chat/completions", {"messages": [{"role": "system", "content": f"{BILLING}\nBe brief."},
                                               {"role": "user", "content": "x"}]})
    post("/v1/responses", {"instructions": f"{BILLING}\nBe brief.", "input": [
        {"role": "developer", "content": f"{BILLING}\nRules."}, {"role": "user", "content": "x"}]})
    chat, resp = be.requests
    assert chat.messages[0].content == "Be brief."
    assert [m.content for m in resp.messages[:2]] == ["Be brief.", "Rules."]
