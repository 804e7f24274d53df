"""Tool calls: rendering tools into the prompt, parsing generated calls, and exact replay.

The call syntax is the model family's (procs/renderer/toolfmt.py). For a template with no
tool syntax of its own (the generic format) the system message lists the tools as JSON, one
per line, inside <tools></tools>, and a call is `<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>`; a template that speaks tools (Qwen, Llama 3.x, Mistral) gets them as
`tools=` and renders calls and results itself. The tool list renders first, so it belongs
to the shared prefix.
Replay invariant: for a generated answer, content + block == the exact sampled text, where
content is what we returned before the first call and block the rest; every id of that
answer maps to its block, and rendering content + block as the assistant's content
reproduces the bytes the KV state was computed from (whichever the format).
"""
from __future__ import annotations

import collections
import json

from common import kvfile
from procs.renderer import harmony
from procs.renderer.callparser import CallParser  # noqa: F401 (the parser of generated calls)
from procs.renderer.toolfmt import GENERIC, Format

OPEN, CLOSE = "<tool_call>", "</tool_call>"

TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query. "
                "The functions are listed in <tools></tools>, one JSON object per line:\n<tools>\n")
TOOLS_FOOTER = ("\n</tools>\n\nTo call a function, answer with a JSON object holding its name and "
                "arguments inside <tool_call></tool_call> tags:\n" + OPEN +
                '\n{"name": <function-name>, "arguments": <args-json-object>}\n' + CLOSE)


def tools_text(tools: list[dict]) -> str:
    lines = [json.dumps(t, ensure_ascii=False, sort_keys=False) for t in tools]
    return TOOLS_HEADER + "\n".join(lines) + TOOLS_FOOTER


def _args_value(arguments: str):
    """The client's arguments text as a JSON value (a string when it is not JSON)."""
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except (json.JSONDecodeError, RecursionError):   # not JSON, or nested too deep: as a string
        return arguments


def call_json(name: str, arguments: str) -> str:
    """A call of the generic format rendered from the client's JSON (no replay): arguments
    re-serialized compactly in our own spacing, since the client's spacing is arbitrary anyway
    (a native format's template renders its calls itself)."""
    return GENERIC.block([(name, json.dumps(_args_value(arguments), ensure_ascii=False))])


def opener(choice) -> str:
    """The generic format's call opener (Format.opener) for a tool_choice."""
    return GENERIC.opener(choice)


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
        self.reset()

    def reset(self) -> None:
        self.memory = self.disk = self.json = self.missing = 0
        # Harmony: marker -> the sampled answer that replaces the message rendered around it
        self.replays: dict[str, str] = {}

    def line(self) -> str:
        return (f"tool calls: {self.memory} replayed from memory, {self.disk} from disk, "
                f"{self.json} rendered from JSON ({self.missing} ids unknown)")


def prepare_messages(msgs: list[dict], tools: list[dict], memory: ToolMemory | None,
                     index_sha1s, stats: Rendered, fmt: Format = GENERIC) -> list[dict]:
    """The messages as the template sees them. Generic format: tools in the system message,
    assistant calls written into the content, results as `tool` messages. A native format's
    template gets the tools itself (render(tools=...)) and the calls as `tool_calls` with
    their arguments as JSON values. Either way an answer whose ids are known is its exact
    sampled text, as content."""
    out = [dict(x) for x in msgs]
    if tools and not fmt.native:
        block = tools_text(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = (out[0]["content"] + "\n\n" + block) if out[0]["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    for d in out:
        calls = d.pop("tool_calls", None)
        if not fmt.native:
            d.pop("tool_call_id", None)
            d.pop("name", None)
        if calls:
            exact = _exact(calls, memory, index_sha1s, stats)
            if exact is not None and fmt.kind == "harmony":
                # the template renders the call around a marker; harmony.replay puts the
                # sampled answer (its reasoning and header as written) in that message's place
                mark = harmony.marker(len(stats.replays))
                stats.replays[mark] = exact
                d["content"] = ""
                d["tool_calls"] = [{"id": calls[0]["id"], "type": "function",
                                    "function": {"name": calls[0]["function"]["name"], "arguments": mark}}]
            elif exact is not None:
                d["content"] += exact
            elif fmt.native:
                stats.json += len(calls)
                d["tool_calls"] = [{"id": c["id"], "type": "function",
                                    "function": {"name": c["function"]["name"],
                                                 "arguments": _args_value(c["function"]["arguments"])}}
                                   for c in calls]
            else:
                stats.json += len(calls)
                js = "\n".join(call_json(c["function"]["name"], c["function"]["arguments"]) for c in calls)
                d["content"] = (d["content"] + "\n" + js) if d["content"] else js
    return out


def _exact(calls: list[dict], memory, index_sha1s, stats: Rendered) -> str | None:
    """The calls' exact sampled block when every id is known and they share one block."""
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
        return blocks[0].decode("utf-8", "surrogateescape")
    return None
