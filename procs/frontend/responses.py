"""POST /v1/responses: the OpenAI Responses API over the chat pipeline. Requests are read in
responses_request.py; here the answer: a `message` item for the text, `function_call` items
(call_id = the renderer's call id, with `namespace` for a namespaced tool) or
`custom_tool_call` items (the free-form input) for the calls, a `reasoning` item for a
reasoning model's thinking (its text as `reasoning_text`, no summary), whole or as the API's
streamed events. A call cut by the token limit is an `incomplete` item, as is cut text.

No server-side state: `store` is accepted and nothing is stored.
"""
from __future__ import annotations

import secrets
import time

import falcon.asgi

from common.messages import Accepted, Finished
from procs.frontend.flow import Endpoint, Job, sse
from procs.frontend.outline import Block, Blocks, Outline, Whole
from procs.frontend.responses_request import parse
from procs.frontend.toolset import Toolset, custom_input

def _hex() -> str:
    return secrets.token_hex(16)


# -- response ------------------------------------------------------------------------------

def usage(u) -> dict:
    # cache_write_tokens (required by openai 3.x's types): 0, as Anthropic's cache_creation_input_tokens:
    # checkpoints are written by the server on its own, not asked for
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def _item_id(b: Block) -> str:
    if "id" not in b.extra:
        b.extra["id"] = {"text": "msg_", "reasoning": "rs_"}.get(b.kind) or \
            ("fc_" if not b.extra.get("custom") else "ctc_")
        b.extra["id"] += _hex()
    return b.extra["id"]


def item(b: Block, status: str, tools: Toolset) -> dict:
    """The output item of a block: a message, a function_call (with its namespace, if any) or
    a custom_tool_call (its input the free text the model wrote)."""
    if b.kind == "text":
        content = [] if status == "in_progress" else [_part(b.text)]
        return {"id": _item_id(b), "type": "message", "status": status, "role": "assistant", "content": content}
    if b.kind == "reasoning":     # its text as OpenAI's open-weight models give it (no summary)
        content = [] if status == "in_progress" else [{"type": "reasoning_text", "text": b.text}]
        return {"id": _item_id(b), "type": "reasoning", "status": status, "summary": [], "content": content}
    t = tools.tool(b.name)
    b.extra.setdefault("custom", t.custom)
    done = status != "in_progress"
    if t.custom:
        return {"id": _item_id(b), "type": "custom_tool_call", "status": status, "call_id": b.id, "name": t.name,
                "input": custom_input(b.args) if done else ""}
    d = {"id": _item_id(b), "type": "function_call", "status": status, "call_id": b.id, "name": t.name,
         "arguments": b.args if done else ""}
    if t.namespace:
        d["namespace"] = t.namespace
    return d


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _status(fin: Finished | None) -> str:
    if fin is None:
        return "in_progress"
    return "incomplete" if fin.finish_reason == "length" else "completed"


class Head:
    """The response object of one request, in any state."""

    def __init__(self, job: Job, model: str):
        body = job.info["body"]
        self.id, self.created = "resp_" + _hex(), int(time.time())
        tools = body.get("tools") or []
        self.fixed = {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
                      "metadata": body.get("metadata") or {}, "model": model,
                      "parallel_tool_calls": job.req.parallel_tool_calls,   # what was done: false unless asked
                      "previous_response_id": None,
                      "reasoning": {"effort": job.req.reasoning_effort or None, "summary": None},
                      "store": False, "temperature": job.req.sampling.temperature,
                      "text": {"format": ((body.get("text") or {}).get("format") or {"type": "text"})}, "tool_choice": body.get("tool_choice") or "auto",
                      "tools": tools, "top_p": job.req.sampling.top_p, "truncation": "disabled",
                      "user": body.get("user")}

    def obj(self, output: list, fin: Finished | None, error: dict | None = None) -> dict:
        status = "failed" if error else _status(fin)
        d = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
             "error": error, "incomplete_details": None, **self.fixed, "output": output, "usage": None}
        if status == "incomplete":
            d["incomplete_details"] = {"reason": "max_output_tokens"}
        if fin is not None:
            d["usage"] = usage(fin.usage)
        return d


class Shaper(Blocks):
    """Streamed events: `event: <type>`, data with "type" and an increasing sequence_number."""

    def __init__(self, head: Head, tools: Toolset):
        super().__init__()
        self.head, self.seq, self.tools = head, 0, tools
        self.done: list[dict] = []      # output items finished so far
        self.length = False

    def _ev(self, kind: str, **fields):
        d = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return sse(kind, d)

    def start(self) -> list:
        r = self.head.obj([], None)
        return [self._ev("response.created", response=r), self._ev("response.in_progress", response=r)]

    def keepalive(self) -> list:
        return [falcon.asgi.SSEvent(comment="keepalive")]

    def ops(self, ops: list) -> list:
        out = []
        for op in ops:
            b = op[1]
            if b.kind == "call":
                b.extra.setdefault("custom", self.tools.tool(b.name).custom)
            where = {"item_id": _item_id(b), "output_index": b.index}
            if op[0] == "open":
                out.append(self._ev("response.output_item.added", output_index=b.index,
                                    item=item(b, "in_progress", self.tools)))
                if b.kind == "text":
                    out.append(self._ev("response.content_part.added", **where, content_index=0,
                                        part=_part("")))
            elif op[0] == "text" and b.kind == "reasoning":
                out.append(self._ev("response.reasoning_text.delta", **where, content_index=0, delta=op[2]))
            elif op[0] == "text":
                out.append(self._ev("response.output_text.delta", **where, content_index=0, delta=op[2],
                                    logprobs=[]))
            elif op[0] == "args":
                if not b.extra["custom"]:       # a custom call's input goes out whole, decoded, at its end
                    out.append(self._ev("response.function_call_arguments.delta", **where, delta=op[2]))
            else:
                status = "incomplete" if self.length else "completed"     # the last block, cut
                if b.kind == "reasoning":
                    out.append(self._ev("response.reasoning_text.done", **where, content_index=0, text=b.text))
                if b.kind == "text":
                    out.append(self._ev("response.output_text.done", **where, content_index=0, text=b.text,
                                        logprobs=[]))
                    out.append(self._ev("response.content_part.done", **where, content_index=0, part=_part(b.text)))
                done = item(b, status, self.tools)
                if done["type"] == "custom_tool_call":
                    out.append(self._ev("response.custom_tool_call_input.delta", **where, delta=done["input"]))
                    out.append(self._ev("response.custom_tool_call_input.done", **where, input=done["input"]))
                elif b.kind == "call":
                    out.append(self._ev("response.function_call_arguments.done", **where, name=done["name"],
                                        arguments=b.args))
                self.done.append(done)
                out.append(self._ev("response.output_item.done", output_index=b.index, item=done))
        return out

    def finish(self, fin: Finished) -> list:
        self.length = fin.finish_reason == "length"     # before the open block closes: its status
        return super().finish(fin)

    def end(self, fin: Finished) -> list:
        r = self.head.obj(self.done, fin)
        return [self._ev("response.incomplete" if r["status"] == "incomplete" else "response.completed", response=r)]

    def fail(self, status: int, message: str, err_type: str, code, param) -> list:
        err = {"code": code or err_type, "message": message}
        return [self._ev("response.failed", response=self.head.obj(self.done, None, err))]


class Responses(Endpoint):
    """POST /v1/responses."""

    def parse(self, body: dict, rid: str) -> Job:
        return parse(body, rid)

    def collector(self, job: Job) -> Whole:
        def build(outline: Outline, fin: Finished) -> dict:
            status = _status(fin)
            last = len(outline.blocks) - 1
            output = [item(b, "incomplete" if status == "incomplete" and i == last else "completed", job.info["tools"])
                      for i, b in enumerate(outline.blocks)]
            return Head(job, self.model_id).obj(output, fin)
        return Whole(build)

    def shaper(self, job: Job, accepted: Accepted | None) -> Shaper:
        return Shaper(Head(job, self.model_id), job.info["tools"])


def register(app, backend, settings, model_id: str) -> None:
    app.add_route("/v1/responses", Responses(backend, settings, model_id))

