"""Several requests at once, end to end (every process of the Procfile, the real default model,
the official `openai` client over HTTP): their answers decode together in one batched step,
a long prompt is prefilled between the steps of the answers already streaming, and in
--deterministic mode an answer is the same whether it ran alone or beside others.

Nothing depends on which tokens the model picks on this CPU: the answers compared are the
same server's (alone, then together), and the stream that must keep flowing is held long by a
grammar (an array of a fixed number of integers), not by the model's choice to go on.
"""
from __future__ import annotations

import json
import re
import threading
import time

import pytest

from .server import Server, value

pytestmark = pytest.mark.slow

QUESTIONS = ("Name three rivers of Italy.", "How does a bicycle brake work?", "Write a haiku about the sea.")
# a system prompt of several whole attention chunks (128 rows each)
SYSTEM = "You answer questions for a bicycle shop. " + " ".join(
    f"Rule {i}: when asked about part {i}, say what it does in plain words." for i in range(40))
BATCH = re.compile(r'^ricordo_decode_batch_size_bucket\{le="([0-9.+Inf]+)"\} (\S+)$', re.M)


def ask(srv: Server, question: str) -> str:
    r = srv.client().chat.completions.create(model="x", messages=[{"role": "user", "content": question}],
                                             max_tokens=24, temperature=0)
    return r.choices[0].message.content


def together(fn, args: list) -> list:
    """fn(a) for every a, each in its own thread, started together; results in order."""
    out, errors = [None] * len(args), []
    gate = threading.Barrier(len(args))

    def one(i, a):
        gate.wait()
        try:
            out[i] = fn(a)
        except Exception as e:   # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=one, args=(i, a)) for i, a in enumerate(args)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    return out


def batch_sizes(srv: Server) -> dict[str, float]:
    """The decode-batch histogram's cumulative buckets: {le: steps with at most le sequences}."""
    return dict(BATCH.findall(srv.http().get("/metrics").text))


def test_answers_together_equal_answers_alone(tmp_path):
    env = {"RICORDO_DETERMINISTIC": "1", "RICORDO_PARALLEL": "3"}
    with Server(env=env, name="ricordo-batch") as srv:
        alone = [ask(srv, q) for q in QUESTIONS]
        before = batch_sizes(srv)
        both = together(lambda q: ask(srv, q), list(QUESTIONS))
        after = batch_sizes(srv)
    assert both == alone
    assert all(a for a in alone)
    # steps that advanced more than one answer (the +Inf bucket counts every step)
    wide = lambda h: float(h.get("+Inf", 0)) - float(h.get("1.0", 0))   # noqa: E731
    assert wide(after) > wide(before), (before, after)


def test_conversations_on_one_system_prompt_read_it_once_and_answer_as_alone(tmp_path):
    """Three conversations on one system prompt (the later two start from a copy of the
    first's rows), answered alone and then together: together, the decode steps read the
    prompt's rows once for all of them (the shared-rows counter grows) and every answer is
    the one it got alone, bit-exact decode (--deterministic) included."""
    env = {"RICORDO_DETERMINISTIC": "1", "RICORDO_PARALLEL": "3"}

    def ask_shop(q: str) -> str:
        r = srv.client().chat.completions.create(
            model="x", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            max_tokens=24, temperature=0)
        return r.choices[0].message.content
    with Server(env=env, name="ricordo-shared-rows") as srv:
        alone = [ask_shop(q) for q in QUESTIONS]
        m = srv.metrics()
        before = value(m, "ricordo_decode_shared_rows_total")
        busy = {p: value(m, "ricordo_inference_busy_seconds_total", phase=p) for p in ("prefill", "decode")}
        both = together(ask_shop, list(QUESTIONS))
        after = srv.metric("ricordo_decode_shared_rows_total")
        device = srv.http().get("/health").json()["device"]
    assert both == alone and all(alone)
    if device == "cpu":   # the native decoder reads shared rows once; torch's ops on CUDA do not
        assert after - before >= 256, (before, after)     # whole chunks, at least one step of two
    else:
        assert after == before == 0, (before, after)
    assert busy["prefill"] > 0 and busy["decode"] > 0, busy


def test_a_long_prompt_is_prefilled_between_the_steps_of_a_streaming_answer(tmp_path):
    n_items = 300
    fmt = {"type": "json_schema", "json_schema": {"name": "numbers", "strict": True, "schema": {
        "type": "array", "items": {"type": "integer"}, "minItems": n_items, "maxItems": n_items}}}
    long_prompt = " ".join(f"Item {i}: the {('red', 'green', 'blue')[i % 3]} box holds {i * 7 % 13} marbles."
                           for i in range(100))
    env = {"RICORDO_CHUNK_SIZE": "256", "RICORDO_PARALLEL": "2"}
    with Server(env=env, name="ricordo-interleave") as srv:
        times: list[float] = []
        text: list[str] = []
        started = threading.Event()

        def stream_numbers():
            s = srv.client().chat.completions.create(
                model="x", messages=[{"role": "user", "content": "List numbers."}], response_format=fmt,
                max_tokens=2000, temperature=0, stream=True)
            for chunk in s:
                if chunk.choices and chunk.choices[0].delta.content:
                    times.append(time.monotonic())
                    text.append(chunk.choices[0].delta.content)
                    if len(times) == 8:
                        started.set()
        a = threading.Thread(target=stream_numbers)
        a.start()
        assert started.wait(120)
        sent = time.monotonic()
        s = srv.client().chat.completions.create(
            model="x", messages=[{"role": "user", "content": long_prompt + " How many marbles in all?"}],
            max_tokens=2, temperature=0, stream=True, stream_options={"include_usage": True})
        first, usage = None, None
        for chunk in s:   # its first token (the role chunk comes at once, before the prefill)
            if first is None and chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason):
                first = time.monotonic()
            usage = chunk.usage or usage
        a.join(300)   # ~12 s alone in f32 on 2 cores; a failure here carries the server's log
        assert not a.is_alive(), f"the numbers' stream still running after 300 s ({len(text)} pieces)"
    assert usage.prompt_tokens > 3 * 256          # several chunks to prefill
    during = [t for t in times if sent < t < first]
    # the first stream went on while the long prompt was prefilled (one step per chunk at
    # least), and ended after it: the two ran interleaved, not one after the other
    assert len(during) >= 3, (len(during), usage.prompt_tokens)
    assert times[-1] > first
    assert len(json.loads("".join(text))) == n_items
