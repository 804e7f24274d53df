"""A latent-attention model served by every process of the Procfile: the tiny GLM-4.7-Flash
of tests/procs/inference/tiny_models.py with the default model's vocabulary, written as a
GGUF the way llama.cpp's converter writes one (deepseek2: one latent K/V row per token). Over HTTP with the openai client: the next turn reuses the live session, and after a
restart the turn after is served from the checkpoint on disk (a prompt past the smallest
checkpoint, 512 tokens). Its random weights answer
nonsense; what is asserted is what the server does with the latent cache."""
from __future__ import annotations

import pytest

from .tiny import ask, cached, tiny_server

pytest.importorskip("transformers")
pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with tiny_server(tmp_path_factory.mktemp("mla"), "glm4_moe_lite", "deepseek2", 1024, "ricordo-mla") as got:
        yield got


def test_latent_cache_serves_the_next_turn_live_and_after_a_restart(served):
    srv, trace = served
    first = [{"role": "system", "content": "You are a terse assistant. " * 110},
             {"role": "user", "content": "Name three prime numbers."}]
    a = ask(srv, first)
    assert a.choices[0].finish_reason in ("stop", "length") and a.usage.prompt_tokens > 600
    assert cached(a) == 0
    second = first + [{"role": "assistant", "content": a.choices[0].message.content},
                      {"role": "user", "content": "And three more."}]
    b = ask(srv, second)
    # the first turn's prompt and answer came from the live session (its last token is re-run)
    assert cached(b) >= a.usage.prompt_tokens, (cached(b), a.usage)
    srv.restart()
    before = trace.read_text()
    third = second + [{"role": "assistant", "content": b.choices[0].message.content},
                      {"role": "user", "content": "Thanks."}]
    c = ask(srv, third)
    # the shutdown checkpoint (the second turn and its answer) restored from disk
    assert cached(c) >= b.usage.prompt_tokens, (cached(c), b.usage)
    assert "KV cache: hit for sha1=" in trace.read_text()[len(before):]
    assert srv.running()
