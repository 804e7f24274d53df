"""Request fields every API shares: typed getters, the model check, sampling, tools.

Knows the JSON bodies of the four APIs and the wire messages; nothing of tokens or templates.
A getter raises a 400 that names the param; None (or absent) means the default. A function
tool is validated only here (`function_tool`), whatever API it came from.
"""
from __future__ import annotations

import re

import msgspec

from common import templates
from common.messages import SamplingParams
from common.params import ParamError, validate_sampling
from procs.frontend.errors import ApiError, bad

UNTIL_FULL = 1 << 30        # no max_tokens: the renderer clamps it to the context left
TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")   # tool and schema names, every API
_I64_MIN, _U64_END = -(1 << 63), 1 << 64
# what a request that leaves a sampling field out gets: the server's --temp, --top-k, --top-p,
# --min-p and --seed (set_defaults, once per worker before it serves)
DEFAULTS = SamplingParams()


def json_text(v) -> str:
    return msgspec.json.encode(v).decode()


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


def logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: {"<token id>": bias, ...}, in id order (ranges: common/params.py)."""
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise bad("logit_bias", "'logit_bias' must be an object mapping token ids to numbers")
    out = {}
    for k, b in v.items():
        if not (isinstance(k, str) and k.isascii() and k.isdigit() and len(k) < 12):
            raise bad("logit_bias", f"logit_bias key {k!r} is not a token id")
        if type(b) not in (int, float):         # the range: common/params.py
            raise bad("logit_bias", f"logit_bias of token {k} must be a number")
        out[int(k)] = float(b)
    return tuple(sorted(out.items()))


def _repeat_penalty(body: dict, default: float) -> float:
    if body.get("repetition_penalty") is not None:
        return get_num(body, "repetition_penalty", default)
    return get_num(body, "repeat_penalty", default)


def get_bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if type(v) is not bool:
        raise bad(key, f"'{key}' must be a boolean")
    return v


EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def reasoning_effort(body: dict, key: str) -> str:
    """The reasoning effort at key (a dotted path into body), one of OpenAI's values; ""
    when not given."""
    v = body
    for part in key.split("."):
        v = v.get(part) if isinstance(v, dict) else None
    if v is None:
        return ""
    if v not in EFFORTS:
        raise bad(key, f"'{key}' must be one of {', '.join(EFFORTS)}")
    return v


def template_kwargs(body: dict, key: str) -> str:
    """The request's extra chat template variables (vLLM's and llama.cpp's chat_template_kwargs)
    as JSON text; "" when not given."""
    v = body.get(key)
    if v is None:
        return ""
    if not isinstance(v, dict):
        raise bad(key, f"'{key}' must be an object")
    taken = sorted(templates.RESERVED_VARS & set(v))
    if taken:
        raise bad(key, f"'{key}' cannot set {', '.join(taken)}: the server sets them")
    return json_text(v)


def session_hint(body: dict, *keys: str) -> str:
    """The first of keys (a dotted path into body) that is a non-empty string: which
    conversation the client says this is. Only a hint for which resident session to prefer;
    other types are ignored rather than refused (the APIs define no stricter check)."""
    for key in keys:
        v = body
        for part in key.split("."):
            v = v.get(part) if isinstance(v, dict) else None
        if isinstance(v, str) and v:
            return v[:256]
    return ""


def check_model(body: dict, served_id: str, strict: bool) -> None:
    """Any model name is served by the loaded model (agents send their vendor's names), unless
    `strict`; the answer always names the model that served it."""
    model = body.get("model")
    if model is None or model == "":
        return
    if not isinstance(model, str):
        raise bad("model", "'model' must be a string")
    if strict and model != served_id:
        raise ApiError(404, f"The model `{model}` does not exist or you do not have access to it.",
                       param="model", code="model_not_found")


def set_defaults(settings) -> None:
    global DEFAULTS
    d = SamplingParams(temperature=settings.temp, top_k=settings.top_k, top_p=settings.top_p,
                       min_p=settings.min_p, seed=settings.seed if settings.seed >= 0 else None,
                       repeat_penalty=settings.repeat_penalty, repeat_last_n=settings.repeat_last_n)
    try:
        validate_sampling(d)
    except ParamError as e:
        raise SystemExit(f"error: the sampling defaults (--temp, --top-k, --top-p, --min-p, --repeat-penalty, "
                         f"--repeat-last-n): {e}") from None
    DEFAULTS = d


def sampling(body: dict, max_key: str, keys: tuple[str, ...], top_logprobs: int = 0,
             lo: int = 0) -> SamplingParams:
    """The sampling fields the API has (`keys`, among temperature, top_p, top_k, min_p, seed,
    ignore_eos, logit_bias, presence_penalty, frequency_penalty, repetition_penalty (vLLM's name;
    llama.cpp's repeat_penalty is taken too), repeat_last_n)
    and its token limit (`max_key`; absent: until the context is full). The one place the
    limit is clamped before the renderer fits it to the context."""
    mt = get_int(body, max_key)
    if mt is not None and mt < lo:
        raise bad(max_key, f"'{max_key}' must be >= {lo}")
    d = DEFAULTS
    p = SamplingParams(max_tokens=UNTIL_FULL if mt is None else min(mt, UNTIL_FULL),
                       temperature=get_num(body, "temperature", d.temperature) if "temperature" in keys else d.temperature,
                       top_p=get_num(body, "top_p", d.top_p) if "top_p" in keys else d.top_p,
                       top_k=min(get_int(body, "top_k", d.top_k), UNTIL_FULL) if "top_k" in keys else d.top_k,
                       min_p=get_num(body, "min_p", d.min_p) if "min_p" in keys else d.min_p,
                       seed=get_int(body, "seed", d.seed) if "seed" in keys else d.seed,
                       ignore_eos=get_bool(body, "ignore_eos") if "ignore_eos" in keys else False,
                       top_logprobs=top_logprobs,
                       logit_bias=logit_bias(body) if "logit_bias" in keys else (),
                       presence_penalty=get_num(body, "presence_penalty", 0.0) if "presence_penalty" in keys else 0.0,
                       frequency_penalty=get_num(body, "frequency_penalty", 0.0) if "frequency_penalty" in keys else 0.0,
                       repeat_penalty=_repeat_penalty(body, d.repeat_penalty) if "repetition_penalty" in keys
                       else d.repeat_penalty,
                       repeat_last_n=get_int(body, "repeat_last_n", d.repeat_last_n) if "repeat_last_n" in keys
                       else d.repeat_last_n)
    try:
        validate_sampling(p)
    except ParamError as e:
        raise bad(max_key if e.param == "max_tokens" else e.param, str(e)) from None
    return p


def message_role(msg, at: str, roles: tuple[str, ...]) -> str:
    """The role of one message (an object), among `roles`."""
    if not isinstance(msg, dict):
        raise bad(at, "each message must be an object")
    role = msg.get("role")
    if role not in roles:
        raise bad(f"{at}.role", f"unknown role {role!r}; expected one of {', '.join(roles)}")
    return role


def stops(body: dict, key: str, most: int, one_string: bool) -> tuple[str, ...]:
    """Stop strings: a list of at most `most` strings (or one string, where the API allows)."""
    v = body.get(key)
    if v is None:
        return ()
    if isinstance(v, str) and one_string:
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad(key, f"'{key}' must be {'a string or ' if one_string else ''}a list of strings")
    if len(v) > most:
        raise bad(key, f"'{key}' may hold at most {most} strings")
    return tuple(s for s in v if s)


def function_tool(name, description, parameters, at: str, schema_key: str = "parameters",
                  strict=None, name_at: str | None = None) -> dict:
    """One function tool in the chat shape ({"type": "function", "function": {...}}), keys in
    the order a chat client sends them, so the same tools render (and cache) alike from every
    API. `at` is where the tool sits in the request, for the 400s."""
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise bad(name_at or f"{at}.name", "a tool needs a 'name' of 1-64 letters, digits, '_', '-', '.'")
    fn: dict = {"name": name}
    if description is not None:
        if not isinstance(description, str):
            raise bad(f"{at}.description", "'description' must be a string")
        fn["description"] = description
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise bad(f"{at}.{schema_key}", f"'{schema_key}' must be a JSON Schema object")
        fn["parameters"] = parameters
    if strict is not None:
        if not isinstance(strict, bool):
            raise bad(f"{at}.strict", "'strict' must be a boolean")
        fn["strict"] = strict
    return {"type": "function", "function": fn}


def named_choice(name, names: set, param: str) -> dict:
    if not isinstance(name, str) or name not in names:
        raise bad(param, f"'{param}' names {name!r}, which is not among the tools")
    return {"type": "function", "function": {"name": name}}


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
