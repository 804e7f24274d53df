"""Rendering a chat prompt that continues the last assistant message (Anthropic's prefill,
vLLM's continue_final_message), with the default model's own template: no model runs."""
from __future__ import annotations

import pytest

from common import messages as m
from procs.renderer.prompt import PromptError, render

CONV = (m.ChatMessage(role="user", content="What is the capital of France?"),
        m.ChatMessage(role="assistant", content="The capital of France is"))


def req(msgs, **kw) -> m.GenerateRequest:
    return m.GenerateRequest(rid="r", kind="chat", sampling=m.SamplingParams(), messages=tuple(msgs), **kw)


def test_a_continued_message_ends_the_prompt(text_model):
    finished = render(text_model, req(CONV))
    cont = render(text_model, req(CONV, continue_final=True))
    assert cont.endswith(b"The capital of France is")
    # the finished rendering, cut after the text: no end of turn, no new assistant header
    assert finished.startswith(cont) and len(finished) > len(cont)
    assert finished[len(cont):].count(b"assistant") == 1
    # the same prompt as the template rendered without the last turn's end
    before = render(text_model, req(CONV[:1]))
    assert cont.startswith(before) and cont[len(before):] == b"The capital of France is"


def test_what_cannot_be_continued(text_model):
    with pytest.raises(PromptError) as e:
        render(text_model, req(CONV[:1], continue_final=True))
    assert e.value.param == "messages"
    tools = '[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]'
    with pytest.raises(PromptError) as e:
        render(text_model, req(CONV, continue_final=True, tools=tools, tool_choice='"required"'))
    assert e.value.param == "tool_choice"
    # auto tools: the prefill is continued, no call opener after it
    assert render(text_model, req(CONV, continue_final=True, tools=tools)).endswith(b"France is")


@pytest.mark.parametrize("prefill", ["<", ">", "im", "end", "|", "a  "])
def test_a_prefill_found_in_the_end_of_turn_marker_still_ends_the_prompt(text_model, prefill):
    """ChatML's `<|im_end|>` holds `<`, `>`, `im`, `end` and `|`: the prompt is cut after the
    message's own text, not inside the marker (trailing spaces kept as the client wrote them)."""
    cont = render(text_model, req([CONV[0], m.ChatMessage(role="assistant", content=prefill)], continue_final=True))
    before = render(text_model, req(CONV[:1]))
    assert cont == before + prefill.encode()


def test_a_constrained_answer_cannot_continue(text_model):
    with pytest.raises(PromptError) as e:
        render(text_model, req(CONV, continue_final=True, response_format='{"type": "json_object"}'))
    assert e.value.param == "response_format"
    tools = '[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]'
    opened = (CONV[0], m.ChatMessage(role="assistant", content='<tool_call>\n{"name": "f", "arguments": {'))
    with pytest.raises(PromptError):
        render(text_model, req(opened, continue_final=True, tools=tools))
