"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}.

Knows HTTP statuses and the OpenAI error schema; nothing of tokens. Every error the web
process answers, falcon's own (404 route, 405 method) included, goes through here; an
unexpected exception becomes a 500 in the same shape, never a traceback.
"""
from __future__ import annotations

import logging

import falcon
import msgspec

from common.messages import Failed

log = logging.getLogger("web")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 405: "invalid_request_error", 409: "invalid_request_error",
          413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error"}


def error_type(status: int) -> str:
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


class ApiError(falcon.HTTPError):
    """An HTTP error with the OpenAI fields; raise it anywhere in a responder."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 err_type: str | None = None, headers: dict | None = None, prompt_tokens: int = 0,
                 limit: int = 0):
        super().__init__(status, title=message, headers=headers)
        self.prompt_tokens, self.limit = prompt_tokens, limit      # context_length_exceeded
        self.message = message
        self.param = param
        self.oa_code = code
        self.err_type = err_type or error_type(status)

    def body(self) -> dict:
        return error_body(self.message, self.err_type, self.param, self.oa_code)


def error_body(message: str, err_type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def bad(param: str | None, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


RETRY_AFTER_S = "2"   # a full queue (429) or an unavailable process (503) is worth a retry


def from_failed(ev: Failed) -> ApiError:
    headers = {"Retry-After": RETRY_AFTER_S} if ev.status in (429, 503) else None
    return ApiError(ev.status, ev.message, param=ev.param, code=ev.code, err_type=ev.err_type,
                    headers=headers, prompt_tokens=ev.prompt_tokens, limit=ev.limit)


def _falcon_body(req: falcon.Request, ex: falcon.HTTPError) -> dict:
    status = ex.status_code
    if isinstance(ex, ApiError):
        return ex.body()
    if isinstance(ex, falcon.HTTPRouteNotFound) or (status == 404 and not ex.description):
        message = f"Invalid URL ({req.method} {req.path})"
    elif isinstance(ex, falcon.HTTPMethodNotAllowed):
        message = f"Method {req.method} is not allowed for {req.path}"
    else:
        message = ex.description or ex.title or "error"
    return error_body(message, error_type(status), None, None)


# Paths whose errors take another API's shape, registered by that API (anthropic.register):
# (the path is ours, body(status, message)); every other path gets OpenAI's shape.
SHAPES: list[tuple] = []


def _shape(req):
    return next((body for ours, body in SHAPES if ours(req)), None)


def message(req: falcon.Request, ex: falcon.HTTPError) -> str:
    return _falcon_body(req, ex)["error"]["message"]


def serialize_error(req: falcon.Request, resp: falcon.Response, ex: falcon.HTTPError) -> None:
    resp.content_type = falcon.MEDIA_JSON
    shape = _shape(req)
    resp.data = msgspec.json.encode(shape(ex, req) if shape else _falcon_body(req, ex))


async def handle_unexpected(req, resp, ex, params) -> None:
    log.exception("unexpected error in %s %s", req.method, req.path, exc_info=ex)
    resp.status = 500
    resp.content_type = falcon.MEDIA_JSON
    shape = _shape(req)
    resp.data = msgspec.json.encode(shape(falcon.HTTPInternalServerError(description="internal server error"), req)
                                    if shape else error_body("internal server error", "server_error"))


def install(app) -> None:
    app.set_error_serializer(serialize_error)
    app.add_error_handler(Exception, handle_unexpected)
