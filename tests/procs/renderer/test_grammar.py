"""Grammars and token masks, without processes: the default model's real vocabulary, token
sequences written here (no model run), so nothing depends on a CPU's rounding."""
from __future__ import annotations

import json

import pytest
import torch

from common import messages as m
from procs.inference.guide import Guides
from procs.renderer import grammar
from procs.renderer.tools import CLOSE, OPEN, call_json, opener

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def guides(text_model):
    return Guides(text_model)


@pytest.fixture(scope="module")
def checker(guides):
    return grammar.Checker(guides.tok)


def allowed(guide, n_vocab: int) -> set[int] | None:
    out = guide.mask(torch.zeros(n_vocab))
    return None if out is None else set(torch.nonzero(out > float("-inf")).flatten().tolist())


def walk(guide, text_model, text: str) -> list:
    """Feed text's tokens; return, before each, the number of tokens allowed (None: free)."""
    seen = []
    for tok in text_model.encode(text):
        a = allowed(guide, text_model.vocab_size)
        seen.append(None if a is None else len(a))
        assert a is None or tok in a, (text_model.pieces[tok], text)
        guide.advance(tok)
    return seen


def test_closed_walks_schema_keywords_only():
    s = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"x": {"type": "integer"}}},
                                          "list": {"type": "array", "items": {"type": "object"}}},
         "$defs": {"d": {"properties": {}}}, "anyOf": [{"type": "object"}]}
    c = grammar.closed(s)
    assert c["additionalProperties"] is False
    assert set(c["properties"]) == {"properties", "list"}          # a property named properties stays one
    assert c["properties"]["properties"]["additionalProperties"] is False
    assert c["properties"]["list"]["items"]["additionalProperties"] is False
    assert c["$defs"]["d"]["additionalProperties"] is False and c["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in s                         # a copy
    assert grammar.closed({"type": "object", "additionalProperties": True})["additionalProperties"] is True


def test_build_per_choice():
    assert grammar.build(TOOLS, "none", None) is None
    assert grammar.build([], "auto", None) is None
    auto = grammar.build(TOOLS, "auto", None)
    assert auto.trigger == OPEN.encode()
    assert grammar.build(TOOLS, "required", None).trigger == b""
    named = grammar.build(TOOLS, NAMED, None)
    assert "get_time" not in named.grammar and named.trigger == b""
    assert "more: \"\"" in grammar.build(TOOLS, "required", None).grammar
    assert "more: (" in grammar.build(TOOLS, "required", None, parallel=True).grammar


def test_named_call_is_the_rendered_call(guides, checker, text_model):
    """After the prompt's opener the mask admits the call as call_json renders it, then only
    stop tokens: a constrained call replays byte for byte even without its id."""
    c = checker.make(TOOLS, NAMED, None)
    full = call_json("get_weather", json.dumps({"city": "Oslo", "unit": "F"}))
    rest = full[len(opener(NAMED)):]
    assert full.startswith(opener(NAMED)) and rest.endswith(CLOSE)
    g = guides.start(c)
    seen = walk(g, text_model, rest)
    assert all(n is not None for n in seen)
    assert allowed(g, text_model.vocab_size) == set(text_model.stop_ids)


def test_named_call_refuses_what_the_schema_forbids(guides, checker, text_model):
    for bad in ('{"city": "Oslo", "unit": "K"}', '{"unit": "C", "city": "Oslo"}', '{"city": "Oslo"}}',
                '{"city": 5, "unit": "C"}', '{"city": "Oslo", "unit": "C", "wind": 3}'):
        g = guides.start(checker.make(TOOLS, NAMED, None))
        ok = True
        for tok in text_model.encode(bad + "}\n" + CLOSE):
            a = allowed(g, text_model.vocab_size)
            if tok not in a:
                ok = False
                break
            g.advance(tok)
        assert not ok, bad


def test_auto_is_free_until_the_model_opens_a_call(guides, checker, text_model):
    g = guides.start(checker.make(TOOLS, "auto", None))
    prose = "Let me check. "
    seen = walk(g, text_model, prose + OPEN)
    assert seen == [None] * len(seen)                   # prose and the opener itself: unmasked
    seen = walk(g, text_model, '\n{"name": "get_time", "arguments": {}}\n' + CLOSE)
    assert all(n is not None for n in seen) and min(seen) >= 1
    assert allowed(g, text_model.vocab_size) == set(text_model.stop_ids)


def test_trigger_inside_a_token(guides, text_model):
    """The token that completes the opener may carry bytes past it: they are fed to the grammar."""
    last = next(p for p in text_model.pieces if len(p) >= 3 and p.isalpha())
    rest = last[1:].decode()
    g = guides.start(m.Constraint(grammar=f"start: {json.dumps(rest + 'Q')}\n", trigger=b"<x" + last[:1]))
    for piece in (b"<", b"x", last):
        assert g.mask(torch.zeros(text_model.vocab_size)) is None
        g.advance(text_model.pieces.index(piece))
    a = allowed(g, text_model.vocab_size)
    assert a and all(b"Q".startswith(text_model.pieces[t]) for t in a), [text_model.pieces[t] for t in a]


def test_response_formats(guides, checker, text_model):
    g = guides.start(checker.make([], "none", {"type": "json_object"}))
    walk(g, text_model, '{"any": [1, 2, {"x": null}]}')
    assert allowed(g, text_model.vocab_size) == set(text_model.stop_ids)
    fmt = {"type": "json_schema", "schema": WEATHER, "strict": True}
    g = guides.start(checker.make(TOOLS, "auto", fmt))   # the format, or a call
    walk(g, text_model, OPEN + '\n{"name": "get_time", "arguments": {}}\n' + CLOSE)
    assert allowed(g, text_model.vocab_size) == set(text_model.stop_ids)


def test_bad_schemas(checker):
    with pytest.raises(grammar.GrammarError) as ei:
        checker.make([], "none", {"type": "json_schema", "schema": {"$ref": "#/nowhere"}, "strict": True})
    assert ei.value.param == "response_format"
    strict_bad = {"type": "function", "function": {"name": "f", "strict": True,
                                                   "parameters": {"properties": {"a": {"$ref": "#/nowhere"}}}}}
    with pytest.raises(grammar.GrammarError) as ei:
        checker.make([strict_bad], "required", None)
    assert ei.value.param == "tools"
    # the same tool, not strict: called with any object rather than refused
    lax = {"type": "function", "function": {**strict_bad["function"], "strict": False}}
    c = checker.make([lax], "required", None)
    assert json.dumps(grammar.ANY_OBJECT)[:20] in c.grammar


def test_validation_is_remembered(checker):
    c = grammar.build(TOOLS, "required", None)
    checker.verdict(c.grammar)
    n = len(checker.seen)
    checker.make(TOOLS, "required", None)
    assert len(checker.seen) == n
