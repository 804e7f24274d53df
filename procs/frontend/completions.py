"""POST /v1/chat/completions and /v1/completions over the one request flow (flow.py):
parsing in schema.py, the response objects in shape.py; here only the glue of the two into
a collector (the whole answer) and a shaper (the `data:` chunks, `[DONE]` last).
"""
from __future__ import annotations

import time

import falcon.asgi

from common.messages import Accepted, Delta, Finished
from procs.frontend import shape
from procs.frontend.errors import error_body
from procs.frontend.flow import Endpoint, Job, sse
from procs.frontend.schema import parse_chat, parse_completion

DONE = falcon.asgi.SSEvent(data=b"[DONE]")


class Choices:
    """The collector of a whole (non-streamed) chat or legacy completion: its choices."""

    def __init__(self, kind: str, job: Job, model: str):
        self.kind, self.job, self.model = kind, job, model
        self.col = shape.Collected(legacy=kind != "chat")

    def add(self, ev: Delta) -> None:
        self.col.add(ev, self.job.req.logprobs)

    def result(self, fin: Finished) -> dict:
        build = shape.chat_completion if self.kind == "chat" else shape.text_completion
        cid, created = ids(self.kind, self.job)
        return build(cid, created, self.model, self.col, self.job.req.logprobs, fin.finish_reason, fin.usage)


class Stream:
    """Chunks as `data:` events (no event names), `[DONE]` after the last."""

    def __init__(self, kind: str, job: Job, model: str):
        cid, created = ids(kind, job)
        self.usage = job.info["include_usage"]
        self.chunks = shape.Chunks(kind, cid, created, model, job.req.logprobs, self.usage)

    def start(self) -> list:
        first = self.chunks.first()
        return [sse(None, first)] if first is not None else []

    def started(self, ev) -> list:
        return []

    def delta(self, ev: Delta) -> list:
        return [sse(None, c) for c in self.chunks.delta(ev)]

    def finish(self, fin: Finished) -> list:
        out = [sse(None, c) for c in self.chunks.final(fin.finish_reason)]
        if self.usage:
            out.append(sse(None, self.chunks.usage(fin.usage)))
        return out + [DONE]

    def fail(self, status: int, message: str, err_type: str, code, param) -> list:
        return [sse(None, error_body(message, err_type, param, code))]

    def keepalive(self) -> list:
        return [falcon.asgi.SSEvent(comment="keepalive")]


def ids(kind: str, job: Job) -> tuple[str, int]:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + job.req.rid, int(time.time())


class Completions(Endpoint):
    """`kind` "chat": /v1/chat/completions; "completion": /v1/completions."""

    def __init__(self, backend, settings, model_id: str, kind: str):
        super().__init__(backend, settings, model_id)
        self.kind = kind

    def parse(self, body: dict, rid: str) -> Job:
        return (parse_chat if self.kind == "chat" else parse_completion)(body, rid)

    def collector(self, job: Job) -> Choices:
        return Choices(self.kind, job, self.model_id)

    def shaper(self, job: Job, accepted: Accepted | None) -> Stream:
        return Stream(self.kind, job, self.model_id)
