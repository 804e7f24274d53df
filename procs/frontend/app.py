"""The web process: an OpenAI-compatible HTTP API on falcon's ASGI app, run by gunicorn

    gunicorn -k asgi --asgi-loop uvloop 'procs.frontend.app:get_app()'

Knows HTTP and the OpenAI schema; knows nothing of tokens. It validates requests, hands
them to the renderer through the backend (procs/frontend/backend.py) and turns the events
that come back into JSON or server-sent events.
"""
from __future__ import annotations

import hmac
import logging
import time

import falcon
import falcon.asgi
import msgspec

from common.config import Settings
from common import metrics
from common.messages import Accepted, Delta, Failed, Finished
from common.models import served_model_id
from procs.frontend import shape
from procs.frontend.backend import NOT_ANSWERING, ZmqBackend, new_rid
from procs.frontend.errors import ApiError, bad, error_body, failed_body, from_failed, install
from procs.frontend.schema import Parsed, parse_chat, parse_completion
from procs.frontend.stream import DISCONNECTED, END, TIMEOUT, Pump, Receive

log = logging.getLogger("web")

KEEPALIVE_S = 2.0           # an SSE comment after this long without an event
HEALTH_TIMEOUT_S = 1.0
RECEIVE_KEY = "ricordo.receive"
DONE = falcon.asgi.SSEvent(data=b"[DONE]")


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


class Auth:
    def __init__(self, key: str):
        self.key = key.encode()

    async def process_request(self, req, resp) -> None:
        if req.path == "/health":
            return
        scheme, _, token = (req.get_header("Authorization") or "").partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else None
        if token is None:
            token = req.get_header("x-api-key")       # Anthropic's clients
        if token is None or not hmac.compare_digest(token.encode(), self.key):
            raise ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' "
                           "(or 'x-api-key: <key>').",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


class Lifespan:
    def __init__(self, backend):
        self.backend = backend

    async def process_startup(self, scope, event) -> None:
        start = getattr(self.backend, "start", None)
        if start is not None:
            await start()

    async def process_shutdown(self, scope, event) -> None:
        close = getattr(self.backend, "close", None)
        if close is not None:
            await close()


class Generate:
    """POST /v1/chat/completions and /v1/completions."""

    def __init__(self, backend, settings: Settings, model_id: str, kind: str):
        self.backend, self.settings, self.model_id, self.kind = backend, settings, model_id, kind

    async def on_post(self, req, resp) -> None:
        body = await read_json(req, self.settings.max_body_bytes)
        rid = new_rid()
        parse = parse_chat if self.kind == "chat" else parse_completion
        p = parse(body, self.model_id, rid)
        pump = Pump(self.backend.submit(p.req), req.scope.get(RECEIVE_KEY))
        handed_over = False
        try:
            if p.stream:
                handed_over = await self._start_stream(resp, p, pump)
            else:
                await self._whole(resp, p, pump)
        finally:
            if not handed_over:
                await pump.aclose()

    def _ids(self, p: Parsed) -> tuple[str, int]:
        prefix = "chatcmpl-" if self.kind == "chat" else "cmpl-"
        return prefix + p.req.rid, int(time.time())

    async def _cancel(self, rid: str) -> None:
        try:
            await self.backend.cancel(rid)
        except Exception:
            log.exception("cancel %s", rid)

    async def _whole(self, resp, p: Parsed, pump: Pump) -> None:
        col = shape.Collected(legacy=self.kind != "chat")
        want = p.req.logprobs
        while True:
            ev = await pump.next()
            if ev is DISCONNECTED:
                await self._cancel(p.req.rid)
                raise ApiError(499, "the client closed the connection", code="client_closed")
            if ev is END:
                raise ApiError(502, "the model server ended the request without an answer", err_type="server_error")
            if isinstance(ev, Failed):
                raise from_failed(ev)
            if isinstance(ev, Delta):
                col.add(ev, want)
            elif isinstance(ev, Finished):
                cid, created = self._ids(p)
                build = shape.chat_completion if self.kind == "chat" else shape.text_completion
                resp.content_type = falcon.MEDIA_JSON
                resp.data = shape.encode(build(cid, created, self.model_id, col, want, ev.finish_reason, ev.usage))
                return

    async def _start_stream(self, resp, p: Parsed, pump: Pump) -> bool:
        """The HTTP status waits for the first event: Accepted -> 200 and SSE; Failed -> its error."""
        ev = await pump.next()
        if ev is DISCONNECTED:
            await self._cancel(p.req.rid)
            raise ApiError(499, "the client closed the connection", code="client_closed")
        if ev is END:
            raise ApiError(502, "the model server ended the request without an answer", err_type="server_error")
        if isinstance(ev, Failed):
            raise from_failed(ev)
        cid, created = self._ids(p)
        chunks = shape.Chunks(self.kind, cid, created, self.model_id, p.req.logprobs, p.include_usage)
        resp.set_header("Cache-Control", "no-cache")
        resp.set_header("X-Accel-Buffering", "no")
        resp.sse = self._events(pump, p, chunks, () if isinstance(ev, Accepted) else (ev,))
        return True

    async def _events(self, pump: Pump, p: Parsed, chunks: shape.Chunks, early: tuple):
        finished = False
        try:
            first = chunks.first()
            if first is not None:
                yield _data(first)
            pending = list(early)
            while True:
                ev = pending.pop(0) if pending else await pump.next(KEEPALIVE_S)
                if ev is TIMEOUT:
                    yield falcon.asgi.SSEvent(comment="keepalive")
                elif ev is DISCONNECTED:
                    return
                elif ev is END:
                    finished = True
                    yield _data(error_body("the model server ended the request without an answer", "server_error"))
                    return
                elif isinstance(ev, Delta):
                    c = chunks.delta(ev)
                    if c is not None:
                        yield _data(c)
                elif isinstance(ev, Finished):
                    finished = True
                    for c in chunks.final(ev.finish_reason, ev):
                        yield _data(c)
                    if p.include_usage:
                        yield _data(chunks.usage(ev.usage))
                    yield DONE
                    return
                elif isinstance(ev, Failed):
                    finished = True
                    yield _data(failed_body(ev))
                    return
        except Exception:
            log.exception("stream %s", p.req.rid)
            yield _data(error_body("internal server error", "server_error"))
        finally:
            if not finished:
                await self._cancel(p.req.rid)
            await pump.aclose()


def _data(obj) -> falcon.asgi.SSEvent:
    return falcon.asgi.SSEvent(data=shape.encode(obj))


class Models:
    """The model list answers only when the server is ready (as /health), since clients and
    harnesses take its first answer as the sign to send requests."""

    def __init__(self, model_id: str, created: int, backend):
        self.card = {"id": model_id, "object": "model", "created": created, "owned_by": "ricordo"}
        self.backend = backend

    async def _ready(self) -> None:
        h = await self.backend.health(timeout=HEALTH_TIMEOUT_S)
        if not h.ready:
            raise ApiError(503, f"the model is not ready yet ({h.detail})", code="model_not_ready",
                           err_type="server_error", headers={"Retry-After": "1"})

    async def on_get(self, req, resp) -> None:
        await self._ready()
        resp.data = shape.encode({"object": "list", "data": [self.card]})
        resp.content_type = falcon.MEDIA_JSON

    async def on_get_one(self, req, resp, model_id: str) -> None:
        if model_id != self.card["id"]:
            raise ApiError(404, f"The model `{model_id}` does not exist or you do not have access to it.",
                           param="model", code="model_not_found")
        await self._ready()
        resp.data = shape.encode(self.card)
        resp.content_type = falcon.MEDIA_JSON


class HealthResource:
    def __init__(self, backend, model_id: str):
        self.backend, self.model_id = backend, model_id

    async def on_get(self, req, resp) -> None:
        h = await self.backend.health(timeout=HEALTH_TIMEOUT_S)
        resp.content_type = falcon.MEDIA_JSON
        if h.ready:
            body = {"status": "ok", "model": h.model or self.model_id, "n_ctx": h.n_ctx,
                    "device": h.device, "dtype": h.dtype}
        else:
            resp.status = 503
            body = {"status": "unavailable" if h.detail == NOT_ANSWERING else "loading", "detail": h.detail}
        resp.data = shape.encode(body)


class MetricsResource:
    async def on_get(self, req, resp) -> None:
        resp.data, resp.content_type = metrics.exposition()


class CountRequests:
    async def process_response(self, req, resp, resource, req_succeeded) -> None:
        endpoint = req.uri_template or "unknown"
        metrics.M.http_requests.labels(endpoint, req.method, str(resp.status).split()[0]).inc()


def create_app(backend, settings: Settings) -> falcon.asgi.App:
    """The API over `backend` (anything with ZmqBackend's async submit/cancel/health)."""
    model_id = served_model_id(settings.model_id, settings.model)
    middleware = [Lifespan(backend), CountRequests()]
    if settings.api_key:
        middleware.append(Auth(settings.api_key))
    app = App(middleware=middleware)
    app.req_options.strip_url_path_trailing_slash = True
    install(app)
    models = Models(model_id, int(time.time()), backend)
    app.add_route("/v1/chat/completions", Generate(backend, settings, model_id, "chat"))
    app.add_route("/v1/completions", Generate(backend, settings, model_id, "completion"))
    app.add_route("/v1/models", models)
    app.add_route("/v1/models/{model_id:path}", models, suffix="one")
    app.add_route("/health", HealthResource(backend, model_id))
    from procs.frontend import anthropic, responses        # they import this module
    responses.register(app, backend, settings, model_id)
    anthropic.register(app, backend, settings, model_id)
    app.add_route("/metrics", MetricsResource())
    return app


def get_app() -> falcon.asgi.App:
    """gunicorn's entry point: the settings come from RICORDO_* (gunicorn owns argv)."""
    from common.logs import setup
    from common.sockets import run_dir
    settings = Settings.load("web", [])
    setup("web", settings.log_level)
    metrics.init(run_dir(settings))
    return create_app(ZmqBackend(settings), settings)
