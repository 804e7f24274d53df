"""OpenAI Responses request bodies -> GenerateRequest (the answer side is responses.py).

Input items map onto chat messages: `instructions` -> a leading system message; messages
(user/system/developer/assistant; text parts, other parts left out) as they are;
`function_call` and `custom_tool_call` items -> an assistant message with tool_calls whose
ids are the items' `call_id` (merged into the assistant message right before them, so text +
calls of one answer replay as the exact sampled bytes); their outputs -> tool messages;
what hosted tools left are skipped; a reasoning item's text goes with the assistant answer
after it (its thinking, for a template that renders it).

Tools: `function`; `namespace` (its members rendered as tools of their own name); `custom`
(free-form input, shown to the model as a function of one string); the built-in tools the
server cannot run (web_search, file_search, mcp, ... and any future type) are left out of
the prompt and logged once. No server-side state: `previous_response_id` (and
`conversation`) get a 400 asking for the whole input; `store`, `include`, `reasoning`,
`truncation`, `metadata`, `prompt_cache_key`, `user` are accepted, and `reasoning.effort` goes
to the chat template as `reasoning_effort` (gpt-oss's).
"""
from __future__ import annotations

import logging

from common.messages import ChatMessage, GenerateRequest, ToolCall, ToolCallFunction
from procs.frontend import normalize
from procs.frontend.errors import bad
from procs.frontend.fields import (TOOL_NAME, function_tool, get_bool, reasoning_effort, session_hint, json_text,
                                   message_role, named_choice, output_format, sampling)
from procs.frontend.flow import Job
from procs.frontend.toolset import CUSTOM_PARAMETERS, Toolset, custom_arguments, tool_list

log = logging.getLogger("web")

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
STATEFUL = ("previous_response_id", "conversation")
CALLS = ("function_call", "custom_tool_call")
OUTPUTS = ("function_call_output", "custom_tool_call_output")
# what hosted tools leave in a conversation: nothing of it reaches the prompt
HOSTED_ITEMS = ("web_search_call", "file_search_call", "computer_call", "computer_call_output",
                "image_generation_call", "code_interpreter_call", "local_shell_call", "local_shell_call_output",
                "mcp_list_tools", "mcp_approval_request", "mcp_approval_response", "mcp_call")


def _text(v, at: str, what: str) -> str:
    """A string, or a list of content parts: the text parts joined by newlines; parts the
    model cannot read (images, files, audio) are left out and logged."""
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise bad(at, f"{what} must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(v):
        if not isinstance(part, dict):
            raise bad(f"{at}[{j}]", "a content part must be an object")
        kind = part.get("type")
        if kind in TEXT_PARTS:
            if not isinstance(part.get("text"), str):
                raise bad(f"{at}[{j}].text", "a text part needs a string 'text'")
            texts.append(part["text"])
        elif kind == "refusal":
            texts.append(part.get("refusal") or "")
        elif isinstance(kind, str):
            log.info("content part of type %r left out (this model reads text only)", kind)
        else:
            raise bad(f"{at}[{j}].type", "a content part needs a 'type'")
    return "\n".join(texts)


def _str(item: dict, key: str, at: str) -> str:
    v = item.get(key)
    if not isinstance(v, str) or (key not in ("arguments", "input") and not v):
        raise bad(f"{at}.{key}", f"'{key}' must be a non-empty string" if key not in ("arguments", "input")
                  else f"'{key}' must be a string")
    return v


def _call(item: dict, at: str, tools: Toolset) -> ToolCall:
    """A function_call or custom_tool_call item as the call the prompt renders."""
    ns = item.get("namespace")
    if ns is not None and not isinstance(ns, str):
        raise bad(f"{at}.namespace", "'namespace' must be a string")
    name = tools.prompt_name(_str(item, "name", at), ns)
    if item.get("type") == "custom_tool_call":
        args = custom_arguments(_str(item, "input", at))
    else:
        args = _str(item, "arguments", at)
    return ToolCall(id=_str(item, "call_id", at), function=ToolCallFunction(name=name, arguments=args))


def _messages(body: dict, tools: Toolset) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    instr = body.get("instructions")
    if instr is not None:
        if not isinstance(instr, str):
            raise bad("instructions", "'instructions' must be a string")
        instr = normalize.system_text(instr)
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
    thought = ""                # a reasoning item's text, for the assistant message after it
    for i, item in enumerate(inp):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(at, "each input item must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = message_role(item, at, ROLES)
            text = _text(item.get("content"), f"{at}.content", "content")
            if role in ("system", "developer"):
                text = normalize.system_text(text)
            out.append(ChatMessage(role=role, content=text, reasoning=thought if role == "assistant" else ""))
            prev_open, thought = role == "assistant", ""
        elif kind in CALLS:
            call = _call(item, at, tools)
            if prev_open:
                last = out[-1]
                out[-1] = ChatMessage(role="assistant", content=last.content, tool_calls=last.tool_calls + (call,),
                                      reasoning=last.reasoning)
            else:
                out.append(ChatMessage(role="assistant", content="", tool_calls=(call,), reasoning=thought))
            prev_open, thought = True, ""
        elif kind in OUTPUTS:
            out.append(ChatMessage(role="tool", content=_text(item.get("output"), f"{at}.output", "'output'"),
                                   tool_call_id=_str(item, "call_id", at)))
            prev_open = False
        elif kind == "reasoning":   # its text (ours: content; others': summary) goes with the answer after it
            thought += _reasoning_text(item)
        elif kind in HOSTED_ITEMS:
            continue            # never produced here; a client may echo one back
        elif kind == "item_reference":
            raise bad(f"{at}.type", "item references need stored responses, and none are kept: "
                      "send the items themselves")
        else:
            raise bad(f"{at}.type", f"input item type {kind!r} is not supported; expected message, "
                      "function_call, custom_tool_call or their outputs")
    return out


def _reasoning_text(item: dict) -> str:
    """A reasoning item's text: its reasoning_text parts, else its summary's (an encrypted
    one carries none)."""
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list):
            text = "".join(p.get("text", "") for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
            if text:
                return text
    return ""


def _function(t: dict, at: str, tools: Toolset, namespace: str | None = None) -> None:
    tools.add(function_tool(t.get("name"), t.get("description"), t.get("parameters"), at,
                            strict=t.get("strict")), at, namespace)


def _tools(body: dict) -> Toolset:
    tools = Toolset()
    for at, t in tool_list(body, lambda i: f"tools[{i}]"):
        kind = t.get("type")
        if kind == "function":
            _function(t, at, tools)
        elif kind == "namespace":
            ns, members = t.get("name"), t.get("tools")
            if not isinstance(ns, str) or not TOOL_NAME.fullmatch(ns):
                raise bad(f"{at}.name", "a namespace needs a 'name' of 1-64 letters, digits, '_', '-', '.'")
            if not isinstance(members, list) or not all(isinstance(x, dict) for x in members):
                raise bad(f"{at}.tools", "a namespace needs a list of tools")
            for j, x in enumerate(members):
                if x.get("type", "function") != "function":
                    raise bad(f"{at}.tools[{j}].type", "a namespace holds function tools")
                _function(x, f"{at}.tools[{j}]", tools, ns)
        elif kind == "custom":
            tools.add(function_tool(t.get("name"), _custom_description(t), CUSTOM_PARAMETERS, at), at,
                      custom=True)
        elif isinstance(kind, str):
            tools.skip(kind, "a built-in tool this server cannot run")
        else:
            raise bad(f"{at}.type", "a tool needs a 'type'")
    return tools


def _custom_description(t: dict) -> str | None:
    """A custom tool's description, with what its free-form input must look like."""
    desc = t.get("description")
    fmt = t.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        rule = f"The input follows this {fmt.get('syntax', 'grammar')} grammar:\n{fmt['definition']}"
        return f"{desc}\n\n{rule}" if isinstance(desc, str) and desc else rule
    return desc


def _choice(body: dict, tools: Toolset) -> str:
    choice = body.get("tool_choice")
    if choice is None:
        return ""
    names = set(tools.tools)
    if choice in ("none", "auto", "required"):
        if choice == "required" and not names:
            raise bad("tool_choice", "'tool_choice' is required but no tools were given")
        return json_text(choice)
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("function", "custom"):
        name = choice.get("name")
        prompt = tools.prompt_name(name, choice.get("namespace")) if isinstance(name, str) else name
        return json_text(named_choice(prompt, names, "tool_choice"))
    if kind == "allowed_tools":
        mode = choice.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise bad("tool_choice.mode", "'mode' must be auto or required")
        return json_text(mode)
    if isinstance(kind, str):        # a hosted tool: it is not in the prompt, so nothing is forced
        tools.skip(kind, "a built-in tool this server cannot run")
        return json_text("auto")
    raise bad("tool_choice", "'tool_choice' must be none, auto, required or {\"type\": \"function\", \"name\": ...}")


def parse(body: dict, rid: str) -> Job:
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
    tools = _tools(body)
    messages = _messages(body, tools)
    params = sampling(body, "max_output_tokens", ("temperature", "top_p"), lo=1)
    choice = _choice(body, tools)
    stream = get_bool(body, "stream")
    get_bool(body, "store")
    req = GenerateRequest(rid=rid, kind="chat", sampling=params, messages=tuple(messages),
                          tools=tools.json(), tool_choice=choice, response_format=out_format,
                          parallel_tool_calls=get_bool(body, "parallel_tool_calls") is True,
                          session_hint=session_hint(body, "prompt_cache_key", "user"),
                          reasoning_effort=reasoning_effort(body, "reasoning.effort"))
    return Job(req, stream, body=body, tools=tools)
