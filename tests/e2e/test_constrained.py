"""Constrained decoding end to end: the real processes and model, the official `openai` client.

Forced calls (tool_choice required and named) on varied schemas: nested objects, arrays,
enums, numbers, optional keys, anyOf, patterns, no arguments. Each answer's call must parse
and validate against its tool's schema (jsonschema), whatever tokens the model prefers on
this CPU. `make test` runs 12 of them; RICORDO_STRESS=full (`make stress`) runs 100. With
tool_choice auto, an answer that opens a call must hold a call that parses: none may come
back as a broken call in the text. response_format json_object / json_schema parse, and a
schema that cannot be used is a 400.
"""
from __future__ import annotations

import json
import os

import pytest

from procs.renderer.tools import OPEN

from .server import Server

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.slow

FULL = os.environ.get("RICORDO_STRESS") == "full"
N_FORCED = 100 if FULL else 12
MAX_TOKENS = 160
S = {"type": "string", "maxLength": 40}
SCHEMAS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "unit": {"type": "string", "enum": ["C", "F"]}},
                    "required": ["city", "unit"]},
    "create_user": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0}},
                 "required": ["name", "age"]},
        "tags": {"type": "array", "items": S, "maxItems": 3}}, "required": ["user"]},
    "calculate": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"},
                                                   "op": {"enum": ["add", "sub", "mul", "div"]}},
                  "required": ["x", "y", "op"]},
    "list_files": {"type": "object", "properties": {"path": S, "recursive": {"type": "boolean"},
                                                    "depth": {"type": "integer", "minimum": 1, "maximum": 9}},
                   "required": ["path"]},
    "place_order": {"type": "object", "properties": {"items": {
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": {"type": "object", "properties": {"id": {"type": "integer"}, "qty": {"type": "integer", "minimum": 1}},
                  "required": ["id", "qty"]}}}, "required": ["items"]},
    "set_level": {"type": "object", "properties": {"level": {"enum": ["low", "mid", "high"]}}, "required": ["level"]},
    "get_time": {"type": "object", "properties": {}},
    "lookup": {"type": "object", "properties": {"target": {"anyOf": [S, {"type": "integer"}]}}, "required": ["target"]},
    "book_day": {"type": "object", "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
                 "required": ["date"]},
    "toggle": {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {
        "type": "object", "properties": {"c": {"type": "boolean"}}, "required": ["c"]}}, "required": ["b"]}},
               "required": ["a"]},
}
TOOLS = [{"type": "function", "function": {"name": n, "description": f"The {n.replace('_', ' ')} tool",
                                           "parameters": p}} for n, p in SCHEMAS.items()]
QUESTIONS = ("What is the weather in Oslo?", "Add a user called Ada, 36 years old.", "What is 17 times 3?",
             "Show the files in /tmp.", "Order two of item 7.", "Set the level to high.", "What time is it?",
             "Look up order 42.", "Book the 3rd of May 2027.", "Turn the switch on.")


@pytest.fixture(scope="module")
def server():
    with Server(name="ricordo-constrained") as srv:
        yield srv


def ask(srv, question: str, **kw):
    return srv.client().chat.completions.create(
        model=srv.health["model"], messages=[{"role": "user", "content": question}], tools=TOOLS,
        max_tokens=MAX_TOKENS, temperature=kw.pop("temperature", 0), **kw)


def check_calls(r, names=None) -> list:
    ch = r.choices[0]
    calls = ch.message.tool_calls or []
    assert ch.finish_reason == "tool_calls" and calls, (ch.finish_reason, ch.message.content)
    assert not (ch.message.content or "").count(OPEN), ch.message.content
    for c in calls:
        assert c.function.name in (names or SCHEMAS), c.function.name
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    return calls


def test_forced_calls_parse_and_fit_their_schema(server):
    """Named calls cycle through the tools and questions; required ones let the model pick the
    tool (greedy and sampled alike). Every one must be a closed call that validates."""
    names, picked = list(SCHEMAS), {}
    for i in range(N_FORCED):
        question = QUESTIONS[i % len(QUESTIONS)]
        if i % 2 == 0:
            name = names[(i // 2) % len(names)]
            r = ask(server, question, tool_choice={"type": "function", "function": {"name": name}})
            [c] = check_calls(r, {name})
        else:
            r = ask(server, question, tool_choice="required", temperature=0 if i % 4 == 1 else 0.8, seed=i)
            [c] = check_calls(r)
        picked[c.function.name] = picked.get(c.function.name, 0) + 1
    print(f"{N_FORCED} forced calls parsed and validated; tools called: {picked}")


def test_auto_answers_never_hold_a_broken_call(server):
    """tool_choice auto: prose stays free; whatever opens a call is a whole, valid call."""
    system = ('Call a tool when one fits. Example call:\n' + OPEN +
              '\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>')
    opened, questions = 0, QUESTIONS if FULL else QUESTIONS[::2]
    for q in questions:
        r = server.client().chat.completions.create(
            model=server.health["model"], messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
            tools=TOOLS, max_tokens=64, temperature=0)
        ch = r.choices[0]
        if ch.message.tool_calls:
            opened += 1
            check_calls(r)
        else:
            assert OPEN not in (ch.message.content or ""), ch.message.content   # a call that did not parse
    print(f"auto: {opened} of {len(questions)} answers were calls, every one valid")


def test_response_formats(server):
    c, model = server.client(), server.health["model"]
    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Describe a cat in JSON."}],
                                  response_format={"type": "json_schema", "json_schema": {
                                      "name": "cat", "strict": True, "schema": SCHEMAS["create_user"]}},
                                  max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS["create_user"])
    r = c.responses.create(model=model, input="Give the weather in Rome as JSON.", max_output_tokens=MAX_TOKENS,
                           temperature=0, text={"format": {"type": "json_schema", "name": "w",
                                                           "schema": SCHEMAS["get_weather"]}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMAS["get_weather"])
    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi in JSON."}],
                                  response_format={"type": "json_object"}, max_tokens=12, temperature=0)
    text = r.choices[0].message.content
    assert text.startswith("{"), text
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    with pytest.raises(openai.BadRequestError) as ei:
        c.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                  response_format={"type": "json_schema", "json_schema": {
                                      "name": "bad", "strict": True,
                                      "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}})
    assert ei.value.status_code == 400 and ei.value.param == "response_format"
    r = ask(server, "What time is it?", tool_choice="required")       # the server goes on
    check_calls(r)
