"""Chat templates for GGUFs that carry none (tokenizer.chat_template absent), by architecture,
as llama.cpp falls back to a built-in format. Written for this project in the families'
published turn formats.

Invariant shared with the tool replay (procs/renderer/tools.py): an assistant message's content
is rendered byte for byte, never trimmed, so a replayed answer renders the exact bytes the KV
state was computed from.
"""
from __future__ import annotations

# the variables the renderer sets itself, which extra template variables may not replace
RESERVED_VARS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"})

# Gemma's turns: `<start_of_turn>user|model\n ... <end_of_turn>\n`. Gemma has no system or tool
# role: a leading system message opens the first user turn (as Google's template does), a later
# one, and each tool result, is a user turn of its own. The system message alone, without a
# generation prompt, stays an open turn: the shared prefix of every conversation that starts
# with it (procs/renderer/prompt.prefix_bytes).
GEMMA = (
    "{%- set ns = namespace(system='') -%}"
    "{%- for m in messages -%}"
    "{%- if loop.first and m['role'] == 'system' -%}"
    "{%- set ns.system = (m['content'] or '') + '\\n\\n' -%}"
    "{%- else -%}"
    "{%- set text = m['content'] or '' -%}"
    "{%- if m['role'] == 'tool' -%}{%- set text = '<tool_response>\\n' + text + '\\n</tool_response>' -%}{%- endif -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\\n' + ns.system + text + '<end_of_turn>\\n' }}"
    "{%- set ns.system = '' -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if ns.system -%}{{ '<start_of_turn>user\\n' + ns.system }}"
    "{%- if add_generation_prompt -%}{{ '<end_of_turn>\\n' }}{%- endif -%}{%- endif -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

BY_ARCH = {"gemma3": GEMMA, "gemma2": GEMMA, "gemma": GEMMA}


def fallback(arch: str) -> str | None:
    return BY_ARCH.get(arch)
