"""A Harmony chat template (gpt-oss's format, tests/data/templates/harmony.jinja) end to end: the
real processes, the default model, the official `openai` client. No gpt-oss model runs on
this machine (20B); the splitting of a Harmony answer into reasoning, content and calls is
tested on gpt-oss's own text in tests/procs/renderer/test_harmony.py. Here: the template is
recognised (tools rendered by it, not listed in a system message), calls are never
constrained (tool_choice required, a named function and response_format are refused in
OpenAI's shape, and the server goes on), and a model that writes no Harmony (SmolLM2 here)
answers in plain content, whole and streamed alike.
"""
from __future__ import annotations

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
def client():
    with Server(env={"RICORDO_CHAT_TEMPLATE_FILE": str(TEMPLATE), "RICORDO_CTX_SIZE": "2048"}) as srv:
        yield srv.client()


def test_forced_calls_and_formats_are_refused_and_the_server_goes_on(client):
    for extra, param in ((dict(tools=TOOLS, tool_choice="required"), "tool_choice"),
                         (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                          "tool_choice"),
                         (dict(response_format={"type": "json_object"}), "response_format")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=ASK, max_tokens=4, **extra)
        assert e.value.body["param"] == param and "Harmony" in e.value.body["message"], e.value.body
    r = client.chat.completions.create(model="m", messages=ASK, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


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
