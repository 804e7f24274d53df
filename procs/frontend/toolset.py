"""The tools of one request as the prompt names them, for the APIs whose tools are not all
plain functions (Responses: namespaces, custom tools, built-ins; Messages: client tools and
server tools).

Every tool reaches the renderer as a chat-shaped function tool (fields.function_tool), so
one template and one grammar serve every API. The set remembers what each prompt name
stands for (its namespace, and whether it is a custom tool that takes free text), so a call
the model makes goes back out in the client's shape, and a call the client sends back
renders under the same name. Tools the server cannot run (hosted built-ins) are left out of
the prompt and logged once per type and process.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from procs.frontend.errors import bad
from procs.frontend.fields import json_text

log = logging.getLogger("web")

# a custom tool's free-form input, as the one string argument of a function
CUSTOM_INPUT = "input"
CUSTOM_PARAMETERS = {"type": "object", "properties": {CUSTOM_INPUT: {"type": "string"}},
                     "required": [CUSTOM_INPUT]}

_logged: set[str] = set()


def custom_arguments(text: str) -> str:
    """A custom tool's free-form input as the arguments of the function the prompt shows;
    json.dumps spacing, the grammar's, so a replayed call renders as it was sampled."""
    return json.dumps({CUSTOM_INPUT: text}, ensure_ascii=False)


def custom_input(arguments: str) -> str:
    try:
        v = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return v[CUSTOM_INPUT] if isinstance(v, dict) and isinstance(v.get(CUSTOM_INPUT), str) else arguments


def left_out(kind: str, why: str) -> None:
    if kind not in _logged:
        _logged.add(kind)
        log.info("tool type %r left out of prompts: %s (logged once)", kind, why)


@dataclass(frozen=True)
class Tool:
    name: str                   # the client's name
    namespace: str | None = None
    custom: bool = False        # free-form input (Responses' custom tools)


class Toolset:
    def __init__(self):
        self.chat: list[dict] = []
        self.tools: dict[str, Tool] = {}       # prompt name -> what it stands for
        self.skipped: list[str] = []

    def add(self, chat_tool: dict, at: str, namespace: str | None = None, custom: bool = False) -> None:
        """`chat_tool` from fields.function_tool. A namespaced tool keeps its own name in the
        prompt unless another tool has it, then "<namespace>.<name>"."""
        fn = chat_tool["function"]
        name = fn["name"]
        prompt = name if name not in self.tools or namespace is None else f"{namespace}.{name}"
        if prompt in self.tools:
            raise bad(at, f"two tools are named {prompt!r}")
        if prompt != name:
            chat_tool = {"type": "function", "function": {**fn, "name": prompt}}
        self.tools[prompt] = Tool(name, namespace, custom)
        self.chat.append(chat_tool)

    def skip(self, kind: str, why: str) -> None:
        self.skipped.append(kind)
        left_out(kind, why)

    def prompt_name(self, name: str, namespace: str | None = None) -> str:
        """The name a call of the client's (name, namespace) renders under."""
        if namespace:
            for p, t in self.tools.items():
                if t.name == name and t.namespace == namespace:
                    return p
        return name

    def tool(self, prompt_name: str) -> Tool:
        return self.tools.get(prompt_name) or Tool(prompt_name)

    def json(self) -> str:
        return json_text(self.chat) if self.chat else ""


def tool_list(body: dict, at) -> list[tuple[str, dict]]:
    """The request's `tools` as (where, tool) pairs; `at(i)` spells where tool i sits."""
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise bad("tools", "'tools' must be a list of objects")
    return [(at(i), t) for i, t in enumerate(tools)]
