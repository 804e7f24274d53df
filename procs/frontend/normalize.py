"""Volatile text that agents put into their prompts, taken out before rendering so that two
sessions of the same agent render the same prefix (and hit the same KV cache). Applied to
the system text of every API: system/developer messages and blocks, Responses'
`instructions`.

Each rule is one line: which agent, what it looks like (a regular expression matched against
a whole line of system text), and why it goes. A system block or message that holds nothing
else is dropped whole. To add the next such header: one Rule below, one case in
tests/procs/frontend/test_normalize.py.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    agent: str
    line: re.Pattern
    why: str


RULES = (
    # Claude Code's first system block: a hash of the first user prompt (new each session)
    Rule("claude-code", re.compile(r"x-anthropic-billing-header: [^\n]*"),
         "billing attribution for Anthropic's API; its suffix changes with every first prompt"),
)


def system_text(text: str) -> str:
    """`text` without the lines any rule matches (a matched line goes with its newline)."""
    if not any(r.line.search(text) for r in RULES):
        return text
    lines = text.split("\n")
    kept = [ln for ln in lines if not any(r.line.fullmatch(ln) for r in RULES)]
    return "\n".join(kept)
