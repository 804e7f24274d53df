"""Parsing generated tool calls, incrementally, in the model family's syntax
(procs/renderer/toolfmt.py, toolxml.py): content text, calls as they close or grow, a call the
token limit cut, and the block that replay renders (tools.py keeps the replay side)."""
from __future__ import annotations

from common import guidance
from common import messages as m
from procs.renderer import toolfmt, toolxml
from procs.renderer.toolfmt import GENERIC, Format


class CallParser:
    """Splits generated text into content and tool calls, incrementally. Text that might
    open a call is held back; a call is emitted when it is complete in the format's syntax."""

    def __init__(self, opened: str = "", fmt: Format = GENERIC, names=frozenset(), grow: bool = False,
                 grow_fenced: bool = False, strings: dict[str, frozenset[str]] | None = None):
        self.fmt = fmt
        self.strings = strings or {}    # xml: each function's string parameters (toolxml)
        # a call is streamed while it grows only where decoding is constrained to end it as a
        # call (`grow`; `grow_fenced` for a fenced one): unconstrained text may turn out not
        # to be one, and a head the client has seen cannot be taken back
        self.grow, self.grow_fenced = grow, grow_fenced
        self.names = frozenset(names)
        # an answer may open with a fenced call (guidance.fence_state) while this is 0
        self.fence = 0 if names and fmt.kind == "tags" and not opened else -1
        # a call the token limit cut, from flush(): (id, name, arguments, index, how much of
        # them was streamed; -1: not even its head)
        self.cut: tuple[str, str, str, int, int] | None = None
        self.late: list[m.ToolCallDelta] = []           # a call flush() closed
        self.content_done = bool(opened)
        self.buf = opened            # text since the first trigger (the block), or held content
        self.block = opened          # the whole block text so far
        self.calls: list[tuple[str, str, str]] = []   # (id, name, arguments)
        self.scan = 0
        self.more = True             # the format lets another call follow the last one
        self.closed = False          # close_block() ran: nothing more is taken
        self.content_bytes = 0       # UTF-8 bytes of the content returned so far
        self.opened = opened
        self.opened_bytes = len(opened.encode())   # the opener is prompt, not generated
        # the call being generated, streamed as it grows (constrained decoding guarantees it
        # ends as a call): [index, id, name, where its arguments begin in buf, ValueScan, sent]
        self.live: list | None = None

    def push(self, text: str) -> tuple[str, list[m.ToolCallDelta]]:
        """(content text to emit, call pieces to emit)."""
        if self.closed:
            return "", []
        trig = self.fmt.trigger
        if not self.content_done and self.fence == 0:
            self.buf += text
            self.fence = guidance.fence_state(self.buf)
            if self.fence == 0:
                return "", []
            if self.fence == 1:
                self.block = self.buf
                self.content_done = True
                return "", self._calls()
            text, self.buf = self.buf, ""
        if not self.content_done:
            self.buf += text
            i = self.buf.find(trig)
            if i < 0:
                keep = next((k for k in range(min(len(trig) - 1, len(self.buf)), 0, -1)
                             if self.buf.endswith(trig[:k])), 0)
                out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                self.content_bytes += len(out.encode("utf-8", "surrogateescape"))
                return out, []
            out, self.buf = self.buf[:i], self.buf[i:]
            self.content_bytes += len(out.encode("utf-8", "surrogateescape"))
            self.block = self.buf
            self.content_done = True
            return out, self._calls()
        self.buf += text
        self.block += text
        return "", self._calls()

    def _calls(self, final: bool = False) -> list[m.ToolCallDelta]:
        pieces = []
        while self.more:
            a = self.buf.find(self.fmt.trigger, self.scan)
            if self.fence != 1 and (a < 0 or self.buf[self.scan:a].strip()):
                return pieces
            after = 0       # where a streamed call's closing tag may begin: after its value
            if self.live is not None:
                pieces += self._growing()
                vs = self.live[4]
                if isinstance(vs, toolxml.Stream):
                    if not vs.ended:
                        return pieces   # toolxml.scan would find the same closing tags
                elif not vs.kind or (vs.kind in "{[" and not vs.whole):
                    return pieces   # a closing tag before the value's end is inside a string
                else:
                    after = self.live[3] + vs.n if vs.kind in "{[" else 0
            try:
                found, end, self.more = toolfmt.scan_fenced(self.buf, self.names, final) if self.fence == 1 \
                    else toolxml.scan(self.fmt, self.buf, a, self.strings) if self.fmt.kind == "xml" \
                    else toolfmt.scan(self.fmt, self.buf, a, after)
            except toolfmt.Incomplete:
                return pieces + self._growing()
            except ValueError:      # not a call after all: the block ends before it
                self.more = False
                if self.live is not None:   # what the client has of it stays a call, in the block
                    pieces += self._close_live([], len(self.buf))
                    self.scan = len(self.buf)
                return pieces
            if self.live is not None:
                pieces += self._close_live(found, end)
                found = found[1:]
            self.scan = end
            for name, args_text in found:
                cid = self.fmt.new_id()
                self.calls.append((cid, name, args_text))
                idx = len(self.calls) - 1
                pieces.append(m.ToolCallDelta(index=idx, id=cid, name=name))
                for k in range(0, len(args_text), 64):   # argument fragments, as OpenAI streams them
                    pieces.append(m.ToolCallDelta(index=idx, arguments=args_text[k:k + 64]))
        return pieces

    def _partial(self):
        """The pattern of a call open after its name, or None where calls are not streamed
        (an array of calls parses whole)."""
        if self.fence == 1:
            return toolfmt.FENCED_PARTIAL if self.grow_fenced else None
        return self.fmt.partial() if self.grow and self.fmt.kind not in ("array", "xml") else None

    def _growing(self) -> list[m.ToolCallDelta]:
        """The pieces of the open call that are new: its head once its name is whole, then
        its arguments as far as they are surely inside their JSON value."""
        if self.fmt.kind == "xml" and self.fence != 1:
            return self._growing_xml()
        pieces = []
        if self.live is None:
            pat = self._partial()
            mt = pat.match(self.buf, self.scan) if pat is not None else None
            if mt is None or (self.fence == 1 and mt.group(1) not in self.names):
                return []
            self.live = [len(self.calls), self.fmt.new_id(), mt.group(1), mt.start(2), toolfmt.ValueScan(), ""]
            pieces.append(m.ToolCallDelta(index=self.live[0], id=self.live[1], name=self.live[2]))
        idx, _, _, start, vs, sent = self.live
        text = self.buf[start:start + vs.feed(self.buf[start:])].lstrip()
        if len(text) > len(sent):
            pieces.append(m.ToolCallDelta(index=idx, arguments=text[len(sent):]))
            self.live[5] = text
        return pieces

    def _growing_xml(self) -> list[m.ToolCallDelta]:
        """As _growing, for XML bodies: the head once the function tag is whole, then the
        arguments' JSON as toolxml.Stream builds it."""
        pieces = []
        if self.live is None:
            mt = toolxml.head(self.fmt).match(self.buf, self.scan) if self.grow else None
            if mt is None:
                return []
            name = mt.group(1)
            self.live = [len(self.calls), self.fmt.new_id(), name, mt.end(),
                         toolxml.Stream(self.fmt, self.strings.get(name, frozenset()), mt.end()), ""]
            pieces.append(m.ToolCallDelta(index=self.live[0], id=self.live[1], name=name))
        idx, sent, text = self.live[0], self.live[5], self.live[4].feed(self.buf)
        if len(text) > len(sent):
            pieces.append(m.ToolCallDelta(index=idx, arguments=text[len(sent):]))
            self.live[5] = text
        return pieces

    def _close_live(self, found, end: int) -> list[m.ToolCallDelta]:
        """The streamed call closed at `end`: its arguments are the text the model wrote (what
        the client has a prefix of), the rest of it sent now."""
        idx, cid, name, start, vs, sent = self.live
        self.live = None
        if isinstance(vs, toolxml.Stream):     # the arguments as parsed (the stream is their prefix)
            args = found[0][1] if found else sent
        else:
            vs.feed(self.buf[start:end])
            args = self.buf[start:start + vs.n].strip() if vs.whole else (found[0][1] if found else sent)
        if found and found[0][0] != name:     # cannot be under constraint; the client has this name
            args = sent
        self.calls.append((cid, name, args))
        rest = args[len(sent):] if args.startswith(sent) else ""
        return [m.ToolCallDelta(index=idx, arguments=rest)] if rest else []

    @property
    def done(self) -> bool:
        """After a closed call, text that cannot open another call, or a format that holds
        no more: the answer is over (small models ramble on after a call; what they add is
        never rendered back)."""
        if not self.calls:
            return False
        rest = self.buf[self.scan:].lstrip()
        if not self.more:
            return True
        return bool(rest) and not rest.startswith(self.fmt.trigger[:len(rest)])

    def close_block(self) -> int:
        """Cut the block after the last closed call (what replay will render); returns the
        generated bytes the answer keeps (content + block, less an opener from the prompt)."""
        self.block = self.buf = self.buf[:self.scan]
        self.closed = True
        return self.content_bytes + len(self.block.encode("utf-8", "surrogateescape")) - self.opened_bytes

    def flush(self) -> str:
        """At the end: content still held back, or the block as text if no call parsed. A call
        left open (the token limit) whose name is complete becomes `cut` (id, name, the
        arguments so far; once they are a whole JSON value, that value without the wrapper's
        closing text the limit cut after it), as OpenAI returns a truncated call; the opener the prompt ended with
        is never returned as text."""
        if not self.content_done:
            out, self.buf = self.buf, ""
            return out
        if self.fence == 1 and self.more:      # a fenced call may end without its closing fence
            self.late = self._calls(final=True)
        tail = self.buf[self.scan:]
        if self.fmt.kind == "xml" and self.fence != 1:
            c = toolxml.cut(self.fmt, tail, self.strings) if self.more else None
            if c is not None and self.live is not None:
                idx, cid, name, _, _, sent = self.live
                self.live = None
                self.cut = (cid, name, c[1], idx, len(sent) if c[1].startswith(sent) else len(c[1]))
                return ""
            if c is not None:
                self.cut = (self.fmt.new_id(), c[0], c[1], len(self.calls), -1)
                return ""
            return "" if self.calls else (self.block[len(self.opened):] if self.block.startswith(self.opened)
                                          else self.block)
        partial = toolfmt.FENCED_PARTIAL if self.fence == 1 else self.fmt.partial()
        m_ = partial.match(tail) if self.more else None
        if m_ is not None:
            args = toolfmt.whole_value(m_.group(2)).lstrip()
            if self.live is not None:
                idx, cid, name, _, _, sent = self.live
                self.live = None
                self.cut = (cid, name, args, idx, len(sent) if args.startswith(sent) else len(args))
            else:
                self.cut = (self.fmt.new_id(), m_.group(1), args, len(self.calls), -1)
            return ""
        if not self.calls:
            return self.block[len(self.opened):] if self.block.startswith(self.opened) else self.block
        return ""

    def cut_pieces(self) -> list[m.ToolCallDelta]:
        """After flush(): the pieces of a call it closed, or of the call the limit cut (less
        what was streamed of it)."""
        if self.cut is None:
            return self.late
        cid, name, args, idx, sent = self.cut
        head = [m.ToolCallDelta(index=idx, id=cid, name=name)] if sent < 0 else []
        args = args[max(sent, 0):]
        return head + [m.ToolCallDelta(index=idx, arguments=args[k:k + 64]) for k in range(0, len(args), 64)]
