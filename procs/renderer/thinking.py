"""A thinking model's `<think>...</think>` (Qwen3, QwQ, DeepSeek-R1 and their distills, SmolLM3,
GLM-4.5; Seed-OSS's `<seed:think>...</seed:think>`; Magistral's and Ministral 3 Reasoning's
`[THINK]...[/THINK]`, control tokens of their tekken vocabulary):
the thinking at the start of an answer comes back as reasoning, the rest as the answer, as
llama.cpp's default reasoning format (deepseek) and vLLM's reasoning parsers return them.

The thinking is taken only where it opens the answer: after the prompt's own `<think>` (a
template that opens it in the generation prompt: DeepSeek-R1, Qwen3 thinking-only), or when
the answer's first text is `<think>`. It ends at `</think>`; the blank lines after it are
not part of the answer. A `<think>` later in an answer is text.
"""
from __future__ import annotations

from procs.renderer.harmony import held

OPEN, CLOSE = "<think>", "</think>"
TAGS = ((OPEN, CLOSE), ("<seed:think>", "</seed:think>"), ("[THINK]", "[/THINK]"))


def detect(template: str | None) -> tuple[str, str] | None:
    """The thinking block's tags a chat template speaks of, or None."""
    src = template or ""
    return next(((o, c) for o, c in reversed(TAGS) if o in src and c in src), None)


def opened(prompt: str, tags: tuple[str, str] = TAGS[0]) -> bool:
    """The generation prompt ends inside a thinking block (its opening tag not closed)."""
    tail = prompt.rstrip()
    return tail.endswith(tags[0])


class Think:
    """Splits an answer into (reasoning, content), incrementally."""

    def __init__(self, inside: bool, tags: tuple[str, str] = TAGS[0]):
        self.open, self.close = tags
        # "start": the answer may still open with <think>; "in": thinking; "gap": the blank
        # lines after </think>; "out": the answer
        self.state = "in" if inside else "start"
        self.buf = ""
        self.skipped = 0         # UTF-8 bytes of the sampled text before the answer's first byte

    def push(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning, content = "", ""
        while self.buf:
            if self.state == "start":
                lead = self.buf.lstrip()
                if lead.startswith(self.open):
                    self._skip(len(self.buf) - len(lead) + len(self.open))
                    self.state = "in"
                    continue
                if self.open.startswith(lead):          # (all blank so far, or a part of <think>)
                    break
                self.state = "out"
            elif self.state == "in":
                i = self.buf.find(self.close)
                if i < 0:
                    cut = len(self.buf) - held(self.buf, self.close)
                    reasoning += self.buf[:cut]
                    self._skip(cut)
                    break
                reasoning += self.buf[:i]
                self._skip(i + len(self.close))
                self.state = "gap"
            elif self.state == "gap":
                lead = self.buf.lstrip("\r\n")
                self._skip(len(self.buf) - len(lead))
                if lead:
                    self.state = "out"
                else:
                    break
            else:
                content += self.buf
                self.buf = ""
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """The rest at the end: held text of the thinking is thinking; an answer that was
        only blanks or a part of `<think>` is that text."""
        rest, self.buf = self.buf, ""
        if self.state == "in":
            return rest, ""
        return "", "" if self.state == "gap" else rest

    def _skip(self, n: int) -> None:
        self.skipped += len(self.buf[:n].encode("utf-8", "surrogateescape"))
        self.buf = self.buf[n:]
