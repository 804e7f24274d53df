"""POST /v1/messages: the Anthropic Messages API over the chat pipeline.

`system` -> a leading system message; user/assistant messages with text blocks; assistant
`tool_use` blocks -> tool_calls (arguments = json.dumps(input)); user `tool_result` blocks
-> tool messages, in order, the user message's text blocks after them.

Tool-use ids round-trip for exact replay: the renderer's call id `call_<hex>` goes out as
`toolu_<hex>`, and any `toolu_<x>` a client sends back is read as `call_<x>`, so an answer
the model gave renders again as the very bytes it sampled (and the KV cache matches it).

Usage follows Anthropic: input_tokens counts the prompt tokens not read from the cache,
cache_read_input_tokens those that were (their sum is the whole prompt);
cache_creation_input_tokens is 0 (checkpoints are written by the server on its own).

Errors on these paths come in Anthropic's shape ({"type": "error", "error": {type, message}}),
via `install`; `x-api-key` works like the Bearer token (see app.Auth); `anthropic-version`
is accepted and ignored. A trailing assistant message is rendered as a finished turn (no
prefill of the answer).
"""
from __future__ import annotations

import logging
import secrets

import falcon
import msgspec

from common.messages import Accepted, ChatMessage, Finished, GenerateRequest, ToolCall, ToolCallFunction
from procs.frontend import errors
from procs.frontend.errors import bad
from procs.frontend.fields import check_model, function_tool, get_bool, json_text, named_choice, sampling
from procs.frontend.flow import Endpoint, Job, sse
from procs.frontend.outline import Block, Blocks, Outline, Whole, matched_stop, parse_json_object

log = logging.getLogger("web")

PATH = "/v1/messages"
MAX_STOPS = 16
OUR_PREFIX, THEIR_PREFIX = "call_", "toolu_"
SKIPPED_BLOCKS = ("thinking", "redacted_thinking")       # never produced here; echoed back by clients

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
          500: "api_error", 502: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def to_client_id(call_id: str) -> str:
    return THEIR_PREFIX + call_id[len(OUR_PREFIX):] if call_id.startswith(OUR_PREFIX) else call_id


def from_client_id(tool_use_id: str) -> str:
    return OUR_PREFIX + tool_use_id[len(THEIR_PREFIX):] if tool_use_id.startswith(THEIR_PREFIX) else tool_use_id


# -- errors --------------------------------------------------------------------------------

def error_type(status: int) -> str:
    return _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def _message(ex: falcon.HTTPError, req) -> str:
    if isinstance(ex, errors.ApiError):
        return f"{ex.param}: {ex.message}" if ex.param and not ex.message.startswith(ex.param) else ex.message
    return errors._falcon_body(req, ex)["error"]["message"]


def ours(req) -> bool:
    return req.path == PATH or req.path.startswith(PATH + "/")


def install(app) -> None:
    """Errors on /v1/messages* in Anthropic's shape; every other path keeps errors.py's."""
    def serialize(req, resp, ex) -> None:
        if not ours(req):
            return errors.serialize_error(req, resp, ex)
        resp.content_type = falcon.MEDIA_JSON
        resp.data = msgspec.json.encode(error_body(ex.status_code, _message(ex, req)))

    async def unexpected(req, resp, ex, params) -> None:
        if not ours(req):
            return await errors.handle_unexpected(req, resp, ex, params)
        log.exception("unexpected error in %s %s", req.method, req.path, exc_info=ex)
        resp.status = 500
        resp.content_type = falcon.MEDIA_JSON
        resp.data = msgspec.json.encode(error_body(500, "internal server error"))

    app.set_error_serializer(serialize)
    app.add_error_handler(Exception, unexpected)


# -- request -------------------------------------------------------------------------------

def _blocks(v, at: str) -> list[dict]:
    if isinstance(v, str):
        return [{"type": "text", "text": v}]
    if not isinstance(v, list):
        raise bad(at, "content must be a string or a list of content blocks")
    for j, b in enumerate(v):
        if not isinstance(b, dict):
            raise bad(f"{at}[{j}]", "a content block must be an object")
        if b.get("type") == "text" and not isinstance(b.get("text"), str):
            raise bad(f"{at}[{j}].text", "a text block needs a string 'text'")
    return v


def _texts(blocks: list[dict], at: str, allowed: tuple) -> list[str]:
    out = []
    for j, b in enumerate(blocks):
        kind = b.get("type")
        if kind == "text":
            out.append(b["text"])
        elif kind not in allowed and kind not in SKIPPED_BLOCKS:
            raise bad(f"{at}[{j}].type", f"content block type {kind!r} is not supported here")
    return out


def _tool_result(b: dict, at: str) -> ChatMessage:
    tid = b.get("tool_use_id")
    if not isinstance(tid, str) or not tid:
        raise bad(f"{at}.tool_use_id", "a tool_result needs a string 'tool_use_id'")
    content = b.get("content", "")
    text = "\n".join(_texts(_blocks(content, f"{at}.content"), f"{at}.content", ())) if content else ""
    if get_bool(b, "is_error"):
        text = "Error: " + text
    return ChatMessage(role="tool", content=text, tool_call_id=from_client_id(tid))


def _tool_use(b: dict, at: str) -> ToolCall:
    tid, name, inp = b.get("id"), b.get("name"), b.get("input", {})
    if not isinstance(tid, str) or not tid:
        raise bad(f"{at}.id", "a tool_use block needs a string 'id'")
    if not isinstance(name, str) or not name:
        raise bad(f"{at}.name", "a tool_use block needs a string 'name'")
    if not isinstance(inp, dict):
        raise bad(f"{at}.input", "a tool_use block's 'input' must be an object")
    return ToolCall(id=from_client_id(tid), function=ToolCallFunction(name=name, arguments=json_text(inp)))


def _messages(body: dict) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    system = body.get("system")
    if system is not None:
        text = "\n".join(_texts(_blocks(system, "system"), "system", ()))
        if text:
            out.append(ChatMessage(role="system", content=text))
    msgs = body.get("messages")
    if msgs is None:
        raise bad("messages", "'messages' is required")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "'messages' must be a non-empty list")
    for i, msg in enumerate(msgs):
        at = f"messages.{i}"
        if not isinstance(msg, dict):
            raise bad(at, "each message must be an object")
        role = msg.get("role")
        if role not in ("user", "assistant"):
            raise bad(f"{at}.role", f"unknown role {role!r}; expected user or assistant")
        blocks = _blocks(msg.get("content"), f"{at}.content")
        if role == "assistant":
            calls = tuple(_tool_use(b, f"{at}.content.{j}") for j, b in enumerate(blocks)
                          if b.get("type") == "tool_use")
            texts = _texts(blocks, f"{at}.content", ("tool_use",))
            out.append(ChatMessage(role="assistant", content="\n".join(texts), tool_calls=calls))
            continue
        for j, b in enumerate(blocks):
            if b.get("type") == "tool_result":
                out.append(_tool_result(b, f"{at}.content.{j}"))
        texts = _texts(blocks, f"{at}.content", ("tool_result",))
        if texts or not any(b.get("type") == "tool_result" for b in blocks):
            out.append(ChatMessage(role="user", content="\n".join(texts)))
    return out


def _tools(body: dict) -> tuple[str, str]:
    tools, choice = body.get("tools"), body.get("tool_choice")
    chat, names = [], set()
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise bad("tools", "'tools' must be a list of objects")
        for i, t in enumerate(tools):
            if t.get("type", "custom") != "custom":
                raise bad(f"tools.{i}.type", f"tool type {t.get('type')!r} is not supported; only client tools "
                          "({name, description, input_schema}) are")
            if not isinstance(t.get("input_schema"), dict):
                raise bad(f"tools.{i}.input_schema", "a tool needs an 'input_schema' object")
            chat.append(function_tool(t.get("name"), t.get("description"), t["input_schema"], f"tools.{i}",
                                      "input_schema"))
            names.add(t["name"])
    out = None
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind in ("auto", "none"):
            out = kind
        elif kind == "any":
            if not names:
                raise bad("tool_choice", "tool_choice 'any' needs tools")
            out = "required"
        elif kind == "tool":
            out = named_choice(choice.get("name"), names, "tool_choice.name")
        else:
            raise bad("tool_choice", "'tool_choice' must be {\"type\": auto | any | tool | none}")
    return (json_text(chat) if chat else "", json_text(out) if out is not None else "")


def _stops(body: dict) -> tuple[str, ...]:
    v = body.get("stop_sequences")
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("stop_sequences", "'stop_sequences' must be a list of strings")
    if len(v) > MAX_STOPS:
        raise bad("stop_sequences", f"'stop_sequences' may hold at most {MAX_STOPS} strings")
    return tuple(s for s in v if s)


def parse(body: dict, served_id: str, rid: str) -> Job:
    check_model(body, served_id)
    if body.get("max_tokens") is None:
        raise bad("max_tokens", "Field required")
    params = sampling(body, "max_tokens", ("temperature", "top_p", "top_k"), lo=1)
    messages = _messages(body)
    stops = _stops(body)
    tools, choice = _tools(body)
    stream = get_bool(body, "stream")
    # logprobs carry every sampled token's bytes: how the frontend tells which stop string ended it
    tc = body.get("tool_choice")
    parallel = not (isinstance(tc, dict) and tc.get("disable_parallel_tool_use") is True)
    req = GenerateRequest(rid=rid, kind="chat", sampling=params, messages=tuple(messages), stop=stops,
                          tools=tools, tool_choice=choice, logprobs=bool(stops), parallel_tool_calls=parallel)
    return Job(req, stream)


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
    return {"type": "tool_use", "id": to_client_id(b.id), "name": b.name, "input": parse_json_object(b.args)}


def _start_block(b: Block) -> dict:
    if b.kind == "text":
        return {"type": "text", "text": ""}
    return {"type": "tool_use", "id": to_client_id(b.id), "name": b.name, "input": {}}


class Shaper(Blocks):
    """message_start, content_block_start/delta/stop, message_delta, message_stop; `ping` as
    the keepalive. Tool input goes out whole at the block's close (the pieces of one call
    arrive together anyway), as JSON of an object."""

    def __init__(self, job: Job, mid: str, model: str, accepted: Accepted | None):
        super().__init__()
        self.job, self.mid, self.model = job, mid, model
        self.prompt_tokens = accepted.prompt_tokens if accepted else 0

    def start(self) -> list:
        msg = {"id": self.mid, "type": "message", "role": "assistant", "model": self.model, "content": [],
               "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0,
                         "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}
        return [sse("message_start", {"type": "message_start", "message": msg})] + self.keepalive()

    def keepalive(self) -> list:
        return [sse("ping", {"type": "ping"})]

    def ops(self, ops: list) -> list:
        out = []
        for op in ops:
            b = op[1]
            if op[0] == "open":
                out.append(sse("content_block_start", {"type": "content_block_start", "index": b.index,
                                                              "content_block": _start_block(b)}))
            elif op[0] == "text":
                out.append(sse("content_block_delta", {"type": "content_block_delta", "index": b.index,
                                                              "delta": {"type": "text_delta", "text": op[2]}}))
            elif op[0] == "close":
                if b.kind == "call":
                    js = json_text(parse_json_object(b.args))
                    out.append(sse("content_block_delta", {
                        "type": "content_block_delta", "index": b.index,
                        "delta": {"type": "input_json_delta", "partial_json": js}}))
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


class Messages(Endpoint):
    """POST /v1/messages."""

    def parse(self, body: dict, rid: str) -> Job:
        return parse(body, self.model_id, rid)

    def collector(self, job: Job) -> Whole:
        return Whole(lambda outline, fin: self.whole(job, outline, fin))

    def whole(self, job: Job, outline: Outline, fin: Finished) -> dict:
        reason, seq = stop_info(job, outline, fin)
        return {"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant", "model": self.model_id,
                "content": [block(b) for b in outline.blocks], "stop_reason": reason, "stop_sequence": seq,
                "usage": usage(fin.usage)}

    def shaper(self, job: Job, accepted: Accepted | None) -> Shaper:
        return Shaper(job, "msg_" + secrets.token_hex(12), self.model_id, accepted)


def register(app, backend, settings, model_id: str) -> None:
    install(app)
    app.add_route(PATH, Messages(backend, settings, model_id))
