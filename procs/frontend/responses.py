"""POST /v1/responses: the OpenAI Responses API over the chat pipeline.

Input items map onto chat messages: `instructions` -> a leading system message; messages
(user/system/developer/assistant; text parts) as they are; `function_call` items -> an
assistant message with tool_calls whose ids are the items' `call_id` (merged into the
assistant message right before them, so text + calls of one answer replay as the exact
sampled bytes); `function_call_output` -> tool messages. Output: a `message` item for the
text, `function_call` items (call_id = the renderer's call id) for the calls.

No server-side state: `previous_response_id` (and `conversation`) get a 400 asking for the
whole input; `store` is accepted and ignored (nothing is stored).
"""
from __future__ import annotations

import secrets
import time

import falcon.asgi

from common.messages import Accepted, ChatMessage, Finished, GenerateRequest, ToolCall, ToolCallFunction
from procs.frontend.errors import bad
from procs.frontend.fields import (check_model, function_tool, get_bool, json_text, named_choice,
                                   output_format, sampling)
from procs.frontend.flow import Endpoint, Job, sse
from procs.frontend.outline import Block, Blocks, Outline, Whole

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
STATEFUL = ("previous_response_id", "conversation")


def _hex() -> str:
    return secrets.token_hex(16)


# -- request -------------------------------------------------------------------------------

def _text(v, at: str, what: str) -> str:
    """A string, or a list of text parts joined by newlines."""
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise bad(at, f"{what} must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(v):
        if not isinstance(part, dict):
            raise bad(f"{at}[{j}]", "a content part must be an object")
        if part.get("type") not in TEXT_PARTS:
            raise bad(f"{at}[{j}].type", f"content part type {part.get('type')!r} is not supported; "
                      "only input_text and output_text parts are")
        if not isinstance(part.get("text"), str):
            raise bad(f"{at}[{j}].text", "a text part needs a string 'text'")
        texts.append(part["text"])
    return "\n".join(texts)


def _str(item: dict, key: str, at: str) -> str:
    v = item.get(key)
    if not isinstance(v, str) or (key != "arguments" and not v):
        raise bad(f"{at}.{key}", f"'{key}' must be a non-empty string" if key != "arguments"
                  else "'arguments' must be a string (JSON text)")
    return v


def _messages(body: dict) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    instr = body.get("instructions")
    if instr is not None:
        if not isinstance(instr, str):
            raise bad("instructions", "'instructions' must be a string")
        if instr:
            out.append(ChatMessage(role="system", content=instr))
    inp = body.get("input")
    if inp is None:
        raise bad("input", "'input' is required")
    if isinstance(inp, str):
        return out + [ChatMessage(role="user", content=inp)]
    if not isinstance(inp, list) or not inp:
        raise bad("input", "'input' must be a string or a non-empty list of items")
    prev_open = False           # the last message is an assistant one that calls may join
    for i, item in enumerate(inp):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(at, "each input item must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad(f"{at}.role", f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
            out.append(ChatMessage(role=role, content=_text(item.get("content"), f"{at}.content", "content")))
            prev_open = role == "assistant"
        elif kind == "function_call":
            call = ToolCall(id=_str(item, "call_id", at),
                            function=ToolCallFunction(name=_str(item, "name", at),
                                                      arguments=_str(item, "arguments", at)))
            if prev_open:
                last = out[-1]
                out[-1] = ChatMessage(role="assistant", content=last.content, tool_calls=last.tool_calls + (call,))
            else:
                out.append(ChatMessage(role="assistant", content="", tool_calls=(call,)))
            prev_open = True
        elif kind == "function_call_output":
            out.append(ChatMessage(role="tool", content=_text(item.get("output"), f"{at}.output", "'output'"),
                                   tool_call_id=_str(item, "call_id", at)))
            prev_open = False
        elif kind == "reasoning":
            continue            # never produced here; a client may echo one back
        elif kind == "item_reference":
            raise bad(f"{at}.type", "item references need stored responses, and none are kept: "
                      "send the items themselves")
        else:
            raise bad(f"{at}.type", f"input item type {kind!r} is not supported; expected message, "
                      "function_call or function_call_output")
    return out


def _tools(body: dict) -> tuple[str, str, set]:
    tools, choice = body.get("tools"), body.get("tool_choice")
    chat, names = [], set()
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise bad("tools", "'tools' must be a list of objects")
        for i, t in enumerate(tools):
            if t.get("type") != "function":
                raise bad(f"tools[{i}].type", f"tool type {t.get('type')!r} is not supported; only 'function' is")
            chat.append(function_tool(t.get("name"), t.get("description"), t.get("parameters"), f"tools[{i}]",
                                      strict=t.get("strict")))
            names.add(t["name"])
    out = None
    if choice is not None:
        if choice in ("none", "auto", "required"):
            if choice == "required" and not names:
                raise bad("tool_choice", "'tool_choice' is required but no tools were given")
            out = choice
        elif isinstance(choice, dict) and choice.get("type") == "function":
            out = named_choice(choice.get("name"), names, "tool_choice")
        else:
            raise bad("tool_choice", "'tool_choice' must be none, auto, required or "
                      "{\"type\": \"function\", \"name\": ...}")
    return (json_text(chat) if chat else "", json_text(out) if out is not None else "", names)


def parse(body: dict, served_id: str, rid: str) -> Job:
    check_model(body, served_id)
    for key in STATEFUL:
        if body.get(key) is not None:
            raise bad(key, f"'{key}' is not supported: this server keeps no responses; send the whole "
                      "conversation in 'input' (the KV cache makes the repeated prefix cheap)",
                      code="unsupported_parameter")
    if get_bool(body, "background"):
        raise bad("background", "background responses are not supported", code="unsupported_parameter")
    fmt = body.get("text")
    if fmt is not None and not isinstance(fmt, dict):
        raise bad("text", "'text' must be an object")
    out_format = output_format((fmt or {}).get("format"), "text.format", "")
    messages = _messages(body)
    params = sampling(body, "max_output_tokens", ("temperature", "top_p"), lo=1)
    tools, choice, _ = _tools(body)
    stream = get_bool(body, "stream")
    get_bool(body, "store")
    req = GenerateRequest(rid=rid, kind="chat", sampling=params, messages=tuple(messages),
                          tools=tools, tool_choice=choice, response_format=out_format,
                          parallel_tool_calls=get_bool(body, "parallel_tool_calls") is True)
    return Job(req, stream, body=body)


# -- response ------------------------------------------------------------------------------

def usage(u) -> dict:
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def _item_id(b: Block) -> str:
    if "id" not in b.extra:
        b.extra["id"] = ("msg_" if b.kind == "text" else "fc_") + _hex()
    return b.extra["id"]


def item(b: Block, status: str) -> dict:
    if b.kind == "text":
        content = [] if status == "in_progress" else [_part(b.text)]
        return {"id": _item_id(b), "type": "message", "status": status, "role": "assistant", "content": content}
    return {"id": _item_id(b), "type": "function_call", "status": status, "call_id": b.id, "name": b.name,
            "arguments": "" if status == "in_progress" else b.args}


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
                      "parallel_tool_calls": body.get("parallel_tool_calls", True),
                      "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
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

    def __init__(self, head: Head):
        super().__init__()
        self.head, self.seq = head, 0
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
            where = {"item_id": _item_id(b), "output_index": b.index}
            if op[0] == "open":
                out.append(self._ev("response.output_item.added", output_index=b.index, item=item(b, "in_progress")))
                if b.kind == "text":
                    out.append(self._ev("response.content_part.added", **where, content_index=0,
                                        part=_part("")))
            elif op[0] == "text":
                out.append(self._ev("response.output_text.delta", **where, content_index=0, delta=op[2],
                                    logprobs=[]))
            elif op[0] == "args":
                out.append(self._ev("response.function_call_arguments.delta", **where, delta=op[2]))
            else:
                status = "incomplete" if self.length and b.kind == "text" else "completed"
                if b.kind == "text":
                    out.append(self._ev("response.output_text.done", **where, content_index=0, text=b.text,
                                        logprobs=[]))
                    out.append(self._ev("response.content_part.done", **where, content_index=0, part=_part(b.text)))
                else:
                    out.append(self._ev("response.function_call_arguments.done", **where, name=b.name,
                                        arguments=b.args))
                done = item(b, status)
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
        return parse(body, self.model_id, rid)

    def collector(self, job: Job) -> Whole:
        def build(outline: Outline, fin: Finished) -> dict:
            status = _status(fin)
            output = [item(b, "incomplete" if status == "incomplete" and b.kind == "text" else "completed")
                      for b in outline.blocks]
            return Head(job, self.model_id).obj(output, fin)
        return Whole(build)

    def shaper(self, job: Job, accepted: Accepted | None) -> Shaper:
        return Shaper(Head(job, self.model_id))


def register(app, backend, settings, model_id: str) -> None:
    app.add_route("/v1/responses", Responses(backend, settings, model_id))

