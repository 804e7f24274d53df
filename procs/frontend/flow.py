"""The one flow of a generating request, under every API (chat and legacy completions,
Responses, Messages): read the body, parse it into a GenerateRequest, submit it, and turn
the events into one JSON answer or a stream of server-sent events.

Knows HTTP, ASGI and the wire events; nothing of tokens. An API is an `Endpoint` subclass
that gives three things: `parse` (body -> Job), `collector` (events -> the whole answer)
and `shaper` (events -> SSE). The flow's invariants, the same for all of them:
- a streamed answer's HTTP status waits for the first event: Accepted -> 200 and SSE,
  Failed -> that error as a plain HTTP error;
- a client that leaves, or a stream that ends without Finished or Failed, cancels the
  request in the renderer (its slot, its queue place);
- an idle stream gets the API's keepalive every KEEPALIVE_S.
"""
from __future__ import annotations

import logging
import time
from typing import Protocol

import falcon
import falcon.asgi
import msgspec

from common.messages import Accepted, Delta, Failed, Finished, GenerateRequest, Started
from procs.frontend.backend import new_rid
from procs.frontend.errors import ApiError, bad, from_failed
from procs.frontend.fields import check_model
from procs.frontend.stream import DISCONNECTED, END, TIMEOUT, Pump, Receive

log = logging.getLogger("web")

KEEPALIVE_S = 2.0           # an SSE keepalive after this long without an event
RECEIVE_KEY = "ricordo.receive"
NO_ANSWER = "the model server ended the request without an answer"


def encode(obj) -> bytes:
    return msgspec.json.encode(obj)


def sse(event: str | None, obj) -> falcon.asgi.SSEvent:
    return falcon.asgi.SSEvent(event=event, data=encode(obj))


class App(falcon.asgi.App):
    """falcon's ASGI app, with `receive` shared so responders can watch for a disconnect."""

    async def __call__(self, scope, receive, send):  # type: ignore[override]
        if scope.get("type") != "http":
            return await super().__call__(scope, receive, send)
        rcv = Receive(receive)
        scope[RECEIVE_KEY] = rcv
        try:
            await super().__call__(scope, rcv, send)
        finally:
            rcv.close()


async def read_json(req: falcon.asgi.Request, limit: int) -> dict:
    n = req.content_length
    if n is not None and n > limit:
        raise ApiError(413, f"the request body ({n} bytes) exceeds the limit of {limit} bytes",
                       code="request_too_large")
    buf = bytearray()
    async for chunk in req.stream:
        buf += chunk
        if len(buf) > limit:
            raise ApiError(413, f"the request body exceeds the limit of {limit} bytes", code="request_too_large")
    if not buf:
        raise bad(None, "the request body is empty; expected a JSON object")
    try:
        body = msgspec.json.decode(bytes(buf))
    except (msgspec.DecodeError, RecursionError) as e:
        raise bad(None, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    return body


class Job:
    """A parsed request: the wire request, whether to stream, and what the shapes need."""

    def __init__(self, req: GenerateRequest, stream: bool, **info):
        self.req, self.stream, self.info = req, stream, info


class Collector(Protocol):
    def add(self, ev: Delta) -> None: ...
    def result(self, fin: Finished) -> dict: ...


class Shaper(Protocol):
    """Each method gives the SSEvents to send, in order."""
    def start(self) -> list: ...
    def started(self, ev: Started) -> list: ...
    def delta(self, ev: Delta) -> list: ...
    def finish(self, fin: Finished) -> list: ...
    def fail(self, status: int, message: str, err_type: str, code: str | None, param: str | None) -> list: ...
    def keepalive(self) -> list: ...


class Endpoint:
    """POST of one generating API over the backend (anything with async submit/cancel)."""

    def __init__(self, backend, settings, model_id: str):
        self.backend, self.settings, self.model_id = backend, settings, model_id

    def parse(self, body: dict, rid: str) -> Job:
        raise NotImplementedError

    def collector(self, job: Job) -> Collector:
        raise NotImplementedError

    def shaper(self, job: Job, accepted: Accepted | None) -> Shaper:
        raise NotImplementedError

    async def on_post(self, req, resp) -> None:
        received = time.monotonic()
        body = await read_json(req, self.settings.max_body_bytes)
        check_model(body, self.model_id, self.settings.strict_model_names)
        job = self.parse(body, new_rid())
        job.req = msgspec.structs.replace(job.req, received=received)
        pump = Pump(self.backend.submit(job.req), req.scope.get(RECEIVE_KEY))
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
        """Raise the HTTP error an event before the answer means."""
        if ev is DISCONNECTED:
            await self._cancel(rid)
            raise ApiError(499, "the client closed the connection", code="client_closed")
        if ev is END:
            raise ApiError(502, NO_ANSWER, err_type="server_error")
        if isinstance(ev, Failed):
            raise from_failed(ev)

    async def _whole(self, resp, job: Job, pump: Pump) -> None:
        col = self.collector(job)
        while True:
            ev = await pump.next()
            await self._check(ev, job.req.rid)
            if isinstance(ev, Delta):
                col.add(ev)
            elif isinstance(ev, Finished):
                resp.content_type = falcon.MEDIA_JSON
                resp.data = encode(col.result(ev))
                return

    async def _start_stream(self, resp, job: Job, pump: Pump) -> bool:
        ev = await pump.next()
        await self._check(ev, job.req.rid)
        accepted = ev if isinstance(ev, Accepted) else None
        resp.set_header("Cache-Control", "no-cache")
        resp.set_header("X-Accel-Buffering", "no")
        resp.sse = self._events(pump, job, self.shaper(job, accepted), () if accepted else (ev,))
        return True

    async def _events(self, pump: Pump, job: Job, shaper: Shaper, early: tuple):
        finished = False
        try:
            for e in shaper.start():
                yield e
            pending = list(early)
            while True:
                ev = pending.pop(0) if pending else await pump.next(KEEPALIVE_S)
                if ev is TIMEOUT:
                    out = shaper.keepalive()
                elif ev is DISCONNECTED:
                    return
                elif ev is END:
                    finished = True
                    out = shaper.fail(502, NO_ANSWER, "server_error", None, None)
                elif isinstance(ev, Started):
                    out = shaper.started(ev)
                elif isinstance(ev, Delta):
                    out = shaper.delta(ev)
                elif isinstance(ev, Finished):
                    finished = True
                    out = shaper.finish(ev)
                elif isinstance(ev, Failed):
                    finished = True
                    out = shaper.fail(ev.status, ev.message, ev.err_type, ev.code, ev.param)
                else:
                    continue
                for e in out:
                    yield e
                if finished:
                    return
        except Exception:
            log.exception("stream %s", job.req.rid)
            for e in shaper.fail(500, "internal server error", "server_error", None, None):
                yield e
        finally:
            if not finished:
                await self._cancel(job.req.rid)
            await pump.aclose()
