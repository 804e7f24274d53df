"""`<think>` blocks at the start of an answer (procs/renderer/thinking.py): the thinking as
reasoning, the rest as the answer, incrementally; what counts as opened; the bytes before the
answer, which a tool call's keep adds to its offset."""
from __future__ import annotations

from pathlib import Path

import pytest

from procs.renderer import thinking

TEMPLATES = Path(__file__).resolve().parents[2] / "data" / "templates"


def _split(text: str, inside: bool, step: int):
    t = thinking.Think(inside)
    r, c = "", ""
    for i in range(0, len(text), step):
        a, b = t.push(text[i:i + step])
        r, c = r + a, c + b
    a, b = t.flush()
    return r + a, c + b, t


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
@pytest.mark.parametrize("text,inside,want", [
    ("<think>\nPlan: say hi.\n</think>\n\nHello!", False, ("\nPlan: say hi.\n", "Hello!")),
    ("  <think>x</think>y", False, ("x", "y")),
    ("Plan.\n</think>\n\nHi <think> there", True, ("Plan.\n", "Hi <think> there")),
    ("Hello <think>not a block</think>", False, ("", "Hello <think>not a block</think>")),
    ("Still thinking when the limit came <", True, ("Still thinking when the limit came <", "")),
    ("<thi", False, ("", "<thi")),
    ("</think>\n\n", True, ("", "")),
])
def test_split(text, inside, want, step):
    r, c, t = _split(text, inside, step)
    assert (r, c) == want
    if c:   # the bytes before the answer's first byte
        assert text.encode()[t.skipped:] == c.encode()


def test_opened_and_detect():
    assert thinking.opened("<|im_start|>assistant\n<think>\n")
    assert not thinking.opened("<|im_start|>assistant\n<think>\n\n</think>\n\n")   # Qwen3, thinking off
    assert not thinking.opened("<|im_start|>assistant\n")
    assert thinking.detect((TEMPLATES / "think.jinja").read_text())
    assert not any(thinking.detect((TEMPLATES / f"{n}.jinja").read_text())
                   for n in ("hermes", "llama3", "mistral", "qwen_xml", "harmony"))


@pytest.mark.parametrize("step", [1, 5, 1000])
@pytest.mark.parametrize("tags", [("<seed:think>", "</seed:think>"), ("[THINK]", "[/THINK]")])
def test_other_tags(step, tags):
    """Seed-OSS's `<seed:think>` and Magistral's `[THINK]` blocks: read from the template,
    split as `<think>`'s, where a bare `<think>` is text."""
    o, c = tags
    assert thinking.detect("{{ '%s' + m.reasoning_content + '%s' }}" % tags) == tags
    text = f"{o}Plan <think>x</think>.{c}\n\nDone."
    t = thinking.Think(False, tags)
    r, c = "", ""
    for i in range(0, len(text), step):
        a, b = t.push(text[i:i + step])
        r, c = r + a, c + b
    a, b = t.flush()
    assert (r + a, c + b) == ("Plan <think>x</think>.", "Done.")
    assert thinking.opened(o, tags) and not thinking.opened("<think>", tags)
