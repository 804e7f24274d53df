"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API over the chat
pipeline. Requests are read in anthropic_request.py; here the answers and the errors.

Usage follows Anthropic: input_tokens counts the prompt tokens not read from the cache,
cache_read_input_tokens those that were (their sum is the whole prompt), from message_start
on (it goes out when the model begins, with the split known); cache_creation_input_tokens is
0 (checkpoints are written by the server on its own).

Errors on these paths come in Anthropic's shape ({"type": "error", "error": {type, message}}),
via `install`; a prompt over the context reads as Anthropic's ("prompt is too long: N tokens
> M maximum"), which is what makes Claude Code compact its conversation. `x-api-key` works
like the Bearer token (see app.Auth); `anthropic-version` and `anthropic-beta` are accepted
and ignored. A trailing assistant message with text is a prefill: the answer continues it
(and does not repeat it), as Anthropic's does. A reasoning model's thinking (Harmony's analysis)
comes as thinking blocks (signature "") when the request enables `thinking`, else not at all.
"""
from __future__ import annotations

import secrets

import falcon

import falcon.asgi

from common.messages import Accepted, Finished, Started
from procs.frontend import errors
from procs.frontend.anthropic_request import parse, to_client_id
from procs.frontend.fields import json_text
from procs.frontend.flow import Endpoint, Job, sse
from procs.frontend.outline import Block, Blocks, Outline, Whole, matched_stop, parse_json_object


PATH = "/v1/messages"

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
          500: "api_error", 502: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


# -- errors --------------------------------------------------------------------------------

def error_type(status: int) -> str:
    return _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def _message(ex: falcon.HTTPError, req) -> str:
    if isinstance(ex, errors.ApiError) and ex.oa_code == "context_length_exceeded" and ex.limit:
        return f"prompt is too long: {ex.prompt_tokens} tokens > {ex.limit} maximum"
    if isinstance(ex, errors.ApiError):
        return f"{ex.param}: {ex.message}" if ex.param and not ex.message.startswith(ex.param) else ex.message
    return errors.message(req, ex)


def error_shape(ex: falcon.HTTPError, req) -> dict:
    """What errors.serialize_error writes for our paths."""
    body = error_body(ex.status_code, _message(ex, req))
    if isinstance(ex, errors.ApiError) and ex.oa_code == "thread_not_found":   # what the SDK looks for
        body["error"]["details"] = {"error_code": "thread_not_found"}
    return body


def ours(req) -> bool:
    """Requests whose errors take Anthropic's shape: /v1/messages and below, and the model
    list asked by the Anthropic client (its anthropic-version header), as its answers do."""
    return req.path == PATH or req.path.startswith(PATH + "/") or \
        (req.path.startswith("/v1/models") and bool(req.get_header("anthropic-version")))


# -- response ------------------------------------------------------------------------------

def usage(u) -> dict:
    return {"input_tokens": max(u.prompt_tokens - u.cached_tokens, 0), "output_tokens": u.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": u.cached_tokens}


def stop_info(job: Job, outline: Outline, fin: Finished) -> tuple[str, str | None]:
    r = fin.finish_reason
    if r == "tool_calls":
        return "tool_use", None
    if r == "length":
        return "max_tokens", None
    seq = matched_stop(job.req.stop, outline.raw, "".join(outline.text))
    return ("stop_sequence", seq) if seq is not None else ("end_turn", None)


def block(b: Block) -> dict:
    if b.kind == "text":
        return {"type": "text", "text": b.text}
    if b.kind == "reasoning":   # no signature: the thinking is the model's own text, not Anthropic's
        return {"type": "thinking", "thinking": b.text, "signature": ""}
    return {"type": "tool_use", "id": to_client_id(b.id), "name": b.name, "input": parse_json_object(b.args)}


def _start_block(b: Block) -> dict:
    if b.kind == "text":
        return {"type": "text", "text": ""}
    if b.kind == "reasoning":
        return {"type": "thinking", "thinking": "", "signature": ""}
    return {"type": "tool_use", "id": to_client_id(b.id), "name": b.name, "input": {}}


class Shaper(Blocks):
    """message_start, content_block_start/delta/stop, message_delta, message_stop; `ping` as
    the keepalive. message_start waits for Started (the model began: the cached split is
    known), or goes out before the first block or the end if that comes first; keepalives
    before it are SSE comments. Tool input streams as input_json_delta while the model writes
    it when it begins as an object (the renderer sends only text inside the value, so the
    pieces concatenate to the input's JSON); any other arguments go out at the block's
    close, whole, as JSON of an object."""

    def __init__(self, job: Job, mid: str, model: str, accepted: Accepted | None):
        super().__init__(job.info.get("thinking", False))
        self.job, self.mid, self.model = job, mid, model
        self.prompt_tokens = accepted.prompt_tokens if accepted else 0
        self.begun = False

    def _begin(self, prompt_tokens: int, cached: int) -> list:
        if self.begun:
            return []
        self.begun = True
        msg = {"id": self.mid, "type": "message", "role": "assistant", "model": self.model, "content": [],
               "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": max(prompt_tokens - cached, 0), "output_tokens": 0,
                         "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}}
        return [sse("message_start", {"type": "message_start", "message": msg})] + self.keepalive()

    def start(self) -> list:
        return []

    def started(self, ev: Started) -> list:
        return self._begin(ev.prompt_tokens, ev.cached_tokens)

    def keepalive(self) -> list:
        if not self.begun:
            return [falcon.asgi.SSEvent(comment="keepalive")]
        return [sse("ping", {"type": "ping"})]

    def delta(self, ev) -> list:
        return self._begin(self.prompt_tokens, 0) + super().delta(ev)

    def finish(self, fin: Finished) -> list:
        return self._begin(fin.usage.prompt_tokens, fin.usage.cached_tokens) + super().finish(fin)

    def ops(self, ops: list) -> list:
        out = []
        for op in ops:
            b = op[1]
            if op[0] == "open":
                out.append(sse("content_block_start", {"type": "content_block_start", "index": b.index,
                                                              "content_block": _start_block(b)}))
            elif op[0] == "text":
                delta = {"type": "thinking_delta", "thinking": op[2]} if b.kind == "reasoning" else \
                    {"type": "text_delta", "text": op[2]}
                out.append(sse("content_block_delta", {"type": "content_block_delta", "index": b.index,
                                                              "delta": delta}))
            elif op[0] == "args":
                if b.extra.setdefault("streamed", b.args.lstrip().startswith("{")):
                    out.append(sse("content_block_delta", {
                        "type": "content_block_delta", "index": b.index,
                        "delta": {"type": "input_json_delta", "partial_json": op[2]}}))
            elif op[0] == "close":
                if b.kind == "call" and not b.extra.get("streamed"):
                    js = json_text(parse_json_object(b.args))
                    out.append(sse("content_block_delta", {
                        "type": "content_block_delta", "index": b.index,
                        "delta": {"type": "input_json_delta", "partial_json": js}}))
                if b.kind == "reasoning":
                    out.append(sse("content_block_delta", {"type": "content_block_delta", "index": b.index,
                                                           "delta": {"type": "signature_delta", "signature": ""}}))
                out.append(sse("content_block_stop", {"type": "content_block_stop", "index": b.index}))
        return out

    def end(self, fin: Finished) -> list:
        out = []
        reason, seq = stop_info(self.job, self.outline, fin)
        out.append(sse("message_delta", {"type": "message_delta",
                                                "delta": {"stop_reason": reason, "stop_sequence": seq},
                                                "usage": usage(fin.usage)}))
        out.append(sse("message_stop", {"type": "message_stop"}))
        return out

    def fail(self, status: int, message: str, err_type: str, code, param) -> list:
        return [sse("error", error_body(status, message))]


class CountTokens(Endpoint):
    """POST /v1/messages/count_tokens: the prompt's tokens as the model would see it."""

    def parse(self, body: dict, rid: str) -> Job:
        return parse(body, rid, count_only=True)

    def collector(self, job: Job) -> Whole:
        return Whole(lambda outline, fin: {"input_tokens": fin.usage.prompt_tokens})


class Messages(Endpoint):
    """POST /v1/messages."""

    def parse(self, body: dict, rid: str) -> Job:
        return parse(body, rid)

    def collector(self, job: Job) -> Whole:
        return Whole(lambda outline, fin: self.whole(job, outline, fin), job.info.get("thinking", False))

    def whole(self, job: Job, outline: Outline, fin: Finished) -> dict:
        reason, seq = stop_info(job, outline, fin)
        return {"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant", "model": self.model_id,
                "content": [block(b) for b in outline.blocks], "stop_reason": reason, "stop_sequence": seq,
                "usage": usage(fin.usage)}

    def shaper(self, job: Job, accepted: Accepted | None) -> Shaper:
        return Shaper(job, "msg_" + secrets.token_hex(12), self.model_id, accepted)


def register(app, backend, settings, model_id: str) -> None:
    if (ours, error_shape) not in errors.SHAPES:
        errors.SHAPES.append((ours, error_shape))
    app.add_route(PATH, Messages(backend, settings, model_id))
    app.add_route(PATH + "/count_tokens", CountTokens(backend, settings, model_id))
