"""A Harmony chat template (gpt-oss's format, tests/data/templates/harmony.jinja) end to end: the
real processes, the default model, the official `openai` client. No gpt-oss model runs on
this machine (20B); the splitting of a Harmony answer into reasoning, content and calls is
tested on gpt-oss's own text in tests/procs/renderer/test_harmony.py. Here: the template is
recognised (tools rendered by it, not listed in a system message); a forced call (named or
required, opened in the prompt and held by the grammar, whose `<|constrain|>` and
`<|message|>` are text in SmolLM2's vocabulary) comes back as a call and replays as sampled
into the next turn, which the live session serves through it; a response_format answers in
the final channel; a model that writes no Harmony answers in plain content, whole and
streamed alike.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from .server import Server

openai = pytest.importorskip("openai")

TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "templates" / "harmony.jinja"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather for a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
ASK = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    trace = tmp_path_factory.mktemp("harmony") / "trace.log"
    with Server(env={"RICORDO_CHAT_TEMPLATE_FILE": str(TEMPLATE), "RICORDO_CTX_SIZE": "2048",
                     "RICORDO_KV_CACHE_MIN_TOKENS": "8", "RICORDO_TRACE": str(trace)}) as srv:
        yield srv.client(), trace


@pytest.fixture
def client(served):
    return served[0]


@pytest.fixture
def trace(served):
    return served[1]


def test_a_forced_call_comes_back_whole_and_streamed_and_replays_as_sampled(client, trace):
    """A named call (the prompt opens it up to its arguments) and a required one (up to its
    name): a call of the tool, whole and streamed alike; the next turn, with the call and its
    result, renders the answer as sampled and is served from the live session through it."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in (named, "required"):
        r1 = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=choice,
                                            max_tokens=40, temperature=0)
        c = r1.choices[0]
        assert c.finish_reason == "tool_calls", c
        [call] = c.message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        assert set(json.loads(call.function.arguments)) == {"city"}
        stream = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=choice,
                                                max_tokens=40, temperature=0, stream=True)
        parts = [d for ch in stream if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
        assert parts[0].function.name == "get_weather"
        assert "".join(p.function.arguments or "" for p in parts) == call.function.arguments
    turn2 = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                   {"role": "tool", "tool_call_id": call.id, "content": "12 C"}]
    before = trace.read_text() if trace.exists() else ""
    r2 = client.chat.completions.create(model="m", messages=turn2, tools=TOOLS, max_tokens=2, temperature=0)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    # served through the call from a resident session (the tokens whose text the prompt starts
    # with). Which one depends on how the four calls above interleaved: the required call's
    # (all of turn 1 but its last token: SmolLM2 ended with its own stop token where the
    # template renders <|call|>), or the named call's, whose prompt holds the opener as text
    # and whose answer the same arguments: one token further. Both end at the call's `}`.
    n1 = r1.usage.prompt_tokens + r1.usage.completion_tokens
    assert cached in (n1 - 1, n1), (r1.usage, r2.usage)
    assert "1 replayed from memory" in trace.read_text()[len(before):]


def test_a_response_format_is_the_final_channel(client):
    r = client.chat.completions.create(model="m", messages=ASK, max_tokens=40, temperature=0,
                                       response_format={"type": "json_object"})
    c = r.choices[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict), c.message.content
    else:   # the limit cut it: the JSON so far, as content
        assert c.finish_reason == "length" and c.message.content.lstrip().startswith("{")
    assert getattr(c.message, "reasoning_content", None) is None


def test_the_template_renders_the_tools(client):
    """Tools go to the template (its developer message), which writes each one's schema."""
    plain = client.chat.completions.create(model="m", messages=ASK, max_tokens=1, temperature=0)
    with_tools = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="auto",
                                                max_tokens=1, temperature=0)
    extra = with_tools.usage.prompt_tokens - plain.usage.prompt_tokens
    assert extra > 30, (plain.usage, with_tools.usage)       # the namespace, the schema's JSON


def test_an_answer_without_harmony_is_content_whole_and_streamed(client):
    r = client.chat.completions.create(model="m", messages=ASK, max_tokens=12, temperature=0, logprobs=True)
    c = r.choices[0]
    written = "".join(t.token for t in c.logprobs.content)
    if "<|channel|>" in written:
        pytest.fail(f"the model wrote a channel header: {written!r}")
    assert (c.message.content or "") == written.split("<|im_end|>")[0].split("<|endoftext|>")[0]
    assert getattr(c.message, "reasoning_content", None) is None
    stream = client.chat.completions.create(model="m", messages=ASK, max_tokens=12, temperature=0, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == (c.message.content or "")


def test_chat_template_kwargs_change_the_prompt(client):
    """A request's chat_template_kwargs reach the template through the real renderer (here
    the template's reasoning_effort, written into its system message)."""
    plain = client.chat.completions.create(model="m", messages=ASK, max_tokens=1, temperature=0)
    longer = client.chat.completions.create(
        model="m", messages=ASK, max_tokens=1, temperature=0,
        extra_body={"chat_template_kwargs": {"reasoning_effort": "as careful as a proof, every step written out"}})
    assert longer.usage.prompt_tokens >= plain.usage.prompt_tokens + 8, (plain.usage, longer.usage)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=ASK, max_tokens=1,
                                       extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
