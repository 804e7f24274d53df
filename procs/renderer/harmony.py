"""OpenAI's Harmony answers (gpt-oss): the text generated after the prompt's `<|start|>assistant`
is a sequence of messages, each a header, `<|message|>`, a body, and `<|end|>` before the
next one (`<|start|>assistant` + header); the answer ends at `<|return|>` or, for a tool call,
`<|call|>` (both stop tokens, never in the text).

A header names the message's channel (`<|channel|>analysis`, `final`, `commentary`) and, for a
call, its recipient (`to=functions.NAME`, before or after the channel; `<|constrain|>json` or
a bare `json` names the body's type). Routed: analysis -> reasoning; final, and commentary
with no recipient (a preamble the user sees) -> content; a body sent to a function -> that
call's arguments, streamed as they grow.

Under tool_choice auto the model writes its calls in its own syntax, unconstrained. A forced
call and a response_format open the message in the prompt (opener()): `required` up to the
function's name, a named function up to its arguments (the body), a format up to the final
channel's body; grammar.build holds the rest (the name, `<|constrain|>json<|message|>` as the
model's special tokens, the JSON).
"""
from __future__ import annotations

import re
import secrets

from common import messages as m

MESSAGE, END, START, CALL = "<|message|>", "<|end|>", "<|start|>", "<|call|>"
_RUN = secrets.token_hex(8)      # markers no client text holds
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_TO = re.compile(r"\bto=([^\s<]+)")


def detect(template: str | None) -> bool:
    """A chat template that renders Harmony messages."""
    src = template or ""
    return "<|channel|>" in src and "<|message|>" in src and "<|start|>" in src


CALL_HEAD = "<|channel|>commentary to=functions."      # then NAME + ARGS_HEAD + the JSON arguments
ARGS_HEAD = " <|constrain|>json<|message|>"
FINAL_HEAD = "<|channel|>final<|message|>"


def opener(choice, has_format: bool) -> str:
    """What the prompt ends with after its `<|start|>assistant`: a forced call's message
    opened (`required`: to the name; a named function: to its arguments), or the final
    channel's body for a response_format; "" when the model opens its own messages."""
    if isinstance(choice, dict):
        return CALL_HEAD + choice["function"]["name"] + ARGS_HEAD
    if choice == "required":
        return CALL_HEAD
    return FINAL_HEAD if has_format else ""


def marker(k: int) -> str:
    """The arguments a remembered call is rendered with, found again by replay()."""
    return f"ricordo-replay-{_RUN}-{k}"


def replay(rendered: str, replays: dict[str, str]) -> str | None:
    """The prompt with each remembered call's message (from its `<|start|>` to its `<|call|>`,
    the template's own rendering around the marker) replaced by `<|start|>assistant` + the
    answer as sampled: the bytes the live session holds. None when a marker is not found
    whole (a template that renders calls otherwise): the caller renders from JSON."""
    for mark, sampled in replays.items():
        i = rendered.find(mark)
        a, b = rendered.rfind(START, 0, i), rendered.find(CALL, i)
        if i < 0 or a < 0 or b < 0:
            return None
        rendered = rendered[:a] + START + "assistant" + sampled + rendered[b + len(CALL):]
    return rendered


def held(buf: str, marker: str) -> int:
    """How many chars at the end of buf could begin marker (held back until known)."""
    for k in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:k]):
            return k
    return 0


class Channels:
    """Splits a Harmony answer incrementally into reasoning, content and tool calls."""

    def __init__(self, new_id, opened: str = ""):
        """opened: the opener() the prompt ended with (its call's head, if any, goes out with
        the first piece; it belongs to the sampled answer the next turn replays)."""
        self.new_id = new_id            # () -> a call id
        self.buf = ""
        self.in_header = True
        self.channel = ""
        self.to = ""                    # the current message's recipient, "" for none
        self.calls: list[list[str]] = []   # [id, name, arguments]
        self.messages = 0               # message bodies begun
        self.raw: list[str] = []        # the answer's text as sampled (replay: block())
        self.stop = ""                  # the stop token that ended it (answer.py sets it)
        self.pending: list[m.ToolCallDelta] = []   # the opened call's head, not yet sent
        if opened:
            _, _, self.pending = self.push(opened)

    def push(self, text: str) -> tuple[str, str, list[m.ToolCallDelta]]:
        """(reasoning, content, call pieces) of the text so far that is known."""
        self.raw.append(text)
        self.buf += text
        reasoning, content, pieces = [], [], self.pending
        self.pending = []
        while self.buf:
            if self.in_header:
                i = self.buf.find(MESSAGE)
                if i < 0:
                    break
                self._header(self.buf[:i])
                self.buf = self.buf[i + len(MESSAGE):]
                self.in_header = False
                self.messages += 1
                if self.to:
                    self.calls.append([self.new_id(), self.to, ""])
                    cid, name, _ = self.calls[-1]
                    pieces.append(m.ToolCallDelta(index=len(self.calls) - 1, id=cid, name=name, arguments=""))
                continue
            i = self.buf.find(END)
            if i >= 0:
                body, self.buf = self.buf[:i], self.buf[i + len(END):]
            else:
                cut = len(self.buf) - held(self.buf, END)
                body, self.buf = self.buf[:cut], self.buf[cut:]
            self._route(body, reasoning, content, pieces)
            if i < 0:
                break
            self.in_header = True
        return "".join(reasoning), "".join(content), pieces

    def flush(self) -> tuple[str, str, list[m.ToolCallDelta]]:
        """The rest, at the end of the answer: a body's held-back tail. A header never
        finished is dropped (it carries no text for anyone), unless no message began at all:
        a model that did not write Harmony (a template given to another model) answered in
        plain text, which is content."""
        reasoning, content, pieces = [], [], self.pending
        self.pending = []
        if not self.in_header:
            self._route(self.buf, reasoning, content, pieces)
        elif not self.messages and "<|channel|>" not in self.buf:
            content.append(self.buf)
        self.buf = ""
        return "".join(reasoning), "".join(content), pieces

    def block(self) -> str | None:
        """The whole answer as the next prompt must hold it (what replay() puts back): its
        text and the `<|call|>` that ended it (another stop token, from a model without
        Harmony's: the template's `<|call|>` in its place); None unless it ended in a call."""
        return "".join(self.raw) + CALL if self.stop and self.calls else None

    def _header(self, head: str) -> None:
        mc, mt = _CHANNEL.search(head), _TO.search(head)
        self.channel = mc.group(1) if mc else ""
        to = mt.group(1) if mt else ""
        self.to = to[len("functions."):] if to.startswith("functions.") else to

    def _route(self, body: str, reasoning: list, content: list, pieces: list) -> None:
        if not body:
            return
        if self.to:
            self.calls[-1][2] += body
            pieces.append(m.ToolCallDelta(index=len(self.calls) - 1, arguments=body))
        elif self.channel == "analysis":
            reasoning.append(body)
        else:
            content.append(body)
