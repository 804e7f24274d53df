"""Model families' own tool formats end to end: the real processes and default model, the
official `openai` client, a chat template given with --chat-template-file in the family's
format (Qwen/Hermes `<tool_call>`, Llama 3.1's bare JSON, Mistral's `[TOOL_CALLS][...]` and
its later `[TOOL_CALLS]NAME[ARGS]{...}` (Small 3.2, Devstral, Ministral 3), Qwen3-Coder's XML bodies, GLM-4.5's `<arg_key>`/`<arg_value>` pairs; written for the tests,
tests/data/templates).

Per family: a forced call comes back as a parsed call in the family's syntax (Mistral: ids
of 9 letters and digits), streamed and whole; the next turn, with the call and its result,
is served from the live session up to the end of the call (exact replay: the prompt renders
the bytes the model wrote); auto with a template that lists the tools renders them where the
family's template puts them. Calls are forced and constrained by the tool's schema, so what
the small model picks on this CPU does not matter.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from .server import Server

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "templates"
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "Get the weather for a city",
                       "parameters": {"type": "object",
                                      "properties": {"city": {"type": "string", "enum": ["Oslo", "Paris", "Rome"]},
                                                     "unit": {"type": "string", "enum": ["C", "F"]}},
                                      "required": ["city", "unit"]}}},
         {"type": "function",
          "function": {"name": "get_time", "description": "The time now",
                       "parameters": {"type": "object", "properties": {}}}}]
MESSAGES = [{"role": "system", "content": "You answer by calling a tool."},
            {"role": "user", "content": "What is the weather in Oslo?"}]
SLACK = 2     # an end-of-turn token the template renders differently from the one sampled


@pytest.fixture(scope="module", params=["hermes", "llama3", "mistral", "mistral_args", "qwen_xml", "glm"])
def family(request):
    env = {"RICORDO_CHAT_TEMPLATE_FILE": str(TEMPLATES / f"{request.param}.jinja"), "RICORDO_CTX_SIZE": "2048"}
    with Server(env=env) as srv:
        yield request.param, srv.client()


def _check_call(name: str, call, args: str) -> None:
    assert call.function.name in ("get_weather", "get_time")
    a = json.loads(args)
    if call.function.name == "get_weather":
        assert set(a) == {"city", "unit"} and a["unit"] in ("C", "F")
    if name.startswith("mistral"):
        assert len(call.id) == 9 and call.id.isalnum(), call.id
    else:
        assert call.id.startswith("call_")


def test_forced_call_and_next_turn_from_the_live_session(family):
    name, client = family
    r1 = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                        max_tokens=60, temperature=0, logprobs=True)
    c = r1.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert c.message.content in (None, "")
    [call] = c.message.tool_calls
    _check_call(name, call, call.function.arguments)
    written = "".join(t.token for t in c.logprobs.content)     # what the model wrote after the opener
    head = '{"name": "' + call.function.name + '", '
    xml = "<function=" + call.function.name + ">\n"
    assert written.startswith({"hermes": head, "llama3": head, "mistral": head, "qwen_xml": xml,
                               "glm": call.function.name + "\n",
                               "mistral_args": call.function.name + "[ARGS]{"}[name]), written
    args = json.loads(call.function.arguments)
    if name == "qwen_xml":     # each value as written: a string without quotes
        assert all(f"<parameter={k}>\n{v}\n</parameter>\n" in written for k, v in args.items()), written
    elif name == "glm":
        assert all(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" in written for k, v in args.items()), written
    elif name == "mistral_args":     # the arguments as written: the JSON the call carries
        assert written.split("[ARGS]", 1)[1].startswith(call.function.arguments), written
    else:
        assert {"hermes": '"arguments": ', "llama3": '"parameters": ', "mistral": '"arguments": '}[name] in written
    for end in ("<|im_end|>", "<|endoftext|>"):                 # the stop token the grammar ends on
        written = written.removesuffix(end)
    assert written.endswith({"hermes": "}\n</tool_call>", "llama3": "}}", "mistral": "}]", "mistral_args": "}",
                             "qwen_xml": "</function>\n</tool_call>", "glm": "</arg_value>\n</tool_call>"}[name]), written
    turn2 = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    r2 = client.chat.completions.create(model="m", messages=turn2, tools=TOOLS, max_tokens=4, temperature=0)
    u1, u2 = r1.usage, r2.usage
    assert u2.prompt_tokens_details.cached_tokens >= u1.prompt_tokens + u1.completion_tokens - SLACK, (u1, u2)


def test_named_call_streamed(family):
    name, client = family
    chunks = list(client.chat.completions.create(
        model="m", messages=MESSAGES, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60, temperature=0, stream=True))
    args, ids, names, finish, arg_chunks = "", set(), set(), None, 0
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        assert len(d.tool_calls or ()) <= 1          # one entry per chunk
        arg_chunks += any(tc.function.arguments for tc in d.tool_calls or ())
        for tc in d.tool_calls or ():
            args += tc.function.arguments or ""
            ids.add(tc.id) if tc.id else None
            names.add(tc.function.name) if tc.function and tc.function.name else None
        assert not d.content, d.content      # the opener in the prompt is never streamed as text
        finish = ch.choices[0].finish_reason or finish
    assert finish == "tool_calls" and names == {"get_weather"} and len(ids) == 1
    # the arguments stream as they are written (XML bodies as their JSON), except Mistral's
    # array, which parses whole
    assert arg_chunks >= 3 if name != "mistral" else arg_chunks == 1, arg_chunks
    call = type("C", (), {"id": ids.pop(), "function": type("F", (), {"name": "get_weather"})})
    _check_call(name, call, args)


def test_calls_sent_back_as_json_render_through_the_family_template(family):
    """A call id this server never gave (another server's, or edited history): the template
    renders the call from its JSON, and the turn is answered."""
    name, client = family
    cid = "abcDEF123" if name.startswith("mistral") else "call_from_elsewhere"
    msgs = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": cid, "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": cid, "content": "12:00"}]
    r = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert r.usage.prompt_tokens > 0


def test_a_real_vocabularys_call_and_next_turn_from_the_live_session():
    """Qwen2.5-Coder-0.5B with its own template: `<tool_call>` and `</tool_call>` are single
    special tokens, and after a forced call the model ends with a token its template renders
    otherwise. The call parses, and the next turn (~300 tokens, under --kv-cache-min-tokens)
    keeps the whole prompt of the session's answer: it is served from the live session up to
    the call's end."""
    with Server(env={"RICORDO_MODEL": "qwen2.5-coder-0.5b", "RICORDO_CTX_SIZE": "2048"}) as srv:
        client = srv.client()
        r1 = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                            max_tokens=60, temperature=0, logprobs=True)
        c = r1.choices[0]
        assert c.finish_reason == "tool_calls", c
        [call] = c.message.tool_calls
        _check_call("hermes", call, call.function.arguments)
        assert "</tool_call>" in [t.token for t in c.logprobs.content]      # the special token, once
        turn2 = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
        r2 = client.chat.completions.create(model="m", messages=turn2, tools=TOOLS, max_tokens=4, temperature=0)
        u1, u2 = r1.usage, r2.usage
        assert u2.prompt_tokens < 512
        assert u2.prompt_tokens_details.cached_tokens >= u1.prompt_tokens + u1.completion_tokens - SLACK, (u1, u2)
