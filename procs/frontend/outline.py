"""The outline of an answer as blocks of text and tool calls, for the APIs that answer in
blocks (/v1/responses in responses.py, /v1/messages in anthropic.py): Delta events become
open / text / args / close operations, which each API turns into its own items or content
blocks. Knows the wire events; nothing of HTTP or tokens.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

from common.messages import Delta, Finished


# -- the outline of an answer: blocks of text and of tool calls --------------------------

@dataclass
class Block:
    index: int                      # position among the answer's blocks
    kind: str                       # "text" | "call" | "reasoning" (a reasoning model's thinking)
    text: str = ""
    id: str = ""
    name: str = ""
    args: str = ""
    extra: dict = field(default_factory=dict)    # per-API ids


class Outline:
    """Delta events -> ops on blocks: ("open", b), ("text", b, s), ("args", b, s), ("close", b).
    A text block opens with the first text after a call (or at the start), a reasoning block
    (its "text" ops the thinking) with the first reasoning after anything else; a call block
    with the first piece of a call (the one with id and name); the open block closes when
    another opens or at the end. reasoning=False leaves reasoning out (an API whose client
    did not ask for it). `raw` gathers the sampled bytes when the request asked for logprobs
    (to tell which stop string ended the answer)."""

    def __init__(self, reasoning: bool = True):
        self.reasoning = reasoning
        self.blocks: list[Block] = []
        self.open: Block | None = None
        self.calls: dict[int, Block] = {}
        self.raw = bytearray()
        self.text: list[str] = []

    def _start(self, b: Block) -> list:
        ops = self.close()
        self.blocks.append(b)
        self.open = b
        return ops + [("open", b)]

    def feed(self, ev: Delta) -> list:
        ops: list = []
        for t in ev.logprobs:
            self.raw += bytes(t.bytes)
        if ev.reasoning and self.reasoning:
            if self.open is None or self.open.kind != "reasoning":
                ops += self._start(Block(len(self.blocks), "reasoning"))
            self.open.text += ev.reasoning
            ops.append(("text", self.open, ev.reasoning))
        if ev.text:
            self.text.append(ev.text)
            if self.open is None or self.open.kind != "text":
                ops += self._start(Block(len(self.blocks), "text"))
            self.open.text += ev.text
            ops.append(("text", self.open, ev.text))
        for p in ev.tool_calls or ():
            b = self.calls.get(p.index)
            if b is None or p.id:
                b = Block(len(self.blocks), "call", id=p.id, name=p.name)
                self.calls[p.index] = b
                ops += self._start(b)
            if p.arguments:
                b.args += p.arguments
                ops.append(("args", b, p.arguments))
        return ops

    def close(self) -> list:
        b, self.open = self.open, None
        return [("close", b)] if b is not None else []


def matched_stop(stops, raw: bytes, text: str) -> str | None:
    """The stop string that ended an answer: the sampled text (`raw`, every token) goes on
    past the returned `text` with it. None when no stop string did (or it can't be told)."""
    if not stops or not raw:
        return None
    full = bytes(raw).decode("utf-8", "replace")
    if not full.startswith(text):
        return None
    rest = full[len(text):]
    hits = [s for s in stops if s and rest.startswith(s)]
    return min(hits, key=len) if hits else None


class Whole:
    """The collector of a whole (non-streamed) answer: the outline, then `build(outline, fin)`."""

    def __init__(self, build: Callable[["Outline", Finished], dict], reasoning: bool = True):
        self.outline, self.build = Outline(reasoning), build

    def add(self, ev: Delta) -> None:
        self.outline.feed(ev)

    def result(self, fin: Finished) -> dict:
        self.outline.close()
        return self.build(self.outline, fin)


class Blocks:
    """Base of a streamed shaper over the outline: `ops(ops)` turns operations into SSEvents,
    `end(fin)` gives the events after the last block closed."""

    def __init__(self, reasoning: bool = True):
        self.outline = Outline(reasoning)

    def ops(self, ops: list) -> list:
        raise NotImplementedError

    def end(self, fin: Finished) -> list:
        raise NotImplementedError

    def started(self, ev) -> list:
        return []

    def delta(self, ev: Delta) -> list:
        return self.ops(self.outline.feed(ev))

    def finish(self, fin: Finished) -> list:
        return self.ops(self.outline.close()) + self.end(fin)


def parse_json_object(text: str):
    """Tool arguments as an object (Anthropic's `input`): a JSON object as it is; one the
    token limit cut, as a streaming client assembles it (partial_json); anything else,
    wrapped as {"arguments": value}."""
    try:
        v = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        try:
            v = partial_json(text)
        except ValueError:
            return {"arguments": text}
    return v if isinstance(v, dict) else {"arguments": v}


_DEC = json.JSONDecoder()
_WS = " \t\r\n"


def partial_json(text: str):
    """The value a JSON text cut short stands for, as the Anthropic SDK's stream assembly
    reads partial input (jiter's partial mode): open objects and arrays closed, a string,
    literal or key not finished left out with its key; a number kept where it is one.
    ValueError when the text is not the beginning of JSON."""
    try:
        v, _, _ = _partial(text, 0)
    except EOFError:
        raise ValueError("a value not finished") from None
    return v


def _skip(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _partial(s: str, i: int):
    """(value, end, whole) of the JSON value at s[i]; at the text's end a container comes
    back as far as it goes (whole False) and a scalar raises EOFError."""
    i = _skip(s, i)
    if i >= len(s):
        raise EOFError
    if s[i] in "{[":
        obj, close = ({}, "}") if s[i] == "{" else ([], "]")
        i += 1
        while True:
            i = _skip(s, i)
            if i >= len(s):
                return obj, i, False
            if s[i] == close:
                return obj, i + 1, True
            if obj and s[i] == ",":
                i = _skip(s, i + 1)
                if i >= len(s):
                    return obj, i, False
            key = None
            if close == "}":
                try:
                    key, i = _DEC.raw_decode(s, i)
                except json.JSONDecodeError:
                    if s.startswith('"', i):   # a key not finished
                        return obj, len(s), False
                    raise ValueError("not JSON") from None
                i = _skip(s, i)
                if i >= len(s):
                    return obj, i, False
                if s[i] != ":":
                    raise ValueError("not JSON")
                i += 1
            try:
                v, i, whole = _partial(s, i)
            except EOFError:
                return obj, len(s), False
            if close == "}":
                obj[key] = v
            else:
                obj.append(v)
            if not whole:
                return obj, i, False
    try:
        v, end = _DEC.raw_decode(s, i)
    except json.JSONDecodeError:
        if s[i] == '"' or s[i] in "tfn-0123456789":
            raise EOFError from None    # a scalar not finished (checked as a prefix below)
        raise ValueError("not JSON") from None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and end < len(s) \
            and all(c in "0123456789.eE+-" for c in s[end:]):
        raise EOFError                  # a number cut inside its fraction or exponent
    return v, end, True
