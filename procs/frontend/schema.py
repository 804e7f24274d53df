"""OpenAI request bodies -> GenerateRequest, with a 400 naming the param for bad input.

Knows the OpenAI request schema and the wire messages; nothing of tokens or templates
(the renderer renders and tokenizes). A body that gets past here is well typed; limits that
need the tokenizer (the context length) are the renderer's to report.
"""
from __future__ import annotations

import re

from dataclasses import dataclass

import msgspec

from common.messages import ChatMessage, GenerateRequest, SamplingParams, ToolCall, ToolCallFunction
from common.params import ParamError, validate_sampling
from procs.frontend.errors import ApiError, bad

UNTIL_FULL = 1 << 30        # no max_tokens: the renderer clamps it to the context left
MAX_STOPS = 4
ROLES = ("system", "developer", "user", "assistant", "tool")
_I64_MIN, _U64_END = -(1 << 63), 1 << 64


@dataclass(frozen=True)
class Parsed:
    req: GenerateRequest
    stream: bool
    include_usage: bool


# -- typed getters: None (or absent) means the default -----------------------------------

def get_int(body: dict, key: str, default=None, lo: int | None = None):
    v = body.get(key)
    if v is None:
        return default
    if type(v) is not int:
        raise bad(key, f"'{key}' must be an integer")
    if not _I64_MIN <= v < _U64_END:
        raise bad(key, f"'{key}' is out of range")
    if lo is not None and v < lo:
        raise bad(key, f"'{key}' must be >= {lo}")
    return v


def get_num(body: dict, key: str, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if type(v) not in (int, float):
        raise bad(key, f"'{key}' must be a number")
    try:
        f = float(v)
    except OverflowError:           # an int beyond float range
        raise bad(key, f"'{key}' is out of range") from None
    if f != f or f in (float("inf"), float("-inf")):
        raise bad(key, f"'{key}' must be a finite number")
    return f


def get_bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if type(v) is not bool:
        raise bad(key, f"'{key}' must be a boolean")
    return v


def check_model(body: dict, served_id: str) -> None:
    model = body.get("model")
    if model is None or model == "":
        return
    if not isinstance(model, str):
        raise bad("model", "'model' must be a string")
    if model != served_id:
        raise ApiError(404, f"The model `{model}` does not exist or you do not have access to it.",
                       param="model", code="model_not_found")


def _sampling(body: dict, top_logprobs: int) -> SamplingParams:
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    mt = get_int(body, key)
    if mt is not None and mt < 0:
        raise bad(key, f"'{key}' must be >= 0")
    d = SamplingParams()
    seed = get_int(body, "seed")
    p = SamplingParams(max_tokens=UNTIL_FULL if mt is None else min(mt, UNTIL_FULL),
                       temperature=get_num(body, "temperature", d.temperature),
                       top_p=get_num(body, "top_p", d.top_p),
                       top_k=min(get_int(body, "top_k", d.top_k), UNTIL_FULL),
                       min_p=get_num(body, "min_p", d.min_p),
                       seed=seed, top_logprobs=top_logprobs)
    try:
        validate_sampling(p)
    except ParamError as e:
        raise bad(key if e.param == "max_tokens" else e.param, str(e)) from None
    return p


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("stop", "'stop' must be a string or a list of strings")
    if len(v) > MAX_STOPS:
        raise bad("stop", f"'stop' may hold at most {MAX_STOPS} strings")
    return tuple(s for s in v if s)


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
    usage = opts.get("include_usage")
    if usage is not None and type(usage) is not bool:
        raise bad("stream_options.include_usage", "'include_usage' must be a boolean")
    return stream, bool(usage)


def json_text(v) -> str:
    return msgspec.json.encode(v).decode()


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
    if not isinstance(msg, dict):
        raise bad(at, "each message must be an object")
    role = msg.get("role")
    if role not in ROLES:
        raise bad(f"{at}.role", f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    content = _content(msg.get("content"), f"{at}.content")
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
        raise bad(f"{at}.content", f"a {role} message needs content")
    return ChatMessage(role=role, content=content or "", tool_calls=calls, tool_call_id=call_id, name=name)


TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")   # tool and schema names, every API


def _tools(body: dict) -> tuple[str, str]:
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
            name = fn.get("name")
            if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
                raise bad(f"{at}.function.name", "a function needs a 'name' of 1-64 letters, digits, '_', '-', '.'")
            if "parameters" in fn and not isinstance(fn["parameters"], dict):
                raise bad(f"{at}.function.parameters", "'parameters' must be a JSON Schema object")
            if "description" in fn and not isinstance(fn["description"], str):
                raise bad(f"{at}.function.description", "'description' must be a string")
            if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
                raise bad(f"{at}.function.strict", "'strict' must be a boolean")
            names.add(name)
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
            if name not in names:
                raise bad("tool_choice", f"'tool_choice' names {name!r}, which is not among the tools")
        else:
            raise bad("tool_choice", "'tool_choice' must be a string or an object")
    return (json_text(tools) if tools else "", json_text(choice) if choice is not None else "")


def output_format(fmt, param: str, schema_at: str) -> str:
    """A response format ({"type": "text" | "json_object" | "json_schema", ...}) as the
    renderer takes it: "" for text, else {"type", "schema", "strict"} as JSON. `schema_at`
    is where the schema sits below `param` (chat nests it in "json_schema", Responses not)."""
    if fmt is None:
        return ""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return ""
    if kind == "json_object":
        return json_text({"type": "json_object"})
    if kind != "json_schema":
        raise bad(f"{param}.type", f"'{param}.type' must be text, json_object or json_schema")
    holder = fmt.get(schema_at) if schema_at else fmt
    where = f"{param}.{schema_at}" if schema_at else param
    if not isinstance(holder, dict):
        raise bad(where, f"'{where}' must be an object")
    name = holder.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise bad(f"{where}.name", "a json_schema needs a 'name' of 1-64 letters, digits, '_', '-', '.'")
    schema = holder.get("schema", {})
    if not isinstance(schema, dict):
        raise bad(f"{where}.schema", "'schema' must be a JSON Schema object")
    strict = holder.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad(f"{where}.strict", "'strict' must be a boolean")
    return json_text({"type": "json_schema", "schema": schema, "strict": bool(strict)})


def parse_chat(body: dict, served_id: str, rid: str) -> Parsed:
    check_model(body, served_id)
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
    sampling = _sampling(body, top)
    stream, usage = _stream(body)
    tools, choice = _tools(body)
    req = GenerateRequest(rid=rid, kind="chat", sampling=sampling, messages=messages, stop=_stop(body),
                          tools=tools, tool_choice=choice, logprobs=logprobs,
                          response_format=output_format(body.get("response_format"), "response_format", "json_schema"),
                          parallel_tool_calls=get_bool(body, "parallel_tool_calls") is True)
    return Parsed(req, stream, usage)


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


def parse_completion(body: dict, served_id: str, rid: str) -> Parsed:
    check_model(body, served_id)
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
    sampling = _sampling(body, lp or 0)
    stream, usage = _stream(body)
    req = GenerateRequest(rid=rid, kind="completion", sampling=sampling, prompt=prompt, stop=_stop(body),
                          logprobs=lp is not None)
    return Parsed(req, stream, usage)
