"""A model with linear-attention layers served by every process of the Procfile: the tiny
Qwen3.5 of tests/procs/inference/tiny_models.py (three Gated DeltaNet layers, one gated
attention layer) with the default model's vocabulary, written as a GGUF the way llama.cpp's
converter writes one (qwen35). Over HTTP with the openai client. A recurrent state cannot be
cut back, so a session keeps copies of it (marks) where prompts end and where checkpoints
are taken; what is asserted is that every reuse lands on one of those, with the reused
counts the client sees: a new conversation on the same system prompt starts from the mark
at its end, a turn whose client rewrote the previous answer from the mark at that turn's
prompt end, and after a restart a turn from the shutdown checkpoint, whose states are on
disk. Its random weights answer nonsense."""
from __future__ import annotations

import pytest

from .tiny import ask, cached, live_then_restart, tiny_server

pytest.importorskip("transformers")
pytest.importorskip("gguf")

SYSTEM = "You are a terse assistant. " * 110       # ~660 tokens: past the smallest checkpoint (512)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with tiny_server(tmp_path_factory.mktemp("hybrid"), "qwen3_5", "qwen35", 2048, "ricordo-hybrid") as got:
        yield got


def test_reuse_lands_on_marks_live_and_after_a_restart(served):
    srv, trace = served
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name three prime numbers."}]
    a = ask(srv, first)
    assert a.choices[0].finish_reason in ("stop", "length") and a.usage.prompt_tokens > 600
    assert cached(a) == 0
    # another conversation on the same system prompt: from the mark (and cold checkpoint) at
    # the end of the system part, a few tokens short of the first prompt
    other = ask(srv, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a prime?"}])
    assert 512 <= cached(other) < a.usage.prompt_tokens - 3, (cached(other), a.usage)
    # the client sends the answer back rewritten (as templates that drop reasoning do): the
    # session's state after the answer is no use, the mark at its prompt's end is
    edited = first + [{"role": "assistant", "content": "2, 3 and 5."}, {"role": "user", "content": "And three more."}]
    b = ask(srv, edited)
    assert cached(b) == a.usage.prompt_tokens, (cached(b), a.usage)
    # the next turn extends the whole session (prompt and answer): kept whole, state and all;
    # after a restart, the shutdown checkpoint (the last turn and its answer, states included)
    live_then_restart(srv, trace, edited, b)
