"""Tool-call formats: how a model family writes its calls, and whether its chat template
renders tools and calls itself. One small description per family; tools.py (parse, replay),
grammar.py (constrained calls) and prompt.py (rendering) read only these fields.

A calls block is `block_open + call (sep call)* + block_close`, a call is
`head_pre + name_part(name) + <arguments JSON> + tail`. The JSON spacing is json.dumps'
(", " and ": "), the spacing a template's `tojson` renders a call from the client's JSON with,
so a constrained call renders back byte for byte even when its id is unknown.

Families (the format is recognised in the GGUF's own template text, as llama.cpp does):
- generic: the template has no tool syntax; the tools are listed in the system message
  (tools.tools_text) and calls are `<tool_call>` JSON blocks written into the content.
- hermes (Qwen2.5, Qwen3, Hermes): the template takes `tools=` and renders `tool_calls` as
  `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`.
- llama3 (Llama 3.1-3.3): one bare `{"name": ..., "parameters": ...}` object per answer.
- mistral (v3 / Nemo / Small 3.1): `[TOOL_CALLS][{"name": ..., "arguments": ...}, ...]`,
  call ids of 9 letters and digits (the templates refuse others).
- mistral_args (Mistral Small 3.2, Devstral, tokenizer v11+): `[TOOL_CALLS]name[ARGS]{...}`
  per call.
- harmony (gpt-oss): reasoning, answer and calls as channels of messages, in its own special
  tokens (procs/renderer/harmony.py); under auto the calls are the model's own, unconstrained.
- qwen_xml (Qwen3-Coder, later Qwen templates): `<tool_call>\n<function=NAME>\n` then
  `<parameter=KEY>\nVALUE\n</parameter>\n` per argument, `</function>\n</tool_call>`; a
  string value as it is, any other as JSON (procs/renderer/toolxml.py).
- seed_xml (Seed-OSS): qwen_xml's bodies inside `<seed:tool_call>`, a value as
  `<parameter=KEY>VALUE</parameter>\n`.
- glm (GLM-4.5, 4.6): `<tool_call>NAME\n` then `<arg_key>KEY</arg_key>\n<arg_value>VALUE`
  `</arg_value>\n` per argument, `</tool_call>`; glm_compact (GLM-4.7 and later): the same
  without the newlines. Values as qwen_xml's.

Fenced calls: small models of the tag formats (Qwen2.5 0.5B-1.5B) often answer with a
Markdown-fenced object, ```` ```json\n{"name": ..., "arguments": ...}\n``` ````, instead of the
tags. An answer that *opens* with such a block (the fence, then an object whose first key is
"name"; common/guidance.py recognises it) is taken as one call of a declared tool, as
llama.cpp's Hermes parser takes it. Under tool_choice auto the grammar starts at the name
and holds it to a declared tool: llama.cpp waits for a declared name, but a small model
asked to run `cat main.py` names its call "cat main.py". The block is replayed as sampled.
"""
from __future__ import annotations

import json
import re
import secrets
import string
import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from procs.renderer import harmony

_ALNUM = string.ascii_letters + string.digits


def _hermes_name(name: str, key: str) -> str:
    return '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "' + key + '": '


@dataclass(frozen=True)
class Format:
    name: str
    native: bool            # the template renders `tools` and `tool_calls` itself
    trigger: str            # what the model writes to open its calls (auto: the grammar starts after it)
    block_open: str = ""
    head_pre: str = ""
    args_key: str = "arguments"   # JSON-object calls: the key of the arguments
    tail: str = "}"
    sep: str = ""
    block_close: str = ""
    parallel: bool = True   # several calls fit in one answer
    kind: str = "tags"      # how the block parses: tags | object | array | args | xml
    close: str = ""         # tags, xml: the closing tag of a call
    short_ids: bool = False  # ids of 9 letters and digits (Mistral's templates check them)
    value_open: str = ""    # xml: what comes between <parameter=KEY> and the value
    value_close: str = ""   # xml: what ends a value
    # xml: the function's name between name_open and name_close (empty: the name ends where
    # a key or the call's close begins), each key between key_open and key_close, and
    # fn_close after the last value (empty: the call's close follows it)
    name_open: str = "<function="
    name_close: str = ">\n"
    key_open: str = "<parameter="
    key_close: str = ">"
    fn_close: str = "</function>"

    def name_part(self, name: str) -> str:
        if self.kind == "args":
            return name + "[ARGS]"
        if self.kind == "xml":
            return self.name_open + name + self.name_close
        return _hermes_name(name, self.args_key)

    def call_text(self, name: str, args_json: str) -> str:
        if self.kind == "xml":      # each value as the family's template renders it
            args = json.loads(args_json)
            return self.head_pre + self.name_part(name) + "".join(
                f"{self.key_open}{k}{self.key_close}{self.value_open}"
                f"{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}{self.value_close}"
                for k, v in args.items()) + self.tail
        return self.head_pre + self.name_part(name) + args_json + self.tail

    def block(self, calls: list[tuple[str, str]]) -> str:
        """A calls block rendered from (name, arguments JSON) pairs."""
        return self.block_open + self.sep.join(self.call_text(n, a) for n, a in calls) + self.block_close

    def opener(self, choice) -> str:
        """Text appended to the generation prompt so that the model completes a call:
        `required` opens the block, a named choice opens that call up to its arguments."""
        if choice == "required":
            return self.block_open + self.head_pre
        if isinstance(choice, dict):
            return self.block_open + self.head_pre + self.name_part(choice["function"]["name"])
        return ""

    def new_id(self) -> str:
        if self.short_ids:
            return "".join(secrets.choice(_ALNUM) for _ in range(9))
        return "call_" + secrets.token_hex(16)

    def partial(self) -> re.Pattern:
        """A call left open after its name: groups (name, the arguments so far)."""
        return _partial(self)


GENERIC = Format("generic", native=False, trigger="<tool_call>", head_pre="<tool_call>\n",
                 tail="}\n</tool_call>", sep="\n", close="</tool_call>")
HERMES = dataclasses.replace(GENERIC, name="hermes", native=True)   # the same calls, rendered by the template
LLAMA3 = Format("llama3", native=True, trigger='{"name"', args_key="parameters", parallel=False,
                kind="object")
MISTRAL = Format("mistral", native=True, trigger="[TOOL_CALLS]", block_open="[TOOL_CALLS][", sep=", ",
                 block_close="]", kind="array", short_ids=True)
MISTRAL_SPACED = dataclasses.replace(MISTRAL, block_open="[TOOL_CALLS] [")   # Mistral 7B v0.3, Small 3.1
MISTRAL_ARGS = Format("mistral_args", native=True, trigger="[TOOL_CALLS]", head_pre="[TOOL_CALLS]",
                      tail="", kind="args", short_ids=True)
# Qwen3-Coder and later Qwen templates: XML bodies inside the tags (procs/renderer/toolxml.py)
QWEN_XML = Format("qwen_xml", native=True, trigger="<tool_call>", head_pre="<tool_call>\n",
                  tail="</function>\n</tool_call>", sep="\n", close="</tool_call>", kind="xml",
                  value_open="\n", value_close="\n</parameter>\n")
# Seed-OSS: Qwen3-Coder's bodies in its own tags, a value without newlines around it
SEED = dataclasses.replace(QWEN_XML, name="seed_xml", trigger="<seed:tool_call>", head_pre="<seed:tool_call>\n",
                           tail="</function>\n</seed:tool_call>", close="</seed:tool_call>", value_open="",
                           value_close="</parameter>\n")
# GLM-4.5 / 4.6: the name after the tag, keys and values in tags of their own
GLM = dataclasses.replace(QWEN_XML, name="glm", head_pre="<tool_call>", tail="</tool_call>", name_open="",
                          name_close="\n", key_open="<arg_key>", key_close="</arg_key>", fn_close="",
                          value_open="\n<arg_value>", value_close="</arg_value>\n")
# GLM-4.7 and later: the same without newlines
GLM_COMPACT = dataclasses.replace(GLM, name="glm_compact", name_close="", value_open="<arg_value>",
                                  value_close="</arg_value>")
# OpenAI's Harmony (gpt-oss): calls are messages to `functions.NAME` in the model's own special
# tokens, read by procs/renderer/harmony.py (which also opens forced ones: harmony.opener)
HARMONY = Format("harmony", native=True, trigger="to=functions.", kind="harmony")
XML_CALLS = ("<function=", "<parameter=", "<arg_key>")


@lru_cache(maxsize=8)
def detect(template: str | None) -> Format:
    """The format a chat template speaks. A template that never reads `tools` cannot render
    them: the generic format, whatever tokens it mentions."""
    src = template or ""
    if harmony.detect(src):
        return HARMONY
    if "tools" not in src:
        return GENERIC
    if "[TOOL_CALLS]" in src:
        if "[ARGS]" in src:
            return MISTRAL_ARGS
        return MISTRAL_SPACED if "[TOOL_CALLS] [" in src else MISTRAL
    if "<seed:tool_call>" in src:
        return SEED
    if "<tool_call>" in src:
        if "<function=" in src and "<parameter=" in src:     # Qwen3-Coder's XML bodies
            return QWEN_XML
        if "<arg_key>" in src and "<arg_value>" in src:      # GLM's
            return GLM_COMPACT if "</arg_key><arg_value>" in src else GLM
        # JSON inside the tags (Qwen2.5, Qwen3, Hermes)
        if '"name"' in src and not any(x in src for x in XML_CALLS):
            return HERMES
        return GENERIC
    if "<|start_header_id|>" in src and '"parameters"' in src:
        return LLAMA3
    return GENERIC


@lru_cache(maxsize=8)
def _partial(f: Format) -> re.Pattern:
    if f.kind == "args":
        return re.compile(r"\s*" + re.escape(f.head_pre) + r"([^\[\]]+)\[ARGS\](.*)\Z", re.S)
    lead = {"tags": re.escape(f.trigger) + r"\s*", "object": "", "array": re.escape(f.trigger) + r"\s*\[.*"}[f.kind]
    return re.compile(r"\s*" + lead + r'\{\s*"name"\s*:\s*"([^"\\]+)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(.*)\Z',
                      re.S)


_DECODER = json.JSONDecoder()


def whole_value(args: str) -> str:
    """A cut call's arguments: the JSON value alone where it is whole (the limit may cut in
    the wrapper after it: '{"city": "Paris"}}\n</'), else the text so far."""
    body = args.lstrip()
    try:
        _, end = _DECODER.raw_decode(body)
    except ValueError:
        return args
    return body[:end]


class ValueScan:
    """The arguments of a call being generated, fed as they grow: `feed` returns how much of
    the text so far is surely inside the JSON value when it is an object or array (anything
    else is held until the call closes: a string's content is passed on decoded, as
    arguments already written as JSON text), and `whole` says it has ended. Linear in the
    text: each character is looked at once."""

    def __init__(self):
        self.n = 0              # characters scanned
        self.depth = 0
        self.in_str = self.esc = False
        self.kind = ""          # the value's first character, once seen
        self.whole = False

    def feed(self, text: str) -> int:
        i = self.n
        if not self.kind:
            while i < len(text) and text[i] in " \t\r\n":
                i += 1
            if i == len(text):
                self.n = i
                return 0
            self.kind = text[i]
            self.n = i
        if self.kind not in "{[":
            return 0
        while i < len(text) and not self.whole:
            c = text[i]
            i += 1
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
            elif c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                self.whole = self.depth == 0
        self.n = i
        return i


class Incomplete(Exception):
    """The text so far could still become a valid call block."""


def json_value(s: str, i: int):
    """(value, end) of the JSON value starting at s[i] (after whitespace); Incomplete when
    the text ends inside it, ValueError when it cannot be JSON."""
    n = len(s)
    while i < n and s[i] in " \t\r\n":
        i += 1
    if i >= n:
        raise Incomplete
    try:
        return _DECODER.raw_decode(s, i)
    except json.JSONDecodeError as e:
        if e.pos >= len(s.rstrip()) or e.msg.startswith("Unterminated string"):
            raise Incomplete from None
        raise ValueError(e.msg) from None
    except RecursionError:
        raise ValueError("nested too deep") from None


def _call_of(obj) -> tuple[str, str]:
    """(name, arguments JSON text) of a parsed call object; ValueError if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("not a call")
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def scan(f: Format, s: str, i: int, after: int = 0) -> tuple[list[tuple[str, str]], int, bool]:
    """Parse the call(s) that open at s[i] (s[i:] starts with the trigger): (calls, end,
    more) where `more` says whether another call may follow. Incomplete or ValueError.
    `after`: a tags call's closing tag is looked for from there on (the end of its arguments,
    when known: a string inside them may hold the tag)."""
    if f.kind == "tags":
        rest = None   # after a whole JSON value first: a string inside it may hold the tag
        try:
            obj, end = json_value(s, i + len(f.trigger))
            rest = s[end:].lstrip()
        except ValueError:
            pass
        except Incomplete:
            if s.find(f.close, max(i, after)) < 0:
                raise
        if rest is not None and rest.startswith(f.close):
            try:
                calls = [_call_of(obj)]
            except ValueError:       # JSON, but not a call: skipped, as a malformed one
                calls = []
            return calls, len(s) - len(rest) + len(f.close), True
        if rest is not None and f.close.startswith(rest):
            raise Incomplete
        b = s.find(f.close, max(i, after))
        if b < 0:
            raise Incomplete
        try:
            return [_call_of(json.loads(s[i + len(f.trigger):b]))], b + len(f.close), True
        except (ValueError, RecursionError):     # a malformed call is skipped, the block goes on
            return [], b + len(f.close), True
    if f.kind == "object":
        obj, end = json_value(s, i)
        return [_call_of(obj)], end, False
    if f.kind == "array":
        arr, end = json_value(s, i + len(f.trigger))
        if not isinstance(arr, list) or not arr:
            raise ValueError("not a list of calls")
        return [_call_of(x) for x in arr], end, False
    # args: [TOOL_CALLS]name[ARGS]{...}
    a = s.find("[ARGS]", i)
    if a < 0:
        rest = s[i + len(f.trigger):]
        j = rest.find("[")
        if (j >= 0 and not "[ARGS]".startswith(rest[j:j + 6])) or len(rest) > 256:
            raise ValueError("no [ARGS] after the name")
        raise Incomplete
    name = s[i + len(f.trigger):a]
    args, end = json_value(s, a + len("[ARGS]"))
    return [(name, json.dumps(args, ensure_ascii=False) if not isinstance(args, str) else args)], end, True


_FENCE = re.compile(r"\s*(```(?:json)?[ \t]*\r?\n)?")


def scan_fenced(s: str, names, final: bool = False) -> tuple[list[tuple[str, str]], int, bool]:
    """The call of an answer that opens with one written as JSON (s matches guidance.FENCE_HEAD):
    ([(name, arguments)], end, False), a fenced call's closing fence included when it follows.
    ValueError when it is not a call of a declared tool; Incomplete while the text may still
    become one (unless `final`)."""
    head = _FENCE.match(s)
    obj, end = json_value(s, head.end())
    name, args = _call_of(obj)
    if name not in names:
        raise ValueError(f"no tool named {name!r}")
    if not head.group(1):           # bare: the object is the call
        return [(name, args)], end, False
    rest = s[end:].lstrip()
    if rest.startswith("```"):
        end = s.index("```", end) + 3
    elif not final and "```".startswith(rest):
        raise Incomplete
    return [(name, args)], end, False


FENCED_PARTIAL = re.compile(r'\s*(?:```(?:json)?[ \t]*\r?\n\s*)?\{\s*"name"\s*:\s*"([^"\\]+)"\s*,\s*'
                            r'"(?:arguments|parameters)"\s*:\s*(.*)\Z', re.S)
