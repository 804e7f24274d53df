"""Worker.drain, the inference loop's reading of its socket, over a real ZeroMQ pair: what a
CancelJob leaves behind for the job it names, and what admit does with a job cancelled
while it waited."""
from __future__ import annotations

import collections
import types

import zmq

from common import messages as m
from procs.inference.server import Worker


def worker_reading(addr: str, ctx: zmq.Context) -> Worker:
    """A Worker with only what drain touches: its PULL socket, decoder and job state."""
    w = Worker.__new__(Worker)
    w.pull = ctx.socket(zmq.PULL)
    w.pull.bind(addr)
    w.dec = m.decoder(m.InferenceIn)
    w.jobs, w.active, w.cancelled, w.keep, w.ended = collections.deque(), {}, set(), {}, collections.OrderedDict()
    return w


def test_a_calls_end_is_kept_only_for_a_job_still_there():
    """The renderer sends a tool call's end (CancelJob keep) as it parses it; a job that ended
    on its stop token first must not leave the count behind for ever (one per tool call)."""
    ctx = zmq.Context.instance()
    w = worker_reading("inproc://test-drain", ctx)
    push = ctx.socket(zmq.PUSH)
    push.connect("inproc://test-drain")
    enc = m.encoder()
    try:
        job = m.Job(rid="queued", ids=(1, 2, 3), reuse=0, sampling=m.SamplingParams(max_tokens=4))
        w.active["running"] = object()
        for msg in (job, m.CancelJob(rid="running", keep=40), m.CancelJob(rid="queued", keep=3),
                    m.CancelJob(rid="ended", keep=50), m.CancelJob(rid="running-plain")):
            push.send(enc.encode(msg))
        w.drain(1.0)
        for _ in range(50):              # inproc delivers in order; wait for the last ones
            if len(w.cancelled) >= 4:
                break
            w.drain(0.2)
        assert w.keep == {"running": 40, "queued": 3}
        assert {"running", "queued", "ended", "running-plain"} <= w.cancelled
        assert [j.rid for j in w.jobs] == ["queued"]
        # the queued job, cancelled before it began, ends there and takes its count with it
        w.s, w.stop, w.sent = types.SimpleNamespace(batch=4), False, []
        w.sessions = types.SimpleNamespace(by_id={})
        w.send = w.sent.append
        w.busy = lambda: set()
        w.admit()
        assert [(d.rid, d.reason) for d in w.sent] == [("queued", "cancelled")] and not w.jobs
        assert w.keep == {"running": 40} and "queued" not in w.cancelled
    finally:
        push.close(0)
        w.pull.close(0)
