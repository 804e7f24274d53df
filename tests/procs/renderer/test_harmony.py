"""Harmony answers (gpt-oss) split into reasoning, content and calls (procs/renderer/harmony.py),
the template's format recognised, the stop tokens a Harmony vocabulary gets, and the chat
shapes that carry the reasoning. The answers are written as gpt-oss writes them (OpenAI's
Harmony format: header, <|message|>, body, <|end|> between messages; <|return|> and <|call|>
are stop tokens, never in the text)."""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from common import messages as m
from procs.frontend.shape import Chunks, Collected, chat_completion
from procs.renderer import harmony, toolfmt

TEMPLATE = (Path(__file__).resolve().parents[2] / "data" / "templates" / "harmony.jinja").read_text()
THINK = "<|channel|>analysis<|message|>The user wants the weather; call get_weather.<|end|>"
CALL_A = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}'
CALL_B = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Oslo"}'
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 12 C in Oslo."
SPECIAL = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>")


def _tokens(text: str) -> list[str]:
    """The text as a Harmony model's tokens arrive: special tokens whole, the rest in short
    pieces."""
    out, i = [], 0
    while i < len(text):
        sp = next((s for s in SPECIAL if text.startswith(s, i)), None)
        out.append(sp or text[i:i + 3])
        i += len(out[-1])
    return out


def _run(pieces) -> tuple[str, str, list[m.ToolCallDelta], harmony.Channels]:
    ids = (f"call_{i}" for i in itertools.count())
    ch = harmony.Channels(lambda: next(ids))
    r, c, calls = [], [], []
    for piece in pieces:
        a, b, p = ch.push(piece)
        r.append(a), c.append(b), calls.extend(p)
    a, b, p = ch.flush()
    r.append(a), c.append(b), calls.extend(p)
    return "".join(r), "".join(c), calls, ch


@pytest.mark.parametrize("feed", ["whole", "tokens", "chars"])
def test_reasoning_then_answer(feed):
    text = THINK + FINAL
    pieces = {"whole": [text], "tokens": _tokens(text), "chars": list(text)}[feed]
    reasoning, content, calls, _ = _run(pieces)
    assert reasoning == "The user wants the weather; call get_weather."
    assert content == "It is 12 C in Oslo."
    assert calls == []


@pytest.mark.parametrize("call", [CALL_A, CALL_B], ids=["channel-first", "recipient-first"])
@pytest.mark.parametrize("feed", ["tokens", "chars"])
def test_a_call_in_either_header_order(call, feed):
    text = THINK + call
    reasoning, content, pieces, ch = _run(_tokens(text) if feed == "tokens" else list(text))
    assert reasoning.startswith("The user wants") and content == ""
    assert pieces[0] == m.ToolCallDelta(index=0, id="call_0", name="get_weather", arguments="")
    assert "".join(p.arguments for p in pieces) == '{"city":"Oslo"}'
    assert all(p.index == 0 for p in pieces) and not any(p.id for p in pieces[1:])
    assert ch.calls == [["call_0", "get_weather", '{"city":"Oslo"}']]


def test_a_preamble_is_content_and_calls_are_numbered():
    text = ("<|channel|>commentary<|message|>Checking two cities.<|end|>"
            + CALL_A + "<|end|>" + CALL_B.replace("Oslo", "Rome"))
    reasoning, content, pieces, ch = _run(_tokens(text))
    assert reasoning == "" and content == "Checking two cities."
    assert [c[1:] for c in ch.calls] == [["get_weather", '{"city":"Oslo"}'], ["get_weather", '{"city":"Rome"}']]
    assert [p.index for p in pieces if p.id] == [0, 1]


def test_a_body_cut_by_the_limit_and_a_partial_end_marker():
    reasoning, content, _, _ = _run(_tokens("<|channel|>analysis<|message|>Thinking about <|en"))
    assert reasoning == "Thinking about <|en"      # not an end marker after all: the text itself
    _, content, _, ch = _run(_tokens("<|channel|>final<|message|>Half an ans"))
    assert content == "Half an ans"
    _, content, _, _ = _run(_tokens("<|channel|>fin"))   # a header never finished carries nothing
    assert content == ""


def test_a_model_that_writes_no_harmony_answers_in_content():
    """A Harmony template given to another model: its plain text is the content."""
    _, content, calls, _ = _run(list("Hello there, how can I help?"))
    assert content == "Hello there, how can I help?" and calls == []


def test_the_format_is_recognised_and_auto_is_the_models_own():
    assert harmony.detect(TEMPLATE) and toolfmt.detect(TEMPLATE) is toolfmt.HARMONY
    assert toolfmt.HARMONY.native and harmony.opener("auto", False) == ""
    for other in ("hermes", "llama3", "mistral", "qwen_xml"):
        src = (Path(__file__).resolve().parents[2] / "data" / "templates" / f"{other}.jinja").read_text()
        assert not harmony.detect(src) and toolfmt.detect(src) is not toolfmt.HARMONY


def _vocab_model(tmp_path, extra: list[str]):
    gguf = pytest.importorskip("gguf")
    from common.models import load_text
    from common.tokenizer import _byte_decoder
    chars = sorted(_byte_decoder(), key=_byte_decoder().get)
    tokens = chars + extra
    path = str(tmp_path / f"v{len(extra)}.gguf")
    w = gguf.GGUFWriter(path, "gpt-oss")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(chars) + [3] * len(extra))
    w.add_token_merges([])
    w.add_eos_token_id(len(chars) + extra.index("<|return|>") if "<|return|>" in extra else len(chars))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return load_text(path), len(chars)


def test_a_harmony_vocabulary_stops_at_return_and_call_not_end(tmp_path):
    """<|end|> closes one message of several (the reasoning before the answer): with both
    <|return|> and <|call|> in the vocabulary it is no stop token (llama.cpp's rule); a
    vocabulary without them (Phi-3's) keeps <|end|> as its end of turn."""
    names = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>"]
    text, base = _vocab_model(tmp_path, names)
    ids = {n: base + i for i, n in enumerate(names)}
    assert {ids["<|return|>"], ids["<|call|>"]} <= text.stop_ids and ids["<|end|>"] not in text.stop_ids
    phi, base = _vocab_model(tmp_path, ["<|end|>", "<|endoftext|>"])
    assert base in phi.stop_ids


def test_chat_shapes_carry_the_reasoning():
    col = Collected(legacy=False)
    for ev in (m.Delta(rid="r", reasoning="thinking "), m.Delta(rid="r", reasoning="more"),
               m.Delta(rid="r", text="Answer.")):
        col.add(ev, False)
    u = m.Usage(prompt_tokens=3, completion_tokens=3, cached_tokens=0)
    msg = chat_completion("c", 0, "m", col, False, "stop", u)["choices"][0]["message"]
    assert msg["reasoning_content"] == "thinking more" and msg["content"] == "Answer."
    plain = Collected(legacy=False)
    plain.add(m.Delta(rid="r", text="x"), False)
    assert "reasoning_content" not in chat_completion("c", 0, "m", plain, False, "stop", u)["choices"][0]["message"]
    ch = Chunks("chat", "c", 0, "m", False, False)
    [chunk] = ch.delta(m.Delta(rid="r", reasoning="hm"))
    assert chunk["choices"][0]["delta"] == {"reasoning_content": "hm"}
    [chunk] = ch.delta(m.Delta(rid="r", text="ok"))
    assert chunk["choices"][0]["delta"] == {"content": "ok"}
    assert json.dumps(chunk)


def _conversation(call_id: str):
    msgs = (m.ChatMessage(role="user", content="Weather in Oslo?"),
            m.ChatMessage(role="assistant", content="", tool_calls=(m.ToolCall(
                id=call_id, function=m.ToolCallFunction(name="get_weather", arguments='{"city":"Oslo"}')),)),
            m.ChatMessage(role="tool", content="12 C", tool_call_id=call_id))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    return m.GenerateRequest(rid="r", kind="chat", sampling=m.SamplingParams(), messages=msgs,
                             tools=json.dumps(tools))


def test_a_remembered_call_replays_the_answer_as_sampled(text_model):
    """The next turn's prompt holds the answer exactly as generated (its reasoning, its
    header in the model's order, its compact JSON, the <|call|> that ended it) in the place
    of the template's rendering of that call: the live session stays a prefix. An id not
    remembered renders from JSON through the template."""
    import dataclasses
    from procs.renderer import tools as t
    from procs.renderer.prompt import render
    text = dataclasses.replace(text_model, chat_template=TEMPLATE)
    _, _, _, ch = _run(_tokens(THINK + CALL_A))
    ch.stop = "<|call|>"
    block = ch.block()
    assert block == THINK + CALL_A + "<|call|>"
    memory = t.ToolMemory(16, "")
    memory.remember([ch.calls[0][0]], block.encode())
    stats = t.Rendered()
    prompt = render(text, _conversation(ch.calls[0][0]), memory, (), stats).decode()
    assert "<|start|>user<|message|>Weather in Oslo?<|end|><|start|>assistant" + block + \
        "<|start|>functions.get_weather to=assistant" in prompt, prompt
    assert "ricordo-replay" not in prompt and stats.memory == 1
    stats = t.Rendered()
    unknown = render(text, _conversation("call_unknown"), memory, (), stats).decode()
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}'
            '<|call|>') in unknown and stats.json == 1
    _, _, _, final = _run(_tokens(THINK + FINAL))
    final.stop = "<|return|>"
    assert final.block() is None           # an answer that did not end in a call is not remembered
    _, _, _, cut = _run(_tokens(THINK + CALL_A[:-3]))
    assert cut.block() is None             # nor one the token limit cut (no stop token)


def test_the_reasoning_effort_reaches_the_template(text_model):
    import dataclasses
    from procs.renderer.prompt import render
    text = dataclasses.replace(text_model, chat_template=TEMPLATE)
    ask = (m.ChatMessage(role="user", content="hi"),)
    for effort, want in (("high", "Reasoning: high"), ("", "Reasoning: medium")):
        req = m.GenerateRequest(rid="r", kind="chat", sampling=m.SamplingParams(), messages=ask,
                                reasoning_effort=effort)
        assert want in render(text, req).decode()


def test_template_variables_from_the_server_and_the_request(text_model):
    """--chat-template-kwargs for every request, a request's chat_template_kwargs laid over
    them, reasoning_effort over both; the renderer's own variables cannot be replaced."""
    import dataclasses
    from common.tokenizer import template_kwargs
    from procs.renderer.prompt import render
    text = dataclasses.replace(text_model, chat_template=TEMPLATE,
                               template_kwargs=template_kwargs('{"reasoning_effort": "low"}', "x"))
    ask = (m.ChatMessage(role="user", content="hi"),)

    def effort(**kw):
        req = m.GenerateRequest(rid="r", kind="chat", sampling=m.SamplingParams(), messages=ask, **kw)
        out = render(text, req).decode()
        return out[out.index("Reasoning: ") + 11:].split("\n")[0]
    assert effort() == "low"
    assert effort(template_kwargs='{"reasoning_effort": "high"}') == "high"
    assert effort(template_kwargs='{"reasoning_effort": "high"}', reasoning_effort="minimal") == "minimal"
    for bad, says in (("[1]", "JSON object"), ("{", "not JSON"), ('{"messages": []}', "set by the server")):
        with pytest.raises(ValueError, match=says):
            template_kwargs(bad, "--chat-template-kwargs")


def test_a_forced_call_is_opened_in_the_prompt_and_its_head_sent_first():
    """A named call: the prompt ends at its arguments; the parser, told so, sends the call's
    head with the first piece and the arguments as they come; the replayed block holds the
    opener (the prompt's part of the message) too."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    opened = harmony.opener(named, False)
    assert opened == "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    assert harmony.opener("required", True) == "<|channel|>commentary to=functions."
    assert harmony.opener("auto", True) == "<|channel|>final<|message|>"
    ch = harmony.Channels(lambda: "call_1", opened)
    r, c, pieces = ch.push('{"city":')
    assert pieces[0] == m.ToolCallDelta(index=0, id="call_1", name="get_weather") and pieces[1].arguments == '{"city":'
    ch.push('"Oslo"}')
    ch.stop = "<|im_end|>"         # a model without Harmony's tokens: its own stop token
    assert ch.block() == opened + '{"city":"Oslo"}<|call|>'
    final = harmony.Channels(lambda: "x", harmony.opener("auto", True))
    assert final.push('{"a": 1}')[1] == '{"a": 1}'


def test_forced_calls_take_the_special_tokens_where_the_vocabulary_has_them(tmp_path):
    """`<|constrain|>` and `<|message|>` are the model's special tokens in a Harmony vocabulary
    (llguidance matches a special token only by its own syntax) and text in another; the
    grammar after a `required` opener accepts the name, the header and the JSON."""
    import llguidance
    from common import guidance
    from procs.renderer import grammar
    names = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
    text, base = _vocab_model(tmp_path, names)
    specials = frozenset(names)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    c = grammar.build(tools, "required", None, calls=toolfmt.HARMONY, specials=specials)
    assert "<|constrain|>" in c.grammar and '"<|constrain|>"' not in c.grammar
    plain = grammar.build(tools, "required", None, calls=toolfmt.HARMONY)
    assert '"<|constrain|>"' in plain.grammar
    tok = guidance.tokenizer(text)
    mt = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_lark(c.grammar), log_level=0)
    assert not mt.is_error(), mt.get_error()
    for t in text.encode(b'get_weather <|constrain|>json<|message|>{"city": "Oslo"}'):
        assert mt.consume_token(t), text.pieces[t]
    assert mt.is_accepting()
    assert grammar.build(tools, "auto", None, calls=toolfmt.HARMONY) is None      # the model's own calls
    fmt = grammar.build([], "none", {"type": "json_object"}, calls=toolfmt.HARMONY)
    assert fmt.grammar.startswith("start: fmt")
