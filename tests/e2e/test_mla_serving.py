"""A latent-attention model served by every process of the Procfile: the tiny GLM-4.7-Flash
of tests/procs/inference/tiny_models.py with the default model's vocabulary, written as a
GGUF the way llama.cpp's converter writes one (deepseek2: one latent K/V row per token). Over HTTP with the openai client: the next turn reuses the live session, and after a
restart the turn after is served from the checkpoint on disk (a prompt past the smallest
checkpoint, 512 tokens). Its random weights answer
nonsense; what is asserted is what the server does with the latent cache."""
from __future__ import annotations

import pytest

from .tiny import ask, cached, live_then_restart, tiny_server

pytest.importorskip("transformers")
pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with tiny_server(tmp_path_factory.mktemp("mla"), "glm4_moe_lite", "deepseek2", 1024, "ricordo-mla") as got:
        yield got


def test_latent_cache_serves_the_next_turn_live_and_after_a_restart(served):
    srv, trace = served
    log = srv.log_path.read_text()
    assert "decode: one native call per token" in log, log[-3000:]      # decode.c's mla_layer
    first = [{"role": "system", "content": "You are a terse assistant. " * 110},
             {"role": "user", "content": "Name three prime numbers."}]
    a = ask(srv, first)
    assert a.choices[0].finish_reason in ("stop", "length") and a.usage.prompt_tokens > 600
    assert cached(a) == 0
    live_then_restart(srv, trace, first, a)
