"""Calls written as XML (Qwen3-Coder and its successors, toolfmt.QWEN_XML; GLM's tags of another
shape, toolfmt.GLM and GLM_COMPACT, read through the same code by their Format's tags):

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

A value is the parameter's text as it is: a string parameter's value is the string itself
(no quotes, no escapes), any other is JSON, as the family's template renders a call
(`args_value if args_value is string else args_value | tojson`). So the arguments a client
gets are built here, by the tool's schema, and a call the grammar constrained renders back
byte for byte from them. Formats differ in the newlines around a value (Format.value_open,
value_close); the grammar writes the one the template renders.

A value may hold any text but its own closing (a file being written may hold `</function>`
or `</tool_call>`): the grammar ends it at the first value_close (a lazy lexeme), and the
parser looks for exactly that.
"""
from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import NamedTuple

from procs.renderer.toolfmt import Format, Incomplete

_DECODER = json.JSONDecoder()
KEY = "[A-Za-z0-9_.:$@-]+"    # a parameter name the open grammar (no schema) allows
_NAME = r"([^<>\n]+)"
# a name with no tag of its own (GLM's, right after <tool_call>) is a function name's
# characters only: other text there is not a call
_BARE_NAME = r"[\w.:$-]+"


class Shape(NamedTuple):
    """A format's tags as patterns: the function's name (whole), a key, the function's end
    (the last value's end), the call's end after it, a call whose name is whole."""
    function: re.Pattern
    param: re.Pattern
    fn_end: re.Pattern
    end: re.Pattern
    head: re.Pattern
    tags: tuple[str, str]       # what may open after a value: a key, or the function's end


@lru_cache(maxsize=8)
def shape(f: Format) -> Shape:
    e = re.escape
    close = f.name_close.rstrip("\n")       # a newline after the name is optional
    name = e(f.name_open) + (_NAME + e(close) + r"\n?" if close else f"({_BARE_NAME})" + r"(?=[\n<])\n?")
    fn_end = f.fn_close or f.close
    end = (e(f.fn_close) + r"\s*" if f.fn_close else "") + e(f.close)
    return Shape(re.compile(r"\s*" + name), re.compile(r"\s*" + e(f.key_open) + _NAME + e(f.key_close)),
                 re.compile(r"\s*" + e(fn_end)), re.compile(r"\s*" + end),
                 re.compile(r"\s*" + e(f.trigger) + r"\s*" + name), (f.key_open, fn_end))


def head(f: Format) -> re.Pattern:
    """A call whose name is whole: group 1 the name."""
    return shape(f).head


def _name_may_grow(f: Format, rest: str) -> bool:
    """Whether rest (after the trigger) may still become the function's name and its close."""
    if len(rest) < len(f.name_open):
        return f.name_open.startswith(rest)
    bare = not f.name_close.rstrip("\n")
    return rest.startswith(f.name_open) and \
        re.fullmatch(f"(?:{_BARE_NAME})?" if bare else r"[^<>\n]*", rest[len(f.name_open):]) is not None


def string_params(tools: list[dict]) -> dict[str, frozenset[str]]:
    """For each function, the parameters whose schema says string: their values are taken
    as written. Any other value is parsed as JSON (kept as a string when it is not JSON)."""
    out = {}
    for t in tools:
        fn = t.get("function") or {}
        props = (fn.get("parameters") or {}).get("properties") if isinstance(fn.get("parameters"), dict) else None
        out[fn.get("name", "")] = frozenset(k for k, v in (props or {}).items() if is_string(v))
    return out


def is_string(schema) -> bool:
    if not isinstance(schema, dict):
        return False
    t = schema.get("type")
    if isinstance(t, list):
        t = [x for x in t if x != "null"]
        t = t[0] if len(t) == 1 else None
    return t == "string" or (t is None and "enum" in schema and all(isinstance(x, str) for x in schema["enum"]))


def _value(raw: str, as_string: bool):
    if as_string:
        return raw
    try:
        v, end = _DECODER.raw_decode(raw.strip())
        return v if end == len(raw.strip()) else raw
    except (ValueError, RecursionError):
        return raw


def params(f: Format, s: str, i: int, strings: frozenset[str], final: bool = False) -> tuple[dict, int, bool]:
    """The parameters that open at s[i]: (arguments, end, closed) where `closed` says the
    function's end followed. Incomplete while the text may still go on (unless `final`:
    then what is whole, and a value cut short as far as it goes); ValueError when it cannot
    be a call."""
    args = {}
    close = f.value_close       # whole, as the grammar ends a value: "\n</parameter>x" is text
    sh = shape(f)
    while True:
        mp = sh.param.match(s, i)
        if mp is None:
            me = sh.end.match(s, i)
            if me is not None:
                return args, me.end(), True
            rest = s[i:].lstrip()
            if final or not _may_open(sh, rest):
                if final:
                    return args, len(s), False
                raise ValueError("not a parameter")
            raise Incomplete
        key, start = mp.group(1), mp.end()
        b = s.find(close, start)
        if b < 0:
            if final:       # the limit cut the value: as far as it goes, less a closing begun
                raw = s[start:]
                if f.value_open.startswith(raw):        # cut inside what opens the value
                    raw = ""
                raw = raw[len(f.value_open):] if f.value_open and raw.startswith(f.value_open) else raw
                k = next((k for k in range(len(close), 0, -1) if raw.endswith(close[:k])), 0)
                args[key] = _value(raw[:len(raw) - k], key in strings)
                return args, len(s), False
            raise Incomplete
        raw = s[start:b]
        if f.value_open and raw.startswith(f.value_open):
            raw = raw[len(f.value_open):]
        args[key] = _value(raw, key in strings)
        i = b + len(close)


def _may_open(sh: Shape, rest: str) -> bool:
    """Whether text after a value (or the function tag) may still open a parameter or end
    the function."""
    return any(tag.startswith(rest[:len(tag)]) for tag in sh.tags)


def scan(f: Format, s: str, i: int, strings: dict[str, frozenset[str]]) -> tuple[list[tuple[str, str]], int, bool]:
    """The call that opens at s[i] (s[i:] starts with the trigger): ([(name, arguments
    JSON)], end, True), as toolfmt.scan. A call that is not well formed is skipped up to its
    closing tag."""
    j = i + len(f.trigger)
    mf = shape(f).function.match(s, j)
    if mf is None:
        if _name_may_grow(f, s[j:].lstrip()):
            raise Incomplete
        b = s.find(f.close, j)
        if b < 0:
            raise Incomplete
        return [], b + len(f.close), True
    name = mf.group(1)
    try:
        args, end, _ = params(f, s, mf.end(), strings.get(name, frozenset()))
    except ValueError:
        b = s.find(f.close, mf.end())
        if b < 0:
            raise Incomplete from None
        return [], b + len(f.close), True
    return [(name, json.dumps(args, ensure_ascii=False))], end, True


def cut(f: Format, s: str, strings: dict[str, frozenset[str]]) -> tuple[str, str] | None:
    """A call the token limit cut after its name (s: the block from the call's trigger on):
    (name, the arguments as far as they go), or None when its name is not whole."""
    mt = re.match(r"\s*" + re.escape(f.trigger), s)
    mf = shape(f).function.match(s, mt.end()) if mt else None
    if mf is None:
        return None
    name = mf.group(1)
    args, _, _ = params(f, s, mf.end(), strings.get(name, frozenset()), final=True)
    return name, json.dumps(args, ensure_ascii=False)


class Stream:
    """The arguments of a call being generated, as JSON text that is surely a prefix of
    the JSON the call ends with (json.dumps of its arguments): a string value is passed on
    escaped as it grows, less what may begin its closing; any other value once it is closed.
    Fed the block so far, read from `pos` (after the call's `<function=NAME>` tag) on; each
    character is looked at a bounded number of times (a closing is looked for from where
    the last search stopped)."""

    def __init__(self, f: Format, strings: frozenset[str], pos: int):
        self.f, self.strings = f, strings
        self.shape = shape(f)
        self.close = f.value_close
        self.pos = pos            # where the next parameter (or the end) is looked for
        self.key = None           # the open parameter
        self.start = self.done = 0   # its value's start; how far it was passed on
        self.out = ""             # the JSON text so far
        self.n_params = 0
        self.ended = self.broken = False

    def feed(self, s: str) -> str:
        """s: the block so far. Returns the arguments' JSON so far."""
        while not self.ended:
            if self.key is None:
                mp = self.shape.param.match(s, self.pos)
                if mp is None:
                    me = self.shape.fn_end.match(s, self.pos)
                    if me is not None:
                        self.out += "{}" if not self.n_params else "}"
                        self.ended = True
                    elif not _may_open(self.shape, s[self.pos:].lstrip()):
                        self.ended = self.broken = True    # not a call after all: scan() skips it
                    break
                start = mp.end()
                if len(s) < start + len(self.f.value_open):
                    break
                if self.f.value_open and s.startswith(self.f.value_open, start):
                    start += len(self.f.value_open)
                self.key, self.start = mp.group(1), start
                self.done = start
                self.out += ("{" if not self.n_params else ", ") + json.dumps(self.key, ensure_ascii=False) + ": "
                self.out += '"' if self.key in self.strings else ""
                self.n_params += 1
            b = s.find(self.close, max(self.start, self.done - len(self.close)))
            as_string = self.key in self.strings
            if b < 0:
                if as_string:    # on to what may not begin the closing
                    end = len(s) - next((k for k in range(len(self.close), 0, -1) if s.endswith(self.close[:k])), 0)
                    if end > self.done:
                        self.out += json.dumps(s[self.done:end], ensure_ascii=False)[1:-1]
                        self.done = end
                break
            if as_string:
                self.out += json.dumps(s[self.done:b], ensure_ascii=False)[1:-1] + '"'
            else:
                self.out += json.dumps(_value(s[self.start:b], False), ensure_ascii=False)
            self.key, self.pos = None, b + len(self.close)
        return self.out


# -- grammar (llguidance Lark), for grammar.py --

def _lit(s: str) -> str:
    return json.dumps(s)


def _rx(text: str) -> str:
    """Literal text inside a Lark /regex/: escaped, newlines as \\n, slashes escaped."""
    return "".join("\\n" if c == "\n" else "\\/" if c == "/" else re.escape(c) for c in text)


def args_rules(f: Format, name: str, schema: dict, json_rule) -> str:
    """Rule `name`: the parameters of one call in schema order (required ones always,
    optional ones or not), each value by its schema; `json_rule(rule, schema)` gives a
    JSON value's rule. A schema without properties (or open to any key) takes any
    parameters, their values as text."""
    schema = schema if isinstance(schema, dict) else {}
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    tail = f.value_close
    lazy = "/(?s:.*)" + _rx(tail) + "/"
    if schema.get("additionalProperties") not in (None, False):
        return (f"{name}: {name}_p*\n{name}_p: {_lit(f.key_open)} /{KEY}/ {_lit(f.key_close + f.value_open)} {name}_v\n"
                f"{name}_v[lazy]: {lazy}\n")
    required = set(schema.get("required") or ())
    parts, rules = [], ""
    for k, (key, sub) in enumerate(props.items()):
        r = f"{name}_{k}"
        head = _lit(f"{f.key_open}{key}{f.key_close}{f.value_open}")
        if is_string(sub) and isinstance(sub, dict) and isinstance(sub.get("enum"), list):
            rules += f"{r}: {head} ({' | '.join(_lit(str(e) + tail) for e in sub['enum'])})\n"
        elif is_string(sub):
            rules += f"{r}: {head} {r}_v\n{r}_v[lazy]: {lazy}\n"
        else:
            rules += f"{r}: {head} {r}_v {_lit(tail)}\n" + json_rule(f"{r}_v", sub if isinstance(sub, dict) else {})
        parts.append(r if key in required else f"{r}?")
    return f"{name}: {' '.join(parts) or chr(34) * 2}\n" + rules

