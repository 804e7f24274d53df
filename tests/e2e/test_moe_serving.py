"""gpt-oss's shape served by every process of the Procfile: the tiny gpt-oss of
tests/procs/inference/tiny_models.py (a sink logit per head, biases, every other layer over a
window of 8, four experts with biases behind their router, the clamped SwiGLU) with its
experts in MXFP4 as released and the default model's vocabulary, written as llama.cpp's
converter writes one. On the CPU it runs the kernels' whole decode step and their prefill
attention with the sinks (the server's log says so; `auto` picks the kernel for a model with
sinks on AMX CPUs too, where it keeps torch's SDPA for others). Over HTTP with the openai
client: two conversations decode together, the next turn reuses the live session, and after
a restart the turn after is served from the checkpoint on disk. Its random weights answer nonsense;
what is asserted is what the server does with this model's cache."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from .tiny import ask, cached, live_then_restart, tiny_server

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

SYSTEM = "You are a terse assistant. " * 110       # ~660 tokens: past the smallest checkpoint (512)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with tiny_server(tmp_path_factory.mktemp("oss"), "gpt_oss", "gpt-oss", 2048, "ricordo-oss",
                     experts_qtype=gguf.GGMLQuantizationType.MXFP4) as got:
        yield got


def test_sinks_and_experts_serve_batched_live_and_after_a_restart(served):
    srv, trace = served
    log = srv.log_path.read_text()
    assert "decode: one native call per token" in log and "prefill attention: native with sinks" in log, log[-3000:]
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name three prime numbers."}]
    other = [{"role": "user", "content": "Count from one to ten, slowly. " * 20}]
    with ThreadPoolExecutor(2) as pool:     # two answers generated together: batched steps
        a, o = pool.map(lambda m: ask(srv, m), (first, other))
    for r in (a, o):
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens > 0
    assert a.usage.prompt_tokens > 600 and cached(a) == 0
    live_then_restart(srv, trace, first, a)
