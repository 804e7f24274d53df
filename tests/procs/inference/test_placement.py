"""Placement.start, where a job runs: the session the renderer's plan names, a copy of a
resident session's prefix, or a cold start, on real KV sessions of the default model. What
it keeps, where, and whether it says the plan no longer held (a warning an operator reads
as a renderer/inference disagreement, so it must not appear when the plan did hold)."""
from __future__ import annotations

import collections
import logging
import types

from common import messages as m
from procs.inference.kvsession import KVSession
from procs.inference.server import Worker
from procs.inference.sessions import Sessions

CTX, CHUNK = 2048, 256
STALE = "differs from the plan"


def worker(model) -> Worker:
    """A Worker with only the state placement touches."""
    w = Worker.__new__(Worker)
    w.sessions = Sessions(lambda: KVSession(model, CTX, CHUNK), 1 << 30, 4)
    w.active, w.frontiers, w.ended, w.sent = {}, {}, collections.OrderedDict(), []
    w.s = types.SimpleNamespace(chunk_size=CHUNK, kv_cache_min_tokens=8)
    w.row_bytes, w.n_ctx = 1, CTX
    w.disk = types.SimpleNamespace(enabled=False, save=lambda *a: False)
    w.trace = types.SimpleNamespace(line=lambda text: None)
    w.log = logging.getLogger("inference")
    w.send = w.sent.append
    return w


def ids(n: int, k: int = 1) -> list[int]:
    return [1 + (j * k) % 3000 for j in range(n)]


def job(rid: str, prompt: list[int], reuse: int, session: int = 0, source: int = 0) -> m.Job:
    return m.Job(rid=rid, ids=tuple(prompt), reuse=reuse, sampling=m.SamplingParams(max_tokens=4),
                 session=session, source=source)


def start(w: Worker, j: m.Job):
    run = types.SimpleNamespace(sid=0, sess=None)
    got = w.start(j, run)
    return run, got


def test_a_copy_of_a_longer_sessions_whole_prompt_starts_cold_without_a_warning(model_f32, caplog):
    """A repeated prompt that a longer resident session holds whole (an answer after it) but
    without its logits re-runs from its chunk boundary (here 0) in a new session: the plan
    held, so no warning, and the source keeps its tokens."""
    w = worker(model_f32)
    src_sid, src = w.sessions.add()
    src.prefill(ids(300))
    prompt = ids(200)
    with caplog.at_level(logging.WARNING, logger="inference"):
        run, (got, r) = start(w, job("copy", prompt, 200, source=src_sid))
    assert not [rec for rec in caplog.records if STALE in rec.getMessage()]
    assert r == 0 and got == prompt and run.sid != src_sid and len(run.sess) == 0
    assert len(src) == 300
    begun = w.sent[-1]
    assert isinstance(begun, m.Begun) and (begun.cached, begun.source) == (0, "cold")


def test_a_copy_keeps_the_planned_prefix_of_its_source(model_f32, caplog):
    w = worker(model_f32)
    src_sid, src = w.sessions.add()
    src.prefill(ids(300))
    prompt = ids(280) + ids(30, 7)
    with caplog.at_level(logging.WARNING, logger="inference"):
        run, (_, r) = start(w, job("copy", prompt, 280, source=src_sid))
    assert not [rec for rec in caplog.records if STALE in rec.getMessage()]
    assert r == 280 and run.sid != src_sid and run.sess.tokens == src.tokens[:280]


def test_a_plan_that_no_longer_holds_is_a_cold_prefill_with_a_warning(model_f32, caplog):
    """The named session or the copy's source holds other tokens than planned (the
    renderer's mirror was wrong): nothing is kept, and the log says why."""
    w = worker(model_f32)
    sid, sess = w.sessions.add()
    sess.prefill(ids(300))
    other = ids(300, 5)
    for j in (job("in-place", other, 280, session=sid), job("copy", other, 280, source=sid),
              job("gone", other, 280, source=sid + 10)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="inference"):
            run, (_, r) = start(w, j)
        assert r == 0, j.rid
        assert [rec for rec in caplog.records if STALE in rec.getMessage()], j.rid
        if j.rid != "in-place":
            w.sessions.drop(run.sid)
        else:
            sess.prefill(ids(300))         # it was cut to 0: the next job's source again
