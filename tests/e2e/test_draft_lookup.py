"""Prompt lookup decoding end to end: the real processes and default model, the official
`openai` client. Asked to repeat a file, the model copies much of it: with --draft-lookup
(the default, 8) the answers are the ones a server without it gives, greedy and sampled with
a seed, free and under a grammar (every token is still sampled once, from the logits a lone
decode computes, under the mask of the tokens before it), and drafts were kept (the
server's counters)."""
from __future__ import annotations

from pathlib import Path

import pytest

from .server import Server, value

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

FILE = (Path(__file__).resolve().parents[2] / "procs" / "inference" / "lookup.py").read_text()
MESSAGES = [{"role": "user", "content": "Repeat this Python file exactly, with no changes:\n\n" + FILE}]
TOOLS = [{"type": "function", "function": {"name": "write_file", "description": "Write a file",
                                           "parameters": {"type": "object", "properties": {
                                               "path": {"type": "string"}, "content": {"type": "string"}},
                                               "required": ["path", "content"]}}}]


def answers(srv: Server) -> list[str]:
    c = srv.client()
    out = [c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=160, temperature=0)]
    out.append(c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=160, temperature=0.8, seed=5))
    out.append(c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=160, temperature=0.8, seed=5,
                                         stop=["return"]))
    # under a grammar: a format, and a forced call whose argument the model copies
    out.append(c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=120, temperature=0,
                                         response_format={"type": "json_schema", "json_schema": {
                                             "name": "copy", "schema": {"type": "object", "properties": {
                                                 "code": {"type": "string"}}, "required": ["code"]}}}))
    out.append(c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=120, temperature=0,
                                         tools=TOOLS, tool_choice="required"))
    return [(r.choices[0].message.content, [(t.function.name, t.function.arguments)
                                            for t in r.choices[0].message.tool_calls or ()]) for r in out]


def test_drafts_change_no_answer_and_are_kept():
    with Server(env={"RICORDO_CTX_SIZE": "2048", "RICORDO_DRAFT_LOOKUP": "0"}) as plain:
        want = answers(plain)
        assert plain.metric("ricordo_draft_tokens_total") == 0
    with Server(env={"RICORDO_CTX_SIZE": "2048"}) as srv:
        got = answers(srv)
        m = srv.metrics()           # one scrape: both counters of the same moment
        drafted, kept = value(m, "ricordo_draft_tokens_total"), value(m, "ricordo_draft_tokens_kept_total")
    assert got == want
    print(f"\ndrafted {drafted:.0f}, kept {kept:.0f}")
    assert 0 < kept <= drafted
