"""Anthropic Messages request bodies -> GenerateRequest (the answer side is anthropic.py).

`system` -> a leading system message; `system` messages inside `messages` (Claude Code's
mid-conversation system messages) rendered in place; user/assistant messages with text
blocks; assistant `tool_use` blocks -> tool_calls (arguments = the input as JSON); user
`tool_result` blocks -> tool messages, in order, the user message's text blocks after them.
An assistant's `thinking` blocks are its reasoning (for a template that renders it). Blocks
the model cannot read (images, redacted thinking, server tool results) are left out and logged
once per type; `document` blocks with a text source render as text. Volatile per-session
headers go before rendering (normalize.py).

Server-side threads (the SDK's beta `thread`): none are kept. `create` is accepted (the
request carries the whole conversation) and `continue` is answered 404 `thread_not_found`,
on which the SDK sends the whole conversation again; before, `continue` was answered from
the new messages alone, without the history, the system prompt or the tools.

Tool-use ids round-trip for exact replay: the renderer's call id `call_<hex>` goes out as
`toolu_<hex>`, and any `toolu_<x>` a client sends back is read as `call_<x>`, so an answer
the model gave renders again as the very bytes it sampled (and the KV cache matches it).
"""
from __future__ import annotations

import logging

from common.messages import ChatMessage, GenerateRequest, ToolCall, ToolCallFunction
from procs.frontend import normalize
from procs.frontend.errors import ApiError, bad
from procs.frontend.fields import (function_tool, get_bool, session_hint, json_text, message_role, named_choice, sampling,
                                   stops)
from procs.frontend.flow import Job
from procs.frontend.toolset import Toolset, left_out, tool_list

log = logging.getLogger("web")

MAX_STOPS = 16
OUR_PREFIX, THEIR_PREFIX = "call_", "toolu_"
ROLES = ("user", "assistant", "system")


def to_client_id(call_id: str) -> str:
    return THEIR_PREFIX + call_id[len(OUR_PREFIX):] if call_id.startswith(OUR_PREFIX) else call_id


def from_client_id(tool_use_id: str) -> str:
    return OUR_PREFIX + tool_use_id[len(THEIR_PREFIX):] if tool_use_id.startswith(THEIR_PREFIX) else tool_use_id


def _blocks(v, at: str) -> list[dict]:
    if isinstance(v, str):
        return [{"type": "text", "text": v}]
    if not isinstance(v, list):
        raise bad(at, "content must be a string or a list of content blocks")
    for j, b in enumerate(v):
        if not isinstance(b, dict):
            raise bad(f"{at}.{j}", "a content block must be an object")
        if not isinstance(b.get("type"), str):
            raise bad(f"{at}.{j}.type", "a content block needs a 'type'")
        if b["type"] == "text" and not isinstance(b.get("text"), str):
            raise bad(f"{at}.{j}.text", "a text block needs a string 'text'")
    return v


def _texts(blocks: list[dict], handled: tuple = ()) -> list[str]:
    """The text of text blocks (and of text documents); other blocks, unless `handled` by the
    caller, are left out."""
    out = []
    for b in blocks:
        kind = b["type"]
        if kind == "text":
            out.append(b["text"])
        elif kind == "document" and isinstance(b.get("source"), dict) and b["source"].get("type") == "text" \
                and isinstance(b["source"].get("data"), str):
            out.append(b["source"]["data"])
        elif kind not in handled:
            left_out(f"content block {kind}", "this model reads text only")
    return out


def _tool_result(b: dict, at: str) -> ChatMessage:
    tid = b.get("tool_use_id")
    if not isinstance(tid, str) or not tid:
        raise bad(f"{at}.tool_use_id", "a tool_result needs a string 'tool_use_id'")
    content = b.get("content", "")
    text = "\n".join(_texts(_blocks(content, f"{at}.content"))) if content else ""
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


def _system(v, at: str) -> ChatMessage | None:
    text = "\n".join(t for t in (normalize.system_text(x) for x in _texts(_blocks(v, at))) if t)
    return ChatMessage(role="system", content=text) if text else None


def messages(body: dict) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    if body.get("system") is not None:
        m = _system(body["system"], "system")
        if m is not None:
            out.append(m)
    msgs = body.get("messages")
    if msgs is None:
        raise bad("messages", "'messages' is required")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "'messages' must be a non-empty list")
    for i, msg in enumerate(msgs):
        at = f"messages.{i}"
        role = message_role(msg, at, ROLES)
        if role == "system":
            m = _system(msg.get("content"), f"{at}.content")
            if m is not None:
                out.append(m)
            continue
        blocks = _blocks(msg.get("content"), f"{at}.content")
        if role == "assistant":
            calls = tuple(_tool_use(b, f"{at}.content.{j}") for j, b in enumerate(blocks) if b["type"] == "tool_use")
            texts = _texts(blocks, ("tool_use", "thinking", "redacted_thinking"))
            thought = "".join(b.get("thinking") or "" for b in blocks
                              if b["type"] == "thinking" and isinstance(b.get("thinking"), str))
            out.append(ChatMessage(role="assistant", content="\n".join(texts), tool_calls=calls, reasoning=thought))
            continue
        for j, b in enumerate(blocks):
            if b["type"] == "tool_result":
                out.append(_tool_result(b, f"{at}.content.{j}"))
        texts = _texts(blocks, ("tool_result",))
        if texts or not any(b["type"] == "tool_result" for b in blocks):
            out.append(ChatMessage(role="user", content="\n".join(texts)))
    return out


def tools(body: dict) -> tuple[str, str]:
    """Client tools ({name, description, input_schema}, no type or "custom"); Anthropic's own
    tool types (web search, bash, text editor, computer ...) are left out and logged."""
    ts = Toolset()
    for at, t in tool_list(body, lambda i: f"tools.{i}"):
        if t.get("type", "custom") != "custom":
            ts.skip(str(t.get("type")), "an Anthropic-defined tool this server does not run")
            continue
        if not isinstance(t.get("input_schema"), dict):
            raise bad(f"{at}.input_schema", "a tool needs an 'input_schema' object")
        ts.add(function_tool(t.get("name"), t.get("description"), t["input_schema"], at, "input_schema"), at)
    choice, names, out = body.get("tool_choice"), set(ts.tools), None
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
    return ts.json(), json_text(out) if out is not None else ""


def _output_format(body: dict) -> str:
    """`output_config.format` (structured outputs): a JSON schema the answer must follow."""
    cfg = body.get("output_config")
    fmt = cfg.get("format") if isinstance(cfg, dict) else None
    if fmt is None:
        return ""
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad("output_config.format", "'format' must be {\"type\": \"json_schema\", \"schema\": {...}}")
    return json_text({"type": "json_schema", "schema": fmt["schema"], "strict": True})


def _thread(body: dict) -> None:
    t = body.get("thread")
    if t is None:
        return
    kind = t.get("type") if isinstance(t, dict) else None
    if kind == "continue":
        raise ApiError(404, "thread not found: this server keeps no threads; send the whole conversation",
                       param="thread", code="thread_not_found")
    if kind != "create":
        raise bad("thread", "'thread' must be {\"type\": \"create\"} or {\"type\": \"continue\", ...}")


def parse(body: dict, rid: str, count_only: bool = False) -> Job:
    """`count_only`: /v1/messages/count_tokens, which needs no max_tokens."""
    _thread(body)
    if body.get("max_tokens") is None and not count_only:
        raise bad("max_tokens", "Field required")
    params = sampling(body, "max_tokens", ("temperature", "top_p", "top_k"), lo=1)
    msgs = messages(body)
    stop = stops(body, "stop_sequences", MAX_STOPS, one_string=False)
    tool_json, choice = tools(body)
    stream = get_bool(body, "stream")
    tc = body.get("tool_choice")
    parallel = not (isinstance(tc, dict) and tc.get("disable_parallel_tool_use") is True)
    last = msgs[-1] if msgs else None
    prefill = last is not None and last.role == "assistant" and bool(last.content) and not last.tool_calls
    if prefill and last.content != last.content.rstrip():
        raise bad("messages", "final assistant content cannot end with trailing whitespace")
    # logprobs carry every sampled token's bytes: how the frontend tells which stop string ended it
    req = GenerateRequest(rid=rid, kind="chat", sampling=params, messages=tuple(msgs), stop=stop,
                          continue_final=prefill,
                          tools=tool_json, tool_choice=choice, logprobs=bool(stop), parallel_tool_calls=parallel,
                          response_format=_output_format(body), count_only=count_only,
                          session_hint=session_hint(body, "metadata.user_id"))
    # a reasoning model's thinking comes back as thinking blocks only when asked for, as Anthropic's
    thinking = isinstance(body.get("thinking"), dict) and body["thinking"].get("type") in ("enabled", "adaptive")
    return Job(req, stream and not count_only, thinking=thinking)
