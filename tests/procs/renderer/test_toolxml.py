"""XML call bodies (procs/renderer/toolxml.py) without processes, in each format that writes
them: Qwen3-Coder's `<function=`/`<parameter=`, Seed-OSS's in `<seed:tool_call>`, GLM-4.5's
`<arg_key>`/`<arg_value>` pairs and GLM-4.7's compact ones. Per format: read from its template, a call rendered as the
template renders it, values by their schema (a string as written, anything else JSON), a
value holding the format's own tags, calls streamed however the text is split, a call cut at
every point, a malformed call skipped, and the grammar that writes what the family's template
renders. The tokenizer is the default model's; no model runs."""
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
from procs.renderer.toolfmt import GLM, GLM_COMPACT, QWEN_XML, SEED

_DIR = Path(__file__).resolve().parents[2] / "data" / "templates"
_GLM45 = (_DIR / "glm.jinja").read_text()
TEMPLATES = {   # GLM-4.7's shape: GLM-4.5's without the newlines around keys and values
    "qwen_xml": (_DIR / "qwen_xml.jinja").read_text(), "glm": _GLM45,
    "glm_compact": _GLM45.replace("'<tool_call>' + tc.name + '\\n'", "'<tool_call>' + tc.name")
    .replace("'</arg_key>\\n<arg_value>'", "'</arg_key><arg_value>'").replace("'</arg_value>\\n'", "'</arg_value>'"),
    # Seed-OSS's shape: Qwen3-Coder's in <seed:tool_call>, no newlines around a value
    "seed_xml": (_DIR / "qwen_xml.jinja").read_text().replace("<tool_call>", "<seed:tool_call>")
    .replace("</tool_call>", "</seed:tool_call>").replace("'<parameter=' + args_name + '>\\n'", "'<parameter=' + args_name + '>'")
    .replace("'\\n</parameter>\\n'", "'</parameter>\\n'")}
EDIT = {"type": "object", "properties": {"path": {"type": "string"}, "line": {"type": "integer"},
                                          "code": {"type": "string"}, "flags": {"type": "array", "items": {"type": "string"}},
                                          "dry": {"type": ["boolean", "null"]}},
        "required": ["path", "code"]}
TOOLS = [{"type": "function", "function": {"name": "edit", "parameters": EDIT}},
         {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
STRINGS = toolxml.string_params(TOOLS)
# a file being written that holds the format's own tags (all but a value's own closing),
# and a string that reads as JSON
def _hard(code: str) -> dict:   # in the schema's order, as the grammar writes parameters
    return {"path": "12", "line": 3, "code": code, "flags": ["-n", "ü"], "dry": False}


HARD = {"qwen_xml": _hard("x = '</parameter>'\n</parameter>y\nprint('</function>\\n</tool_call>')\n"),
        "glm": _hard("x = '</tool_call>'\n<arg_key>y</arg_key>\n<arg_value>z</arg_value>w\n"),
        "glm_compact": _hard("x = '</tool_call>'\n<arg_key>y</arg_key>\n<arg_value>z</arg_value\n"),
        "seed_xml": _hard("x = '</parameter>'\n</parameter>y\nprint('</function>\\n</seed:tool_call>')\n")}


@pytest.fixture(params=[QWEN_XML, SEED, GLM, GLM_COMPACT], ids=lambda f: f.name)
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


def test_values_follow_the_schema_and_render_as_the_template_does(text_model, fmt):
    hard = HARD[fmt.name]
    assert toolfmt.detect(TEMPLATES[fmt.name]) == fmt
    assert STRINGS == {"edit": frozenset({"path", "code"}), "ls": frozenset()}
    block = fmt.call_text("edit", json.dumps(hard))
    want = {"qwen_xml": ["<function=edit>\n<parameter=path>\n12\n</parameter>\n", "<parameter=dry>\nfalse\n</parameter>\n"],
            "glm": ["<tool_call>edit\n<arg_key>path</arg_key>\n<arg_value>12</arg_value>\n",
                    "<arg_key>dry</arg_key>\n<arg_value>false</arg_value>\n</tool_call>"],
            "seed_xml": ["<seed:tool_call>\n<function=edit>\n<parameter=path>12</parameter>\n",
                         "<parameter=dry>false</parameter>\n</function>\n</seed:tool_call>"],
            "glm_compact": ["<tool_call>edit<arg_key>path</arg_key><arg_value>12</arg_value><arg_key>line",
                            "<arg_key>dry</arg_key><arg_value>false</arg_value></tool_call>"]}[fmt.name]
    assert all(w in block for w in want), block
    assert block in _rendered(text_model, fmt, "edit", json.dumps(hard))
    [(name, args)], end, more = toolxml.scan(fmt, block, 0, STRINGS)
    assert name == "edit" and json.loads(args) == hard and end == len(block) and more
    # without a schema a value is JSON where it parses: "12" becomes a number
    [(_, args)], _, _ = toolxml.scan(fmt, block, 0, {})
    assert json.loads(args)["path"] == 12
    assert toolxml.scan(fmt, fmt.call_text("ls", "{}"), 0, STRINGS)[0] == [("ls", "{}")]


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_calls_stream_out_whole_however_the_text_is_split(fmt, step):
    hard = HARD[fmt.name]
    text = "I will edit it.\n" + fmt.block([("edit", json.dumps(hard)), ("ls", "{}")])
    p = t.CallParser(fmt=fmt, strings=STRINGS)
    content, pieces = "", []
    for k in range(0, len(text), step):
        out, got = p.push(text[k:k + step])
        content, pieces = content + out, pieces + got
    assert content == "I will edit it.\n"
    assert [(c[1], json.loads(c[2])) for c in p.calls] == [("edit", hard), ("ls", {})]
    assert sum(1 for x in pieces if x.name) == 2
    p.push(" Done.")
    assert p.done and p.close_block() == len(text.encode())


def test_a_malformed_call_is_skipped_and_the_block_goes_on(fmt):
    text = "<tool_call>\n{\"name\": \"ls\"}\n</tool_call>\n" + fmt.call_text("ls", "{}")
    p = t.CallParser(fmt=fmt, strings=STRINGS)
    stream(p, text, 1)
    assert [c[1] for c in p.calls] == ["ls"]


def test_a_call_cut_at_every_point_after_its_name(fmt):
    hard = HARD[fmt.name]
    block = fmt.call_text("edit", json.dumps(hard))
    # the name is whole after its closing, or (no closing: GLM-4.7) once what follows begins
    start = len(fmt.head_pre + fmt.name_part("edit")) + (not fmt.name_close)
    for cut in range(start, len(block)):
        p = t.CallParser(fmt=fmt, strings=STRINGS)
        stream(p, block[:cut], 7)
        p.flush()
        if p.calls:                                  # closed: only after the last value's end
            assert cut >= len(block) - len(fmt.tail) + len(fmt.fn_close) and json.loads(p.calls[0][2]) == hard
            continue
        assert p.cut is not None and p.cut[1] == "edit", cut
        args = json.loads(p.cut[2])
        for k, v in args.items():                    # each value whole, or the text of its beginning
            whole = hard[k] if k in STRINGS["edit"] else json.dumps(hard[k], ensure_ascii=False)
            assert v == hard[k] or (isinstance(v, str) and whole.startswith(v)), (cut, args)


def test_the_grammar_writes_what_the_template_renders(text_model, fmt):
    """A forced call: after the prompt's opener the mask admits the rendered call, a value
    holding the tags included, and then only the stop tokens; a value cannot go on past its
    closing; the template renders the parsed arguments back to the same bytes."""
    hard = HARD[fmt.name]
    guides = Guides(text_model)
    c = grammar.Checker(guides.tok).make(TOOLS, "required", None, calls=fmt)
    block = fmt.call_text("edit", json.dumps(hard))
    head = fmt.opener("required")
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
    for tok in text_model.encode(fmt.name_part("edit") + fmt.key_open + "path" + fmt.key_close + fmt.value_open
                                 + "a" + fmt.value_close):
        g.advance(tok)
    mask = g.mask(torch.zeros(text_model.vocab_size))
    ok = {text_model.pieces[i] for i in range(text_model.vocab_size) if mask[i] > float("-inf")}
    assert ok and all(b"<".startswith(p[:1]) for p in ok), sorted(ok)[:10]
    # the template renders the parsed call back byte for byte (an id this server never gave)
    [(name, args)], _, _ = toolxml.scan(fmt, block, 0, STRINGS)
    assert block in _rendered(text_model, fmt, name, args)


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_constrained_call_streams_its_arguments_as_json_while_written(fmt, step):
    """Under constraint (grow): the head once the function tag is whole, then the arguments'
    JSON in pieces (a string value as it grows, never the start of its closing), whose
    concatenation is the call's arguments; a limit mid-value sends only the rest."""
    hard = HARD[fmt.name]
    block = fmt.call_text("edit", json.dumps(hard))
    p = t.CallParser(fmt=fmt, strings=STRINGS, grow=True)
    pieces = stream(p, "Sure.\n" + block, step)
    heads = [i for i, x in enumerate(pieces) if x.name]
    args = "".join(x.arguments for x in pieces)
    assert len(heads) == 1 and heads[0] == 0 and args == p.calls[0][2] and json.loads(args) == hard
    if step == 1:   # (the pieces concatenate to the arguments: a closing never went out as text)
        assert sum(1 for x in pieces if x.arguments) > 40
    for cut in range(block.index(fmt.key_open + "code"), len(block) - 20, 5):
        p = t.CallParser(fmt=fmt, strings=STRINGS, grow=True)
        sent = "".join(x.arguments for x in stream(p, block[:cut], step))
        p.flush()
        rest = "".join(x.arguments for x in p.cut_pieces() if not x.name)
        assert not any(x.name for x in p.cut_pieces()), cut       # its head went out already
        whole_ = json.loads(sent + rest)
        assert whole_["path"] == "12" and hard["code"].startswith(whole_.get("code", "")), (cut, sent, rest)
