"""OpenAI request bodies -> GenerateRequest, with a 400 naming the param for bad input.

Knows the OpenAI request schema and the wire messages; nothing of tokens or templates
(the renderer renders and tokenizes). A body that gets past here is well typed; limits that
need the tokenizer (the context length) are the renderer's to report.
"""
from __future__ import annotations

from common.messages import ChatMessage, GenerateRequest, SamplingParams, ToolCall, ToolCallFunction
from procs.frontend import normalize
from procs.frontend.errors import bad
from procs.frontend.fields import (function_tool, get_bool, reasoning_effort, session_hint, get_int, json_text,
                                   named_choice, message_role, output_format, sampling, stops, template_kwargs)
from procs.frontend.flow import Job

MAX_STOPS = 4
ROLES = ("system", "developer", "user", "assistant", "tool")


def _sampling(body: dict, top_logprobs: int) -> SamplingParams:
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return sampling(body, key, ("temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos", "logit_bias",
                                "presence_penalty", "frequency_penalty", "repetition_penalty", "repeat_last_n"),
                    top_logprobs)


def _n(body: dict) -> None:
    n = body.get("n")
    if n is not None and not (type(n) is int and n == 1):
        raise bad("n", "only n=1 is supported")


def _stream(body: dict) -> tuple[bool, bool]:
    stream = get_bool(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not isinstance(opts, dict):
        raise bad("stream_options", "'stream_options' must be an object")
    if not stream:                  # as OpenAI and vLLM answer it
        raise bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
    usage = opts.get("include_usage")
    if usage is not None and type(usage) is not bool:
        raise bad("stream_options.include_usage", "'include_usage' must be a boolean")
    return stream, bool(usage)


# -- chat --------------------------------------------------------------------------------

def _content(v, where: str) -> str | None:
    if v is None or isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise bad(where, "content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(v):
        if not isinstance(part, dict):
            raise bad(f"{where}[{j}]", "a content part must be an object")
        if part.get("type") != "text":
            raise bad(f"{where}[{j}].type", f"content part type {part.get('type')!r} is not supported; "
                      "only 'text' parts are")
        text = part.get("text")
        if not isinstance(text, str):
            raise bad(f"{where}[{j}].text", "a text part needs a string 'text'")
        texts.append(text)
    return "\n".join(texts) if texts else None


def _tool_calls(v, where: str) -> tuple[ToolCall, ...]:
    if v is None:
        return ()
    if not isinstance(v, list):
        raise bad(where, "'tool_calls' must be a list")
    out = []
    for j, c in enumerate(v):
        at = f"{where}[{j}]"
        if not isinstance(c, dict):
            raise bad(at, "a tool call must be an object")
        cid, fn = c.get("id"), c.get("function")
        if not isinstance(cid, str):
            raise bad(f"{at}.id", "a tool call needs a string 'id'")
        if c.get("type", "function") != "function":
            raise bad(f"{at}.type", "only tool calls of type 'function' are supported")
        if not isinstance(fn, dict):
            raise bad(f"{at}.function", "a tool call needs a 'function' object")
        name, args = fn.get("name"), fn.get("arguments", "")
        if not isinstance(name, str):
            raise bad(f"{at}.function.name", "'function.name' must be a string")
        if not isinstance(args, str):
            raise bad(f"{at}.function.arguments", "'function.arguments' must be a string (JSON text)")
        out.append(ToolCall(id=cid, function=ToolCallFunction(name=name, arguments=args)))
    return tuple(out)


def _message(i: int, msg) -> ChatMessage:
    at = f"messages[{i}]"
    role = message_role(msg, at, ROLES)
    content = _content(msg.get("content"), f"{at}.content")
    if role in ("system", "developer") and content:
        content = normalize.system_text(content)
    name = msg.get("name")
    if name is not None and not isinstance(name, str):
        raise bad(f"{at}.name", "'name' must be a string")
    calls = ()
    if "tool_calls" in msg and msg["tool_calls"] is not None:
        if role != "assistant":
            raise bad(f"{at}.tool_calls", "only assistant messages may carry tool_calls")
        calls = _tool_calls(msg["tool_calls"], f"{at}.tool_calls")
    call_id = None
    if role == "tool":
        call_id = msg.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise bad(f"{at}.tool_call_id", "a tool message needs a string 'tool_call_id'")
    if (not content if role == "user" else content is None) and not (role == "assistant" and calls):
        raise bad(f"{at}.content", f"{'an' if role[0] in 'aeiou' else 'a'} {role} message needs content")
    reasoning = ""
    if role == "assistant":   # an answer's thinking sent back (llama.cpp's and vLLM's field; OpenRouter's)
        key = "reasoning_content" if msg.get("reasoning_content") is not None else "reasoning"
        reasoning = msg.get(key) or ""
        if not isinstance(reasoning, str):
            raise bad(f"{at}.{key}", f"'{key}' must be a string")
    return ChatMessage(role=role, content=content or "", tool_calls=calls, tool_call_id=call_id, name=name,
                       reasoning=reasoning)


def _tools(body: dict) -> tuple[str, str]:
    """Validated through the one function-tool check; passed on as the client sent them (the
    rendered prompt, and so the cache key, keeps every key the client gave)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    names = set()
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise bad("tools", "'tools' must be a list of objects")
        for i, t in enumerate(tools):
            at = f"tools[{i}]"
            if t.get("type", "function") != "function":
                raise bad(f"{at}.type", "only tools of type 'function' are supported")
            fn = t.get("function")
            if not isinstance(fn, dict):
                raise bad(f"{at}.function", "a tool needs a 'function' object")
            function_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), f"{at}.function",
                          strict=fn.get("strict"))
            names.add(fn["name"])
    if choice is not None:
        if isinstance(choice, str):
            if choice not in ("none", "auto", "required"):
                raise bad("tool_choice", "'tool_choice' must be none, auto, required or a function")
            if choice == "required" and not names:
                raise bad("tool_choice", "'tool_choice' is required but no tools were given")
        elif isinstance(choice, dict):
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            if choice.get("type") != "function" or not isinstance(name, str):
                raise bad("tool_choice", "a named 'tool_choice' is {\"type\": \"function\", \"function\": {\"name\": ...}}")
            named_choice(name, names, "tool_choice")
        else:
            raise bad("tool_choice", "'tool_choice' must be a string or an object")
    return (json_text(tools) if tools else "", json_text(choice) if choice is not None else "")


def parse_chat(body: dict, rid: str) -> Job:
    msgs = body.get("messages")
    if msgs is None:
        raise bad("messages", "'messages' is required")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "'messages' must be a non-empty list")
    messages = tuple(_message(i, x) for i, x in enumerate(msgs))
    _n(body)
    logprobs = get_bool(body, "logprobs")
    top = get_int(body, "top_logprobs", 0)
    if top and not logprobs:
        raise bad("top_logprobs", "'logprobs' must be true when 'top_logprobs' is used")
    params = _sampling(body, top)
    stream, usage = _stream(body)
    tools, choice = _tools(body)
    req = GenerateRequest(rid=rid, kind="chat", sampling=params, messages=messages,
                          stop=stops(body, "stop", MAX_STOPS, one_string=True),
                          tools=tools, tool_choice=choice, logprobs=logprobs,
                          response_format=output_format(body.get("response_format"), "response_format", "json_schema"),
                          parallel_tool_calls=get_bool(body, "parallel_tool_calls") is True,
                          session_hint=session_hint(body, "prompt_cache_key", "user"),
                          reasoning_effort=reasoning_effort(body, "reasoning_effort"),
                          template_kwargs=template_kwargs(body, "chat_template_kwargs"),
                          continue_final=_continue_final(body, messages))
    return Job(req, stream, include_usage=usage)


def _continue_final(body: dict, messages) -> bool:
    """vLLM's continue_final_message: the answer goes on from the last (assistant) message."""
    if not get_bool(body, "continue_final_message"):
        return False
    if messages[-1].role != "assistant" or messages[-1].tool_calls or not messages[-1].content:
        raise bad("continue_final_message", "continue_final_message needs a final assistant message with text")
    return True


# -- completions -------------------------------------------------------------------------

def _prompt(body: dict) -> str:
    p = body.get("prompt")
    if p is None:
        raise bad("prompt", "'prompt' is required")
    if isinstance(p, list):
        if len(p) != 1 or not isinstance(p[0], str):
            raise bad("prompt", "'prompt' must be a string or a list of exactly one string "
                      "(token-id and batched prompts are not supported)")
        p = p[0]
    if not isinstance(p, str):
        raise bad("prompt", "'prompt' must be a string")
    return p


def parse_completion(body: dict, rid: str) -> Job:
    prompt = _prompt(body)
    _n(body)
    if body.get("echo") is not None and get_bool(body, "echo"):
        raise bad("echo", "echo is not supported")
    best_of = body.get("best_of")
    if best_of is not None and not (type(best_of) is int and best_of == 1):
        raise bad("best_of", "only best_of=1 is supported")
    suffix = body.get("suffix")
    if suffix is not None and suffix != "":
        raise bad("suffix", "suffix is not supported")
    lp = body.get("logprobs")
    if type(lp) is bool:            # some clients send the chat style
        lp = 0 if lp else None
    elif lp is not None:
        lp = get_int(body, "logprobs")
        if not 0 <= lp <= 20:
            raise bad("logprobs", "'logprobs' must be between 0 and 20")
    params = _sampling(body, lp or 0)
    stream, usage = _stream(body)
    req = GenerateRequest(rid=rid, kind="completion", sampling=params, prompt=prompt,
                          stop=stops(body, "stop", MAX_STOPS, one_string=True),
                          logprobs=lp is not None)
    return Job(req, stream, include_usage=usage)
