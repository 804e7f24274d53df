"""Grammars for constrained decoding: what a request's tools, tool_choice and response_format
allow the model to generate, as llguidance Lark text.

A call is written in the model family's syntax (toolfmt.Format: block, call head, arguments,
tail), its JSON in json.dumps spacing (", " and ": "), the spacing tools.call_json and the
templates' tojson render a call from a client's JSON with: a constrained call replays
byte-exactly even when its id is unknown. The grammar starts where generation starts: after
the opener the prompt already ends with (Format.opener), or, for tool_choice auto, after the
model itself wrote the format's trigger, so prose is never constrained.
Objects whose schema leaves additionalProperties open are closed (as llama.cpp does): a
small model otherwise invents keys until the token limit and the call never closes.
"""
from __future__ import annotations

import collections
import hashlib
import json

import llguidance
import msgspec

from common import guidance, messages as m
from procs.renderer import toolxml
from procs.renderer.toolfmt import GENERIC, Format

# JSON inside a grammar: one spacing, so a generated call reads as a rendered one
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_SUB = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
        "unevaluatedItems", "unevaluatedProperties")
_SUB_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUB_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


ANY_OBJECT = {"type": "object", "additionalProperties": True}


class GrammarError(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def closed(schema):
    """A copy of a JSON Schema with every object that does not say otherwise closed to
    keys it does not list. Walks schema keywords only, so a property named `properties`
    stays a property."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _SUB:
        if isinstance(out.get(k), dict):
            out[k] = closed(out[k])
    for k in _SUB_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [closed(x) for x in out[k]]
    for k in _SUB_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: closed(x) for name, x in out[k].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = closed(out["additionalProperties"])
    is_object = out.get("type") == "object" or (isinstance(out.get("type"), list) and "object" in out["type"])
    if (is_object or "properties" in out) and "additionalProperties" not in out \
            and "patternProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def _lit(s: str) -> str:
    return json.dumps(s)   # a JSON string is a valid Lark string literal


def _json_rule(name: str, schema: dict, strict: bool) -> str:
    s = dict(closed(schema))
    s["x-guidance"] = dict(JSON_OPTIONS, lenient=not strict)
    return f"{name}: %json {json.dumps(s, ensure_ascii=False)}\n"


def _args_rule(fmt: Format, name: str, schema: dict, strict: bool) -> str:
    """A call's arguments: a JSON object, or XML parameters (toolxml) whose non-string
    values are JSON."""
    if fmt.kind == "xml":
        return toolxml.args_rules(fmt, name, closed(schema), lambda r, sub: _json_rule(r, sub, strict))
    return _json_rule(name, schema, strict)


def _functions(tools: list[dict]) -> list[tuple[str, dict, bool]]:
    out = []
    for t in tools:
        fn = t.get("function") or {}
        params = fn.get("parameters")
        out.append((fn["name"], params if isinstance(params, dict) else {"type": "object", "properties": {}},
                    fn.get("strict") is True))
    return out


def names(tools_json: str) -> frozenset[str]:
    """The function names a request's tools (JSON text) declare."""
    return frozenset(n for n, _, _ in _functions(json.loads(tools_json))) if tools_json else frozenset()


def _fenced(fns) -> str:
    """The rules of a call written as JSON (guidance.FENCE_HEAD) from its name's opening quote
    on, without their start (guidance.call_grammar): the name one of
    the tools', the arguments in the grammar's spacing; the head's spacing is the model's
    own, a few blanks at most (an unbounded run lets a small model write blanks forever)."""
    rules = "WS: /[ \\t\\n]{0,12}/\nfc: " + \
        " | ".join(f"h{i}" for i in range(len(fns))) + "\n"
    for i, (name, params, strict) in enumerate(fns):
        rules += f"h{i}: {_lit(json.dumps(name, ensure_ascii=False)[1:] + ',')} WS {_lit(chr(34) + 'arguments' + chr(34) + ': ')} a{i}\n"
        rules += _json_rule(f"a{i}", params, strict)
    return rules


def _seq(*parts: str) -> str:
    """Lark sequence of literal texts and rule names (names are given as ("rule",))."""
    return " ".join(p[0] if isinstance(p, tuple) else _lit(p) for p in parts if p) or '""'


def _call_rules(fns, parallel: bool, fmt: Format) -> str:
    """`call`: one call after its head_pre; `first`: the first call after the format's
    trigger (auto); `more`: the calls that may follow; `end`: what closes the block."""
    rules = "call: " + " | ".join(f"c{i}" for i in range(len(fns))) + "\n"
    rules += "first: " + " | ".join(f"f{i}" for i in range(len(fns))) + "\n"
    for i, (name, params, strict) in enumerate(fns):
        head = fmt.name_part(name)
        lead = fmt.block_open + fmt.head_pre + head
        rules += f"c{i}: {_seq(head, (f'a{i}',), fmt.tail)}\n"
        rules += f"f{i}: {_seq(lead[len(fmt.trigger):], (f'a{i}',), fmt.tail)}\n"
        rules += _args_rule(fmt, f"a{i}", params, strict)
    more = f"({_seq(fmt.sep, fmt.head_pre, ('call',))})*" if parallel and fmt.parallel else '""'
    return rules + f"more: {more}\nend: {_seq(fmt.block_close)}\n"


def _harmony(fns, choice, fmt: dict | None, specials: frozenset[str]) -> m.Constraint | None:
    """A Harmony model's constraint, after harmony.opener's text: a named call's arguments, a
    forced call's name and arguments (its `<|constrain|>` and `<|message|>` as the special
    tokens where the vocabulary has them, as text otherwise), a format's JSON; auto: None."""
    def tok(t: str) -> str:
        return t if t in specials else _lit(t)
    if isinstance(choice, dict) and fns:
        _, params, strict = next(f for f in fns if f[0] == choice["function"]["name"])
        return m.Constraint(grammar="start: args\n" + _json_rule("args", params, strict))
    if choice == "required" and fns:
        rules = "start: " + " | ".join(f"c{i}" for i in range(len(fns))) + "\n"
        for i, (name, params, strict) in enumerate(fns):
            rules += f"c{i}: {_lit(name + ' ')} {tok('<|constrain|>')} {_lit('json')} {tok('<|message|>')} a{i}\n"
            rules += _json_rule(f"a{i}", params, strict)
        return m.Constraint(grammar=rules)
    if fmt is not None:
        return m.Constraint(grammar="start: fmt\n" + _format_rule(fmt))
    return None


def _format_rule(fmt: dict) -> str:
    """`fmt`: a response_format's JSON (json_object: any object)."""
    schema = fmt.get("schema") if fmt.get("type") == "json_schema" else ANY_OBJECT
    return _json_rule("fmt", schema if isinstance(schema, dict) else {}, fmt.get("strict") is True)


def build(tools: list[dict], choice, fmt: dict | None, parallel: bool = False,
          calls: Format = GENERIC, specials: frozenset[str] = frozenset()) -> m.Constraint | None:
    """The request's constraint, or None when generation is free. `choice` is the parsed
    tool_choice (none | auto | required | {"function": {"name": ...}}), `fmt` the
    response_format ({"type": "json_object"} or {"type": "json_schema", "schema": ...});
    `parallel` lets a call be followed by more calls instead of the end of the answer;
    `calls` is the model's call syntax; `specials` the vocabulary's special tokens' texts."""
    fns = _functions(tools) if tools and choice != "none" else []
    if calls.kind == "harmony":
        return _harmony(fns, choice, fmt, specials)
    if isinstance(choice, dict) and fns:          # the prompt ends inside the named call
        _, params, strict = next(f for f in fns if f[0] == choice["function"]["name"])
        return m.Constraint(grammar=f"start: {_seq(('args',), calls.tail, calls.block_close)}\n"
                            + _args_rule(calls, "args", params, strict))
    if choice == "required" and fns:              # the prompt ends with the block's opener
        return m.Constraint(grammar="start: call more end\n" + _call_rules(fns, parallel, calls))
    if fmt is not None:
        body = _format_rule(fmt)
        if fns:                                   # auto: the answer is the format or calls
            return m.Constraint(grammar=f"start: fmt | {_seq(calls.trigger)} first more end\n" + body
                                + _call_rules(fns, parallel, calls))
        return m.Constraint(grammar="start: fmt\n" + body)
    if fns:                                       # auto: free text until the model opens a call
        return m.Constraint(grammar="start: first more end\n" + _call_rules(fns, parallel, calls),
                            trigger=calls.trigger.encode(), fence=_fenced(fns) if calls.kind == "tags" else "")
    return None


class Checker:
    """Builds a request's constraint and validates it against the model's vocabulary,
    remembering each grammar's verdict by its hash: an agent sends the same tools every
    turn and pays once. A non-strict tool whose schema llguidance cannot use (after its
    lenient mode) is called with any JSON object; a strict tool or a response_format it
    cannot use is the client's error."""

    def __init__(self, tok: llguidance.LLTokenizer, size: int = 256, specials: frozenset[str] = frozenset()):
        self.tok, self.size, self.specials = tok, size, specials
        self.seen: collections.OrderedDict[str, str] = collections.OrderedDict()

    def verdict(self, grammar: str) -> str:
        """'' when usable, else llguidance's error."""
        key = hashlib.sha1(grammar.encode()).hexdigest()
        err = self.seen.get(key)
        if err is None:
            err = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar), self.tok)
            self.seen[key] = "" if err.startswith("WARNING") else err
            while len(self.seen) > self.size:
                self.seen.popitem(last=False)
        self.seen.move_to_end(key)
        return self.seen[key]

    def make(self, tools: list[dict], choice, fmt: dict | None, parallel: bool = False,
             calls: Format = GENERIC) -> m.Constraint | None:
        c = build(tools, choice, fmt, parallel, calls, self.specials)
        if c is None:
            return None
        err = self.verdict(c.grammar)
        if err and tools:
            fixed = []
            for t in tools:
                fn = t.get("function") or {}
                if fn.get("strict") is not True and isinstance(fn.get("parameters"), dict) \
                        and self.verdict(build([t], "required", None, calls=calls, specials=self.specials).grammar):
                    t = {**t, "function": {**fn, "parameters": ANY_OBJECT}}
                fixed.append(t)
            c = build(fixed, choice, fmt, parallel, calls, self.specials)
            err = self.verdict(c.grammar)
        if err:
            raise GrammarError("response_format" if fmt is not None else "tools",
                               f"the schema cannot be used to constrain the answer: {err.splitlines()[0]}")
        if c.fence and self.verdict(guidance.call_grammar(c.fence, True)):   # the tags are still constrained
            c = msgspec.structs.replace(c, fence="")
        return c
