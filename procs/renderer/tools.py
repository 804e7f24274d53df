"""Tool calls: rendering tools into the prompt, parsing generated calls, and exact replay.

Format (one for every model whose template has no tool syntax of its own): the system
message lists the tools as JSON, one per line, inside <tools></tools>; a call is
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; results come back as
`tool` messages. The tool list renders first, so it belongs to the shared prefix.
Replay invariant: for a generated answer, content + block == the exact sampled text, where
content is what we returned before the first <tool_call> and block the rest; every id of
that answer maps to its block, and rendering content + block reproduces the bytes the
KV state was computed from.
"""
from __future__ import annotations

import collections
import json
import re
import secrets

from common import kvfile
from common import messages as m

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# an open call whose name is complete: the arguments so far (a call cut by the token limit)
PARTIAL = re.compile(r'\s*<tool_call>\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.-]+)"\s*,\s*"arguments"\s*:\s*(.*)\Z', re.S)

TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query. "
                "The functions are listed in <tools></tools>, one JSON object per line:\n<tools>\n")
TOOLS_FOOTER = ("\n</tools>\n\nTo call a function, answer with a JSON object holding its name and "
                "arguments inside <tool_call></tool_call> tags:\n" + OPEN +
                '\n{"name": <function-name>, "arguments": <args-json-object>}\n' + CLOSE)


def new_id() -> str:
    return "call_" + secrets.token_hex(16)


def tools_text(tools: list[dict]) -> str:
    lines = [json.dumps(t, ensure_ascii=False, sort_keys=False) for t in tools]
    return TOOLS_HEADER + "\n".join(lines) + TOOLS_FOOTER


def call_json(name: str, arguments: str) -> str:
    """A call rendered from the client's JSON (no replay): arguments re-serialized compactly
    in our own spacing, since the client's spacing is arbitrary anyway."""
    try:
        args = json.loads(arguments) if arguments.strip() else {}
        text = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    except (json.JSONDecodeError, RecursionError):   # not JSON, or nested too deep: as a string
        text = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f'{OPEN}\n{text}\n{CLOSE}'


def opener(choice) -> str:
    """Text appended to the generation prompt so the model completes a call."""
    if choice == "required":
        return OPEN + "\n"
    if isinstance(choice, dict):
        return OPEN + '\n{"name": ' + json.dumps(choice["function"]["name"]) + ', "arguments": '
    return ""


class ToolMemory:
    """id -> exact sampled block bytes, least recently used dropped beyond max_ids; ids
    missing here are looked up in the cache files' KTM sections, file by file as the
    persister's index names them (each file's section read once)."""

    def __init__(self, max_ids: int, kv_dir: str):
        self.max_ids, self.kv_dir = max_ids, kv_dir
        self.mem: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self.disk: dict[str, bytes] = {}
        self.files_read: set[str] = set()

    def remember(self, ids: list[str], block: bytes) -> None:
        for i in ids:
            self.mem[i] = block
            self.mem.move_to_end(i)
        while len(self.mem) > self.max_ids:
            self.mem.popitem(last=False)

    def get(self, i: str) -> bytes | None:
        b = self.mem.get(i)
        if b is not None:
            self.mem.move_to_end(i)
        return b

    def from_disk(self, i: str, index_sha1s) -> bytes | None:
        if not self.kv_dir:
            return None
        if i not in self.disk:
            for sha1 in index_sha1s:
                if sha1 in self.files_read:
                    continue
                self.files_read.add(sha1)
                try:
                    ktm = kvfile.read_ktm(kvfile.entry_path(self.kv_dir, sha1), self.max_ids)
                except (OSError, kvfile.KVFileError):
                    continue
                self.disk.update(ktm)
                while len(self.disk) > self.max_ids:   # oldest files' ids go first
                    self.disk.pop(next(iter(self.disk)))
                if i in self.disk:
                    break
        b = self.disk.get(i)
        if b is not None:
            self.remember([i], b)
        return b


class Rendered:
    """Counts of how each assistant tool call of a request was rendered (for the trace)."""

    def __init__(self):
        self.memory = self.disk = self.json = self.missing = 0

    def line(self) -> str:
        return (f"tool calls: {self.memory} replayed from memory, {self.disk} from disk, "
                f"{self.json} rendered from JSON ({self.missing} ids unknown)")


def prepare_messages(msgs: list[dict], tools: list[dict], memory: ToolMemory | None,
                     index_sha1s, stats: Rendered) -> list[dict]:
    """The messages as the template sees them: tools in the system message, assistant tool
    calls as exact replayed blocks (or JSON), tool results as `tool` messages."""
    out = [dict(x) for x in msgs]
    if tools:
        block = tools_text(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = (out[0]["content"] + "\n\n" + block) if out[0]["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    for d in out:
        calls = d.pop("tool_calls", None)
        d.pop("tool_call_id", None)
        d.pop("name", None)
        if calls:
            d["content"] = _assistant_calls(d["content"], calls, memory, index_sha1s, stats)
    return out


def _assistant_calls(content: str, calls: list[dict], memory, index_sha1s, stats: Rendered) -> str:
    """content + the calls' exact sampled block when every id is known and they share one
    block; else content + the calls rendered from the client's JSON."""
    blocks, hits = [], {"memory": 0, "disk": 0}
    for c in calls:
        b = None
        if memory is not None:
            b = memory.get(c["id"])
            if b is not None:
                hits["memory"] += 1
            else:
                b = memory.from_disk(c["id"], index_sha1s)
                hits["disk"] += b is not None
                stats.missing += b is None
        blocks.append(b)
    if all(b is not None for b in blocks) and len(set(blocks)) == 1:
        stats.memory += hits["memory"]
        stats.disk += hits["disk"]
        return content + blocks[0].decode("utf-8", "surrogateescape")
    stats.json += len(calls)
    js = "\n".join(call_json(c["function"]["name"], c["function"]["arguments"]) for c in calls)
    return (content + "\n" + js) if content else js


class CallParser:
    """Splits generated text into content and tool calls, incrementally. Text that might
    open a call is held back; a call is emitted when its closing tag arrives."""

    def __init__(self, opened: str = ""):
        self.cut: tuple[str, str, str] | None = None    # a call the token limit cut, from flush()
        self.content_done = bool(opened)
        self.buf = opened            # text since the first OPEN (the block), or held content
        self.block = opened          # the whole block text so far
        self.calls: list[tuple[str, str, str]] = []   # (id, name, arguments)
        self.scan = 0
        self.closed = False          # close_block() ran: nothing more is taken
        self.content_bytes = 0       # UTF-8 bytes of the content returned so far
        self.opened = opened
        self.opened_bytes = len(opened.encode())   # the opener is prompt, not generated

    def push(self, text: str) -> tuple[str, list[m.ToolCallDelta]]:
        """(content text to emit, call pieces to emit)."""
        if self.closed:
            return "", []
        if not self.content_done:
            self.buf += text
            i = self.buf.find(OPEN)
            if i < 0:
                keep = next((k for k in range(min(len(OPEN) - 1, len(self.buf)), 0, -1)
                             if self.buf.endswith(OPEN[:k])), 0)
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

    def _calls(self) -> list[m.ToolCallDelta]:
        pieces = []
        while True:
            a = self.buf.find(OPEN, self.scan)
            if a < 0:
                return pieces
            b = self.buf.find(CLOSE, a)
            if b < 0:
                return pieces
            body = self.buf[a + len(OPEN):b].strip()
            self.scan = b + len(CLOSE)
            try:
                obj = json.loads(body)
                name = obj["name"]
                args = obj.get("arguments", {})
                if not isinstance(name, str):
                    raise TypeError
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                continue
            args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            cid = new_id()
            self.calls.append((cid, name, args_text))
            idx = len(self.calls) - 1
            pieces.append(m.ToolCallDelta(index=idx, id=cid, name=name))
            for k in range(0, len(args_text), 64):   # argument fragments, as OpenAI streams them
                pieces.append(m.ToolCallDelta(index=idx, arguments=args_text[k:k + 64]))

    @property
    def done(self) -> bool:
        """After a closed call, text that cannot open another call: the answer is over (small
        models ramble on after a call; what they add is never rendered back)."""
        if not self.calls:
            return False
        rest = self.buf[self.scan:].lstrip()
        return bool(rest) and not rest.startswith(OPEN[:len(rest)])

    def close_block(self) -> int:
        """Cut the block after the last closed call (what replay will render); returns the
        generated bytes the answer keeps (content + block, less an opener from the prompt)."""
        self.block = self.buf = self.buf[:self.scan]
        self.closed = True
        return self.content_bytes + len(self.block.encode("utf-8", "surrogateescape")) - self.opened_bytes

    def flush(self) -> str:
        """At the end: content still held back, or the block as text if no call parsed. A call
        left open (the token limit) whose name is complete becomes `cut` (id, name, the
        arguments so far), as OpenAI returns a truncated call; the opener the prompt ended with
        is never returned as text."""
        if not self.content_done:
            out, self.buf = self.buf, ""
            return out
        tail = self.buf[self.scan:]
        m_ = PARTIAL.match(tail)
        if m_ is not None:
            self.cut = (new_id(), m_.group(1), m_.group(2))
            return ""
        if not self.calls:
            return self.block[len(self.opened):] if self.block.startswith(self.opened) else self.block
        return ""

    def cut_pieces(self) -> list[m.ToolCallDelta]:
        if self.cut is None:
            return []
        cid, name, args = self.cut
        idx = len(self.calls)
        return [m.ToolCallDelta(index=idx, id=cid, name=name)] + [
            m.ToolCallDelta(index=idx, arguments=args[k:k + 64]) for k in range(0, len(args), 64)]
