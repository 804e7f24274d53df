"""renderer.encoding.PromptEncoder: a prompt encoded from a recent prompt's ids up to a special
token they share, plus its rest, is exactly TextModel.encode of the whole prompt, on each
tokenizer family the tests hold (byte-level BPE: SmolLM2, Qwen 2.5; SentencePiece: Gemma 3),
for an agent's conversation growing turn by turn, a side request, a conversation cut back,
and text that starts with spaces, newlines, a special token's text or characters outside
ASCII right after the cut."""
from __future__ import annotations

import pytest

from common.config import Settings
from common.models import ModelError, load_text, resolve
from procs.renderer.encoding import PromptEncoder


@pytest.fixture(scope="module", params=["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"])
def text(request):
    try:
        return load_text(resolve(request.param, Settings().models_path()), "")
    except ModelError as e:
        pytest.skip(str(e))


TAILS = ["  two spaces first", "\n\nnewlines first", "<|im_end|> a special's text in content",
         "\u00e8 perch\u00e9 \u2581 non-ASCII \U0001F600 and \t tabs", "x" * 700, ""]


def _conversation(i: int) -> list[dict]:
    body = " ".join(f"word{j}" for j in range(200))
    msgs = [{"role": "system", "content": f"You are agent {i}. Tools: " + body}]
    for t, tail in enumerate(TAILS):
        msgs.append({"role": "user", "content": f"{tail} turn {t}"})
        msgs.append({"role": "assistant", "content": f"{tail[::-1]} answer {t}"})
    return msgs


def test_prompts_encode_as_the_whole_prompt_does(text):
    enc = PromptEncoder(text)
    prompts = []
    for i in range(2):
        msgs = _conversation(i)
        for n in range(2, len(msgs) + 1, 2):
            prompts.append(text.render_chat(msgs[:n]).encode())
    prompts.append(text.render_chat(_conversation(0)[:3]).encode())            # cut back
    prompts.append(text.render_chat([{"role": "user", "content": "a side request"}]).encode())
    prompts.append(prompts[5])                                                  # a repeat
    prompts.append(prompts[5] + "  trailing text, no special after".encode())
    for p in prompts:
        assert enc.encode(p) == text.encode(p), p[-80:]
    assert enc.reused > sum(len(p) for p in prompts) // 2                       # most of it came back


def test_bytes_that_are_not_utf8_take_the_plain_path(text):
    enc = PromptEncoder(text)
    p = text.render_chat([{"role": "user", "content": "hello"}]).encode()
    assert enc.encode(p + b"\xe2\x96") == text.encode(p + b"\xe2\x96")
