"""The web process: an OpenAI-compatible HTTP API on falcon's ASGI app, run by gunicorn

    gunicorn -k asgi --asgi-loop uvloop 'procs.frontend.app:get_app()'

Knows HTTP; nothing of tokens. The routes: the four generating APIs (completions.py for
chat and legacy completions, responses.py, anthropic.py), each an Endpoint over the one
request flow in flow.py; the model list, /health and /metrics here, with the middleware
(API key, lifespan, request counts).
"""
from __future__ import annotations

import hmac
import time

import falcon
import falcon.asgi

from common.config import Settings
from common import metrics
from common.models import served_model_id
from procs.frontend import anthropic, fields, responses
from procs.frontend.backend import NOT_ANSWERING, ZmqBackend
from procs.frontend.completions import Completions
from procs.frontend.errors import ApiError, install
from procs.frontend.flow import App, encode

HEALTH_TIMEOUT_S = 1.0


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


async def ready_health(backend, slots: bool = False):
    """The renderer's Health, or 503 while the server is not ready."""
    h = await backend.health(timeout=HEALTH_TIMEOUT_S, slots=slots)
    if not h.ready:
        raise ApiError(503, f"the model is not ready yet ({h.detail})", code="model_not_ready",
                       err_type="server_error", headers={"Retry-After": "1"})
    return h


class Models:
    """The model list answers only when the server is ready (as /health), since clients and
    harnesses take its first answer as the sign to send requests. A request with an
    `anthropic-version` header (the Anthropic client's) gets Anthropic's list shape. Unless
    --strict-model-names, any name is served by the loaded model, so retrieving any name
    answers a card of that name (as requests naming it are answered)."""

    def __init__(self, model_id: str, created: int, backend, strict: bool = False):
        self.card = {"id": model_id, "object": "model", "created": created, "owned_by": "ricordo"}
        self.backend, self.strict = backend, strict

    async def _ready(self) -> None:
        await ready_health(self.backend)

    def _anthropic(self, model_id: str) -> dict:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.card["created"]))
        return {"type": "model", "id": model_id, "display_name": model_id, "created_at": when}

    async def on_get(self, req, resp) -> None:
        await self._ready()
        if req.get_header("anthropic-version"):
            mid = self.card["id"]
            body = {"data": [self._anthropic(mid)], "has_more": False, "first_id": mid, "last_id": mid}
        else:
            body = {"object": "list", "data": [self.card]}
        resp.data = encode(body)
        resp.content_type = falcon.MEDIA_JSON

    async def on_get_one(self, req, resp, model_id: str) -> None:
        if model_id != self.card["id"] and self.strict:
            raise ApiError(404, f"The model `{model_id}` does not exist or you do not have access to it.",
                           param="model", code="model_not_found")
        await self._ready()
        body = self._anthropic(model_id) if req.get_header("anthropic-version") else {**self.card, "id": model_id}
        resp.data = encode(body)
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
        resp.data = encode(body)


class SlotsResource:
    """GET /slots (llama.cpp's endpoint, in ricordo's terms): one object per resident session,
    most recently used first, then one per running job whose session is new. `id` is the
    session (null for a new one until its job ends), `is_processing` whether a job runs in
    it, `n_tokens` what it holds, `on_disk_tokens` the longest checkpoint of a prefix of it
    (what survives it leaving memory without a write). No prompt text. With
    ?fail_on_no_slot=1, 503 while --parallel jobs run (no slot free)."""

    def __init__(self, backend, enabled: bool):
        self.backend, self.enabled = backend, enabled

    async def on_get(self, req, resp) -> None:
        if not self.enabled:
            raise ApiError(501, "This server does not support the slots endpoint (started with --no-slots).",
                           code="not_supported", err_type="server_error")
        h = await ready_health(self.backend, slots=True)
        busy = sum(1 for x in h.slots if x.rid)
        if req.get_param_as_bool("fail_on_no_slot") and busy >= h.parallel:
            raise ApiError(503, f"no slot available: {busy} of {h.parallel} requests run, {h.queued} wait",
                           code="no_slot_available", err_type="server_error", headers={"Retry-After": "1"})
        resp.content_type = falcon.MEDIA_JSON
        resp.data = encode([{"id": x.sid or None, "n_ctx": h.n_ctx, "is_processing": bool(x.rid),
                             "id_task": x.rid or None, "n_tokens": x.n_tokens, "n_decoded": x.n_decoded,
                             "on_disk_tokens": x.on_disk} for x in h.slots])


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
    fields.set_defaults(settings)
    middleware = [Lifespan(backend), CountRequests()]
    if settings.api_key:
        middleware.append(Auth(settings.api_key))
    app = App(middleware=middleware)
    app.req_options.strip_url_path_trailing_slash = True
    install(app)
    models = Models(model_id, int(time.time()), backend, settings.strict_model_names)
    app.add_route("/v1/chat/completions", Completions(backend, settings, model_id, "chat"))
    app.add_route("/v1/completions", Completions(backend, settings, model_id, "completion"))
    app.add_route("/v1/models", models)
    app.add_route("/v1/models/{model_id:path}", models, suffix="one")
    app.add_route("/health", HealthResource(backend, model_id))
    responses.register(app, backend, settings, model_id)
    anthropic.register(app, backend, settings, model_id)
    app.add_route("/slots", SlotsResource(backend, settings.slots))
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
