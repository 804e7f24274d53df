"""GLM's call bodies (toolfmt.GLM for GLM-4.5/4.6, GLM_COMPACT for GLM-4.7 on) through the XML
call code (procs/renderer/toolxml.py) without processes: the format read from the template, a
call rendered as the template renders it, values by their schema, a value holding the format's
own tags, calls streamed however the text is split, a call cut at every point, a malformed call
skipped, and the grammar that writes what the template renders. The tokenizer is the default
model's; no model runs."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from common import messages as m
from procs.inference.guide import Guides
from procs.renderer import grammar, toolfmt, toolxml
from procs.renderer import tools as t
from procs.renderer.prompt import render
from procs.renderer.toolfmt import GLM, GLM_COMPACT

GLM45 = (Path(__file__).resolve().parents[2] / "data" / "templates" / "glm.jinja").read_text()
# GLM-4.7's shape: no newlines around keys and values
GLM47 = GLM45.replace("'<tool_call>' + tc.name + '\\n'", "'<tool_call>' + tc.name") \
    .replace("'</arg_key>\\n<arg_value>'", "'</arg_key><arg_value>'").replace("'</arg_value>\\n'", "'</arg_value>'")
TEMPLATES = {"glm": GLM45, "glm_compact": GLM47}
EDIT = {"type": "object", "properties": {"path": {"type": "string"}, "line": {"type": "integer"},
                                          "code": {"type": "string"}, "flags": {"type": "array", "items": {"type": "string"}},
                                          "dry": {"type": ["boolean", "null"]}},
        "required": ["path", "code"]}
TOOLS = [{"type": "function", "function": {"name": "edit", "parameters": EDIT}},
         {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
STRINGS = toolxml.string_params(TOOLS)
# a file being written that holds the format's tags (but a value's own closing), and a
# string that reads as JSON
HARD = {"path": "12", "line": 3, "code": "x = '</tool_call>'\n<arg_key>y</arg_key>\n<arg_value>z</arg_value\n",
        "flags": ["-n", "ü"], "dry": False}


@pytest.fixture(params=[GLM, GLM_COMPACT], ids=["glm", "glm_compact"])
def fmt(request):
    return request.param


def stream(parser: t.CallParser, text: str, step: int):
    pieces = []
    for k in range(0, len(text), step):
        pieces += parser.push(text[k:k + step])[1]
    return pieces


def _rendered(text_model, fmt, name: str, args: str) -> str:
    """The template's rendering of a call sent back as JSON (an id this server never gave)."""
    text = dataclasses.replace(text_model, chat_template=TEMPLATES[fmt.name])
    msgs = (m.ChatMessage(role="user", content="Fix it"),
            m.ChatMessage(role="assistant", content="", tool_calls=(m.ToolCall(
                id="call_x", function=m.ToolCallFunction(name=name, arguments=args)),)),
            m.ChatMessage(role="tool", content="ok", tool_call_id="call_x"))
    req = m.GenerateRequest(rid="r", kind="chat", sampling=m.SamplingParams(), messages=msgs, tools=json.dumps(TOOLS))
    return render(text, req, t.ToolMemory(16, ""), (), t.Rendered()).decode()


def test_the_format_is_read_from_the_template_and_renders_as_it(text_model, fmt):
    assert toolfmt.detect(TEMPLATES[fmt.name]) == fmt
    block = fmt.call_text("edit", json.dumps(HARD))
    want = "<tool_call>edit\n<arg_key>path</arg_key>\n<arg_value>12</arg_value>\n" if fmt is GLM else \
        "<tool_call>edit<arg_key>path</arg_key><arg_value>12</arg_value><arg_key>line"
    assert block.startswith(want), block
    assert block in _rendered(text_model, fmt, "edit", json.dumps(HARD))
    [(name, args)], end, more = toolxml.scan(fmt, block, 0, STRINGS)
    assert name == "edit" and json.loads(args) == HARD and end == len(block) and more
    [(_, args)], _, _ = toolxml.scan(fmt, block, 0, {})    # without a schema "12" is JSON
    assert json.loads(args)["path"] == 12
    assert toolxml.scan(fmt, fmt.call_text("ls", "{}"), 0, STRINGS)[0] == [("ls", "{}")]


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_calls_stream_out_whole_however_the_text_is_split(fmt, step):
    text = "I will edit it.\n" + fmt.block([("edit", json.dumps(HARD)), ("ls", "{}")])
    p = t.CallParser(fmt=fmt, strings=STRINGS)
    content, pieces = "", []
    for k in range(0, len(text), step):
        out, got = p.push(text[k:k + step])
        content, pieces = content + out, pieces + got
    assert content == "I will edit it.\n"
    assert [(c[1], json.loads(c[2])) for c in p.calls] == [("edit", HARD), ("ls", {})]
    assert sum(1 for x in pieces if x.name) == 2
    p.push(" Done.")
    assert p.done and p.close_block() == len(text.encode())


def test_a_malformed_call_is_skipped_and_the_block_goes_on(fmt):
    text = "<tool_call>\n{\"name\": \"ls\"}\n</tool_call>\n" + fmt.call_text("ls", "{}")
    p = t.CallParser(fmt=fmt, strings=STRINGS)
    stream(p, text, 1)
    assert [c[1] for c in p.calls] == ["ls"]


def test_a_call_cut_at_every_point_after_its_name(fmt):
    block = fmt.call_text("edit", json.dumps(HARD))
    start = len("<tool_call>edit<")         # the name is whole once what follows it begins
    for cut in range(start, len(block)):
        p = t.CallParser(fmt=fmt, strings=STRINGS)
        stream(p, block[:cut], 7)
        p.flush()
        if p.calls:                                  # closed: only at the very end
            assert cut >= len(block) - len("</tool_call>") and json.loads(p.calls[0][2]) == HARD
            continue
        assert p.cut is not None and p.cut[1] == "edit", cut
        args = json.loads(p.cut[2])
        for k, v in args.items():                    # each value whole, or the text of its beginning
            whole = HARD[k] if k in STRINGS["edit"] else json.dumps(HARD[k], ensure_ascii=False)
            assert v == HARD[k] or (isinstance(v, str) and whole.startswith(v)), (cut, args)


def test_the_grammar_writes_what_the_template_renders(text_model, fmt):
    """A forced call: after the prompt's opener the mask admits the rendered call, a value
    holding the tags included, and then only the stop tokens; a string value cannot go on
    past its closing; the template renders the parsed arguments back to the same bytes."""
    guides = Guides(text_model)
    c = grammar.Checker(guides.tok).make(TOOLS, "required", None, calls=fmt)
    block = fmt.call_text("edit", json.dumps(HARD))
    head = fmt.opener("required")
    assert head == "<tool_call>"
    g = guides.start(c)
    for tok in text_model.encode(block[len(head):]):
        mask = g.mask(torch.zeros(text_model.vocab_size))
        assert mask is None or mask[tok] > float("-inf"), text_model.pieces[tok]
        g.advance(tok)
    mask = g.mask(torch.zeros(text_model.vocab_size))
    left = {i for i in range(text_model.vocab_size) if mask[i] > float("-inf")}
    assert left - set(text_model.stop_ids) == {i for i in left if text_model.pieces[i].startswith(b"\n")}
    g = guides.start(c)
    for tok in text_model.encode("edit" + fmt.name_close + "<arg_key>path</arg_key>" + fmt.value_open + "a" +
                                 fmt.value_close):
        g.advance(tok)
    mask = g.mask(torch.zeros(text_model.vocab_size))
    ok = {text_model.pieces[i] for i in range(text_model.vocab_size) if mask[i] > float("-inf")}
    assert ok and all(b"<".startswith(p[:1]) for p in ok), sorted(ok)[:10]
    [(name, args)], _, _ = toolxml.scan(fmt, block, 0, STRINGS)
    assert block in _rendered(text_model, fmt, name, args)


@pytest.mark.parametrize("step", [1, 5])
def test_a_constrained_call_streams_its_arguments_as_json_while_written(fmt, step):
    block = fmt.call_text("edit", json.dumps(HARD))
    p = t.CallParser(fmt=fmt, strings=STRINGS, grow=True)
    pieces = stream(p, "Sure.\n" + block, step)
    heads = [i for i, x in enumerate(pieces) if x.name]
    args = "".join(x.arguments for x in pieces)
    assert len(heads) == 1 and heads[0] == 0 and args == p.calls[0][2] and json.loads(args) == HARD
    if step == 1:
        assert sum(1 for x in pieces if x.arguments) > 40
