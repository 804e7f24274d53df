"""Qwen3-Coder's XML call bodies (procs/renderer/toolxml.py) without processes: values by
their schema (a string as written, anything else JSON), a value holding the format's own
tags, a call cut at every point, a malformed call skipped, and the grammar that writes what
the family's template renders. The tokenizer is the default model's; no model runs."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from common import messages as m
from procs.inference.guide import Guides
from procs.renderer import grammar, toolxml
from procs.renderer import tools as t
from procs.renderer.prompt import render
from procs.renderer.toolfmt import QWEN_XML

TEMPLATE = (Path(__file__).resolve().parents[2] / "data" / "templates" / "qwen_xml.jinja").read_text()
EDIT = {"type": "object", "properties": {"path": {"type": "string"}, "line": {"type": "integer"},
                                          "code": {"type": "string"}, "flags": {"type": "array", "items": {"type": "string"}},
                                          "dry": {"type": ["boolean", "null"]}},
        "required": ["path", "code"]}
TOOLS = [{"type": "function", "function": {"name": "edit", "parameters": EDIT}},
         {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
STRINGS = toolxml.string_params(TOOLS)
# a file being written that holds the format's own tags, and a string that reads as JSON
HARD = {"path": "12", "line": 3, "code": "x = '</parameter>'\n</parameter>y\nprint('</function>\\n</tool_call>')\n",
        "flags": ["-n", "ü"], "dry": False}


def stream(parser: t.CallParser, text: str, step: int):
    pieces = []
    for k in range(0, len(text), step):
        pieces += parser.push(text[k:k + step])[1]
    return pieces


def test_values_follow_the_schema():
    assert STRINGS == {"edit": frozenset({"path", "code"}), "ls": frozenset()}
    block = QWEN_XML.call_text("edit", json.dumps(HARD))
    assert "<parameter=path>\n12\n</parameter>\n" in block and "<parameter=dry>\nfalse\n</parameter>\n" in block
    [(name, args)], end, more = toolxml.scan(QWEN_XML, block, 0, STRINGS)
    assert name == "edit" and json.loads(args) == HARD and end == len(block) and more
    # without a schema a value is JSON where it parses: "12" becomes a number
    [(_, args)], _, _ = toolxml.scan(QWEN_XML, block, 0, {})
    assert json.loads(args)["path"] == 12


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_calls_stream_out_whole_however_the_text_is_split(step):
    text = "I will edit it.\n" + QWEN_XML.block([("edit", json.dumps(HARD)), ("ls", "{}")])
    p = t.CallParser(fmt=QWEN_XML, strings=STRINGS)
    content, pieces = "", []
    for k in range(0, len(text), step):
        out, got = p.push(text[k:k + step])
        content, pieces = content + out, pieces + got
    assert content == "I will edit it.\n"
    assert [(c[1], json.loads(c[2])) for c in p.calls] == [("edit", HARD), ("ls", {})]
    assert sum(1 for x in pieces if x.name) == 2
    p.push(" Done.")
    assert p.done and p.close_block() == len(text.encode())


def test_a_malformed_call_is_skipped_and_the_block_goes_on():
    good = QWEN_XML.call_text("ls", "{}")
    text = "<tool_call>\n{\"name\": \"ls\"}\n</tool_call>\n" + good
    p = t.CallParser(fmt=QWEN_XML, strings=STRINGS)
    stream(p, text, 1)
    assert [c[1] for c in p.calls] == ["ls"]


def test_a_call_cut_at_every_point_after_its_name():
    block = QWEN_XML.call_text("edit", json.dumps(HARD))
    start = block.index("<function=edit>\n") + len("<function=edit>\n")   # the name is whole
    for cut in range(start, len(block)):
        p = t.CallParser(fmt=QWEN_XML, strings=STRINGS)
        stream(p, block[:cut], 7)
        p.flush()
        if p.calls:                                  # closed: only at the very end
            assert cut >= len(block) - len("\n</tool_call>") and json.loads(p.calls[0][2]) == HARD
            continue
        assert p.cut is not None and p.cut[1] == "edit", cut
        args = json.loads(p.cut[2])
        for k, v in args.items():                    # each value whole, or the text of its beginning
            whole = HARD[k] if k in STRINGS["edit"] else json.dumps(HARD[k], ensure_ascii=False)
            assert v == HARD[k] or (isinstance(v, str) and whole.startswith(v)), (cut, args)


def test_the_grammar_writes_what_the_template_renders(text_model):
    """A forced call: after the prompt's opener the mask admits the rendered call, a value
    holding the tags included, and then only the stop tokens; a value cannot go on past its
    closing; the template renders the parsed arguments back to the same bytes."""
    guides = Guides(text_model)
    c = grammar.Checker(guides.tok).make(TOOLS, "required", None, calls=QWEN_XML)
    block = QWEN_XML.call_text("edit", json.dumps(HARD))
    head = QWEN_XML.opener("required")
    g = guides.start(c)
    for tok in text_model.encode(block[len(head):]):
        mask = g.mask(torch.zeros(text_model.vocab_size))
        assert mask is None or mask[tok] > float("-inf"), text_model.pieces[tok]
        g.advance(tok)
    mask = g.mask(torch.zeros(text_model.vocab_size))
    left = {i for i in range(text_model.vocab_size) if mask[i] > float("-inf")}
    assert left - set(text_model.stop_ids) == {i for i in left if text_model.pieces[i].startswith(b"\n")}
    # a string value ends at its first closing: no text may follow it but a parameter or the end
    g = guides.start(c)
    for tok in text_model.encode("<function=edit>\n<parameter=path>\na\n</parameter>\n"):
        g.advance(tok)
    mask = g.mask(torch.zeros(text_model.vocab_size))
    ok = {text_model.pieces[i] for i in range(text_model.vocab_size) if mask[i] > float("-inf")}
    assert ok and all(b"<".startswith(p[:1]) for p in ok), sorted(ok)[:10]
    # the template renders the parsed call back byte for byte (an id this server never gave)
    [(name, args)], _, _ = toolxml.scan(QWEN_XML, block, 0, STRINGS)
    text = dataclasses.replace(text_model, chat_template=TEMPLATE)
    msgs = (m.ChatMessage(role="user", content="Fix it"),
            m.ChatMessage(role="assistant", content="", tool_calls=(m.ToolCall(
                id="call_x", function=m.ToolCallFunction(name=name, arguments=args)),)),
            m.ChatMessage(role="tool", content="ok", tool_call_id="call_x"))
    req = m.GenerateRequest(rid="r", kind="chat", sampling=m.SamplingParams(), messages=msgs, tools=json.dumps(TOOLS))
    assert block.encode() in render(text, req, t.ToolMemory(16, ""), (), t.Rendered())


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_constrained_call_streams_its_arguments_as_json_while_written(step):
    """Under constraint (grow): the head once the function tag is whole, then the arguments'
    JSON in pieces (a string value as it grows, never the start of its closing), whose
    concatenation is the call's arguments; a limit mid-value sends only the rest."""
    block = QWEN_XML.call_text("edit", json.dumps(HARD))
    p = t.CallParser(fmt=QWEN_XML, strings=STRINGS, grow=True)
    pieces = stream(p, "Sure.\n" + block, step)
    heads = [i for i, x in enumerate(pieces) if x.name]
    args = "".join(x.arguments for x in pieces)
    assert len(heads) == 1 and heads[0] == 0 and args == p.calls[0][2] and json.loads(args) == HARD
    if step == 1:   # (the pieces concatenate to the arguments: a closing never went out as text)
        assert sum(1 for x in pieces if x.arguments) > 40
    for cut in range(block.index("<parameter=code>"), len(block) - 20, 5):
        p = t.CallParser(fmt=QWEN_XML, strings=STRINGS, grow=True)
        sent = "".join(x.arguments for x in stream(p, block[:cut], step))
        p.flush()
        rest = "".join(x.arguments for x in p.cut_pieces() if not x.name)
        assert not any(x.name for x in p.cut_pieces()), cut       # its head went out already
        whole_ = json.loads(sent + rest)
        assert whole_["path"] == "12" and HARD["code"].startswith(whole_.get("code", "")), (cut, sent, rest)
