"""What the agent APIs (/v1/responses in responses.py, /v1/messages in anthropic.py) share:
typed getters, chat-shaped tools, the run of one request against the backend (the whole
answer, or SSE whose events each API shapes itself) and the outline of an answer as blocks
of text and tool calls.

Both APIs produce a GenerateRequest of kind "chat", so they share the renderer's template,
the KV cache and the exact replay of tool calls with /v1/chat/completions. Knows HTTP and
the wire messages; nothing of tokens.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import falcon
import falcon.asgi

from common.messages import Accepted, Delta, Failed, Finished, GenerateRequest
from procs.frontend import app as app_mod
from procs.frontend.backend import new_rid
from procs.frontend.errors import ApiError, bad, from_failed
from procs.frontend.schema import TOOL_NAME, get_bool, get_int, get_num, json_text  # noqa: F401 (re-exported to the agent APIs)
from procs.frontend.shape import encode
from procs.frontend.stream import DISCONNECTED, END, TIMEOUT, Pump

log = logging.getLogger("web")

def chat_tool(name, description, parameters, at: str, schema_key: str = "parameters", strict=None) -> dict:
    """One tool in the chat shape ({"type": "function", "function": {...}}), keys in the order
    a chat client sends them, so the same tools render (and cache) alike from every API."""
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise bad(f"{at}.name", "a tool needs a 'name' of 1-64 letters, digits, '_', '-', '.'")
    fn: dict = {"name": name}
    if description is not None:
        if not isinstance(description, str):
            raise bad(f"{at}.description", "'description' must be a string")
        fn["description"] = description
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise bad(f"{at}.{schema_key}", f"'{schema_key}' must be a JSON Schema object")
        fn["parameters"] = parameters
    if strict is not None:
        if not isinstance(strict, bool):
            raise bad(f"{at}.strict", "'strict' must be a boolean")
        fn["strict"] = strict
    return {"type": "function", "function": fn}


def named_choice(name, names: set, param: str) -> dict:
    if not isinstance(name, str) or name not in names:
        raise bad(param, f"'{param}' names {name!r}, which is not among the tools")
    return {"type": "function", "function": {"name": name}}


# -- the outline of an answer: blocks of text and of tool calls --------------------------

@dataclass
class Block:
    index: int                      # position among the answer's blocks
    kind: str                       # "text" | "call"
    text: str = ""
    id: str = ""
    name: str = ""
    args: str = ""
    extra: dict = field(default_factory=dict)    # per-API ids


class Outline:
    """Delta events -> ops on blocks: ("open", b), ("text", b, s), ("args", b, s), ("close", b).
    A text block opens with the first text after a call (or at the start); a call block with
    the first piece of a call (the one with id and name); the open block closes when another
    opens or at the end. `raw` gathers the sampled bytes when the request asked for logprobs
    (to tell which stop string ended the answer)."""

    def __init__(self):
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


# -- one request against the backend ------------------------------------------------------

class Job:
    """A parsed request: the wire request, whether to stream, and what the shapes need."""

    def __init__(self, req: GenerateRequest, stream: bool, **info):
        self.req, self.stream, self.info = req, stream, info


class Endpoint:
    """POST of one agent API. Subclasses give parse(body, rid) -> Job, whole(job, outline,
    finished) -> the JSON answer, and shaper(job, accepted) -> the streamed events' shaper
    (see `_events`). The flow is app.Generate's: a streamed answer's HTTP status waits for
    Accepted or Failed; a client that leaves cancels the request."""

    def __init__(self, backend, settings, model_id: str):
        self.backend, self.settings, self.model_id = backend, settings, model_id

    def parse(self, body: dict, rid: str) -> Job:
        raise NotImplementedError

    def whole(self, job: Job, outline: Outline, fin: Finished) -> dict:
        raise NotImplementedError

    def shaper(self, job: Job, accepted: Accepted | None):
        raise NotImplementedError

    async def on_post(self, req, resp) -> None:
        body = await app_mod.read_json(req, self.settings.max_body_bytes)
        job = self.parse(body, new_rid())
        pump = Pump(self.backend.submit(job.req), req.scope.get(app_mod.RECEIVE_KEY))
        handed_over = False
        try:
            if job.stream:
                handed_over = await self._start_stream(resp, job, pump)
            else:
                await self._whole(resp, job, pump)
        finally:
            if not handed_over:
                await pump.aclose()

    async def _cancel(self, rid: str) -> None:
        try:
            await self.backend.cancel(rid)
        except Exception:
            log.exception("cancel %s", rid)

    async def _check(self, ev, rid: str) -> None:
        if ev is DISCONNECTED:
            await self._cancel(rid)
            raise ApiError(499, "the client closed the connection", code="client_closed")
        if ev is END:
            raise ApiError(502, "the model server ended the request without an answer", err_type="server_error")
        if isinstance(ev, Failed):
            raise from_failed(ev)

    async def _whole(self, resp, job: Job, pump: Pump) -> None:
        outline = Outline()
        while True:
            ev = await pump.next()
            await self._check(ev, job.req.rid)
            if isinstance(ev, Delta):
                outline.feed(ev)
            elif isinstance(ev, Finished):
                outline.close()
                resp.content_type = falcon.MEDIA_JSON
                resp.data = encode(self.whole(job, outline, ev))
                return

    async def _start_stream(self, resp, job: Job, pump: Pump) -> bool:
        """The HTTP status waits for the first event: Accepted -> 200 and SSE; Failed -> its error."""
        ev = await pump.next()
        await self._check(ev, job.req.rid)
        accepted = ev if isinstance(ev, Accepted) else None
        resp.set_header("Cache-Control", "no-cache")
        resp.set_header("X-Accel-Buffering", "no")
        resp.sse = self._events(pump, job, self.shaper(job, accepted), () if accepted else (ev,))
        return True

    async def _events(self, pump: Pump, job: Job, shaper, early: tuple):
        """Shaper: start() / ops(ops, outline) / finish(Finished, outline) (closing the outline's
        open block) / fail(status, message, err_type, code, param) / keepalive(), each giving
        a list of SSEvents (keepalive one)."""
        finished = False
        outline = Outline()
        try:
            for e in shaper.start():
                yield e
            pending = list(early)
            while True:
                ev = pending.pop(0) if pending else await pump.next(app_mod.KEEPALIVE_S)
                if ev is TIMEOUT:
                    yield shaper.keepalive()
                elif ev is DISCONNECTED:
                    return
                elif ev is END:
                    finished = True
                    for e in shaper.fail(502, "the model server ended the request without an answer",
                                         "server_error", None, None):
                        yield e
                    return
                elif isinstance(ev, Delta):
                    for e in shaper.ops(outline.feed(ev), outline):
                        yield e
                elif isinstance(ev, Finished):
                    finished = True
                    for e in shaper.finish(ev, outline):
                        yield e
                    return
                elif isinstance(ev, Failed):
                    finished = True
                    for e in shaper.fail(ev.status, ev.message, ev.err_type, ev.code, ev.param):
                        yield e
                    return
        except Exception:
            log.exception("stream %s", job.req.rid)
            for e in shaper.fail(500, "internal server error", "server_error", None, None):
                yield e
        finally:
            if not finished:
                await self._cancel(job.req.rid)
            await pump.aclose()


def sse(event: str, obj) -> falcon.asgi.SSEvent:
    return falcon.asgi.SSEvent(event=event, data=encode(obj))


def parse_json_object(text: str):
    """Tool arguments as an object (Anthropic's `input`): a JSON object as it is; anything
    else, wrapped as {"arguments": value}."""
    try:
        v = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        return {"arguments": text}
    return v if isinstance(v, dict) else {"arguments": v}
