"""runs.Runs' prefill steps: the order in which prompts get their chunks, and how many tokens a
step between two decode rounds holds (without graphs, as on the CPU). Runs.prefill_together, the inference loop's shared prefill step where the model
replays graphs (CUDA): every prefilling run advances by its next chunk in one step, reports
its progress, and starts decoding once its prompt is in; a failure of the shared step fails
each of its runs and nothing else. Here on the CPU with the graphs' steps run eagerly
(GraphDecoder(capture=False)); the loop around them is the server's own code."""
from __future__ import annotations

import collections
import logging
import types

import pytest
import torch

from common import messages as m
import procs.inference.graphs as graphs_mod
from procs.inference.graphs import GraphDecoder
from procs.inference.kvsession import KVSession
from procs.inference.steps import decode_many
from procs.inference.loader import load
from procs.inference.model import Llama
from procs.inference.runs import Run, Runs
from procs.inference.server import Worker


class Loop(Runs):
    """The state of Worker that Runs' prefill path uses, without its sockets."""
    guarded = Worker.guarded

    def __init__(self):
        self.active, self.sent, self.n_ctx, self.clock = {}, [], 2048, 0
        self.cancelled, self.keep, self.frontiers = set(), {}, {}
        self.log = logging.getLogger("inference")
        self.guides = types.SimpleNamespace(start=lambda c: None)
        self.disk = types.SimpleNamespace(enabled=False)
        self.sessions = types.SimpleNamespace(drop=lambda sid: None, by_id={})

    def send(self, msg) -> None:
        self.sent.append(msg)


@pytest.fixture(scope="module")
def model(model_path):
    m_ = Llama(load(model_path, torch.float32, "cpu"), 2048, packed=False)
    m_.graphs = GraphDecoder(m_, capture=False)
    return m_


def _run(loop: Loop, model, rid: str, ids: list[int]) -> Run:
    job = m.Job(rid=rid, ids=tuple(ids), reuse=0, sampling=m.SamplingParams(max_tokens=4))
    run = loop.active[rid] = Run(job=job, t0=0.0, sess=KVSession(model, 2048, 256), ids=ids)
    loop.place(run)
    return run


def _ids(n: int, k: int) -> list[int]:
    return [1 + (j * k) % 3000 for j in range(n)]


def test_prompts_get_their_chunks_in_the_fair_order(model, monkeypatch):
    """A burst of equal prompts goes one prompt after the other (chunk by chunk in turn
    would put all three in at the burst's end); a short prompt passes a long one begun
    earlier when it would be in first, and not when it would be in later."""
    monkeypatch.setattr(model, "graphs", None)     # one run a step, as on the CPU
    loop = Loop()
    loop.model = model

    def steps(n: int) -> list[str]:
        before = len(loop.sent)
        for _ in range(n):
            loop.prefill_step([r for r in loop.active.values() if r.logits is None], 0)
        return [e.rid for e in loop.sent[before:] if isinstance(e, m.Progress)]
    for rid, k in (("a", 7), ("b", 11), ("c", 13)):          # 300 tokens: 2 chunks of 256 each
        _run(loop, model, rid, _ids(300, k))
    assert steps(6) == ["a", "a", "b", "b", "c", "c"]
    assert loop.clock == 900
    loop.active.clear()
    _run(loop, model, "long", _ids(1000, 17))                # 4 chunks, in by clock 900 + 1000
    order = steps(2)
    _run(loop, model, "short", _ids(100, 19))                # in by 1412 + 100: before long
    order += steps(2)
    _run(loop, model, "later", _ids(200, 23))                # in by 1768 + 200: after long
    order += steps(2)
    assert order == ["long", "long", "short", "long", "long", "later"]
    assert all(r.logits is not None for r in loop.active.values())


def test_prompts_advance_together_and_start_decoding(model):
    loop = Loop()
    a = _run(loop, model, "a", [1 + (j * 7) % 3000 for j in range(300)])
    b = _run(loop, model, "b", [1 + (j * 11) % 3000 for j in range(100)])
    loop.prefill_together([a, b], 1)
    assert (len(a.sess), len(b.sess)) == (256, 100) and a.served == b.served == 1
    assert a.logits is None and b.logits is not None                  # b's prompt is in
    assert [(p.rid, p.done, p.total) for p in loop.sent] == [("a", 256, 300), ("b", 100, 100)]
    loop.prefill_together([a], 2)
    assert len(a.sess) == 300 and a.logits is not None
    for run in (a, b):                                                # each as its own prefill gives
        m_graphs, model.graphs = model.graphs, None
        alone = KVSession(model, 2048, 256)
        alone.prefill(list(run.ids))
        model.graphs = m_graphs
        assert int(alone.logits.argmax()) == int(run.logits.argmax())
        assert (alone.logits - run.logits).abs().max().item() <= 1e-3 * alone.logits.abs().max().item()


def test_a_step_prefills_at_most_one_chunks_worth_in_order(model, monkeypatch):
    """Without graphs: chunks one after the other, in the prefill order, while the step holds
    at most one chunk's worth (256 here) of tokens; the first chunk always goes."""
    monkeypatch.setattr(model, "graphs", None)
    loop = Loop()
    loop.model = model
    a = _run(loop, model, "a", _ids(100, 7))
    b = _run(loop, model, "b", _ids(100, 11))
    c = _run(loop, model, "c", _ids(100, 13))       # 300 tokens in all: c waits for the next step
    loop.prefill_step([a, b, c], 1)
    assert (len(a.sess), len(b.sess), len(c.sess)) == (100, 100, 0)
    assert a.logits is not None and b.logits is not None
    loop.active.clear()
    d = _run(loop, model, "d", _ids(300, 17))
    d.sess.prefill(d.ids[:200])                     # a turn's new tokens across the boundary at 256
    loop.place(d)
    loop.prefill_step([d], 2)
    assert len(d.sess) == 300 and d.logits is not None       # 56 + 44 tokens: one step
    e = _run(loop, model, "e", _ids(600, 19))
    loop.prefill_step([e], 3)
    assert len(e.sess) == 256                       # a whole chunk fills the step


def test_a_shared_step_takes_every_prefilling_runs_next_chunk(model):
    """With graphs, every prefilling run's next chunk goes in one step, long or short (a
    chunk is 256 here): a burst of prompts is in together, a long one continues in the next
    step beside whatever arrived since."""
    loop = Loop()
    loop.model = model
    a = _run(loop, model, "a", _ids(100, 7))
    b = _run(loop, model, "b", _ids(300, 11))       # its first chunk: 256
    c = _run(loop, model, "c", _ids(120, 13))
    loop.prefill_step([a, b, c], 1)
    assert (len(a.sess), len(b.sess), len(c.sess)) == (100, 256, 120)
    assert a.logits is not None and c.logits is not None and b.logits is None
    d = _run(loop, model, "d", _ids(200, 17))       # b's last 44 tokens and d's 200 together
    loop.prefill_step([b, d], 2)
    assert (len(b.sess), len(d.sess)) == (300, 200)
    for r in (a, b, c, d):                          # each as its prompt alone gives
        alone = KVSession(model, 2048, 256)
        alone.prefill(list(r.ids))
        assert int(alone.logits.argmax()) == int(r.logits.argmax())


def test_a_failed_shared_step_fails_its_runs_only(model, monkeypatch):
    loop = Loop()
    a = _run(loop, model, "a", list(range(1, 60)))
    b = _run(loop, model, "b", list(range(1, 80)))
    c = _run(loop, model, "c", list(range(1, 90)))

    def broken(*args):
        raise RuntimeError("device lost")
    monkeypatch.setattr(model.graphs, "prefill_many", broken)
    a.sid, b.sid, c.sid = 1, 2, 3
    loop.frontiers = {1: 64, 2: 64, 3: 64}
    loop.prefill_together([a, b], 1)
    assert set(loop.active) == {"c"} and len(c.sess) == 0
    assert loop.frontiers == {3: 64}           # the failed sessions' save points go with them
    errors = [e for e in loop.sent if isinstance(e, m.JobError)]
    assert sorted(e.rid for e in errors) == ["a", "b"] and "device lost" in errors[0].message


def test_chunks_too_large_for_one_graph_go_one_at_a_time(model, monkeypatch):
    """Where the shared step's scores would pass graphs.SCORES_MAX, nothing is done in a
    shared step, and the runs' chunks go one after the other, as without graphs."""
    import procs.inference.graphs as graphs
    monkeypatch.setattr(graphs, "SCORES_MAX", 1)
    loop = Loop()
    loop.model = model
    a = _run(loop, model, "a", list(range(1, 60)))
    b = _run(loop, model, "b", list(range(1, 80)))
    assert loop.prefill_together([a, b], 1) is False and (len(a.sess), len(b.sess)) == (0, 0)
    loop.prefill_step([a, b], 1)
    assert (len(a.sess), len(b.sess)) == (59, 79) and a.logits is not None and b.logits is not None


class EagerGraphs(GraphDecoder):
    """GraphDecoder with its capture made on the CPU: a "graph" whose replay runs its step
    eagerly on the inputs it was captured with, so that which steps are captured, kept and
    wanted is the real decoder's."""

    def capture(self, host, shape, cap, pool, head):
        io = host.to(self.model.device)
        out = self._step(io, shape, cap, pool, head)
        def replay():
            with torch.inference_mode():
                out.copy_(self._step(io, shape, cap, pool, head))
        graph = types.SimpleNamespace(replay=replay)
        self.captures += 1
        return graphs_mod._Graph(io, graph, out)


def test_warm_captures_shared_steps_that_serve_smaller_capacities(model_path):
    """warm() captures the shared steps of 2..batch prompts at every padded chunk length, at
    the largest capacity; a shared step of short sessions (capacity 512) replays that graph
    (its extra keys masked): no capture on the prompts' path, nothing wanted, and each
    prompt's logits are its own prefill's."""
    m_ = Llama(load(model_path, torch.float32, "cpu"), 2048, packed=False)
    gd = m_.graphs = EagerGraphs(m_)
    assert gd.warm(2, 256) == gd.captures == 3 * (2 + 5) + 5
    assert {k for k in gd.graphs if k[1] == 2 and k[0] == "prefill"} == {("prefill", 2, t, 2048)
                                                                        for t in (16, 32, 64, 128, 256)}
    loop = Loop()
    loop.model = m_
    a, b = _run(loop, m_, "a", _ids(60, 7)), _run(loop, m_, "b", _ids(80, 11))
    loop.prefill_step([a, b], 1)
    assert a.logits is not None and b.logits is not None
    assert gd.captures == 26 and not gd.wanted and list(gd.graphs)[-1] == ("prefill", 2, 128, 2048)
    m_.graphs = None
    for r in (a, b):
        alone = KVSession(m_, 2048, 256)
        alone.prefill(list(r.ids))
        assert int(alone.logits.argmax()) == int(r.logits.argmax())
        assert (alone.logits - r.logits).abs().max().item() <= 1e-3 * alone.logits.abs().max().item()


def test_a_shared_step_without_its_graph_waits_for_an_idle_loop(model_path):
    """A shared step whose graph is not captured yet (warm() had no room for it: here
    max_graphs leaves room for the one-prompt steps only) is not captured on the path of the
    prompts that wait: they go one by one through the graphs warm() made, and the step is
    wanted; capture_wanted (the idle loop's) makes it, and the next such step is shared."""
    m_ = Llama(load(model_path, torch.float32, "cpu"), 2048, packed=False)
    gd = m_.graphs = EagerGraphs(m_, max_graphs=graphs_mod.SPARE_GRAPHS + 21)
    assert gd.warm(2, 256) == gd.captures == 3 * (2 + 5)
    loop = Loop()
    loop.model = m_
    a, b = _run(loop, m_, "a", _ids(60, 7)), _run(loop, m_, "b", _ids(80, 11))
    loop.prefill_step([a, b], 1)
    assert a.logits is not None and b.logits is not None and gd.captures == 21
    assert list(gd.wanted) == [("prefill", 2, 128, 512)]
    assert gd.capture_wanted() and gd.captures == 22 and not gd.wanted and not gd.capture_wanted()
    c, d = _run(loop, m_, "c", _ids(60, 7)), _run(loop, m_, "d", _ids(80, 11))
    loop.prefill_step([c, d], 2)
    assert list(gd.graphs)[-1] == ("prefill", 2, 128, 512) and gd.captures == 22    # replayed
    for x, y in ((a, c), (b, d)):
        assert int(x.logits.argmax()) == int(y.logits.argmax())
        assert (x.logits - y.logits).abs().max().item() <= 1e-3 * x.logits.abs().max().item()


def test_warmed_pools_serve_every_step_without_growing(model, monkeypatch):
    """GraphDecoder.warm (the server's start on CUDA): both pools sized for the batch at the
    whole context, every decode batch size and one prompt's every padded chunk length
    stepped at each capacity bucket, no slot holding a session after it. A prompt and its
    answer's steps through the warmed decoder then give a fresh decoder's logits, and no
    pool grows (a growth drops every graph of its kind)."""
    gd = GraphDecoder(model, capture=False)
    keys, run = [], gd._run
    monkeypatch.setattr(gd, "_run", lambda key, *a, **k: keys.append(key) or run(key, *a, **k))
    assert gd.warm(2, 64) == len(keys) == 3 * (2 + 3) + 3
    caps = (512, 1024, 2048)
    assert set(keys) == ({("decode", b, c) for b in (1, 2) for c in caps}
                         | {("prefill", 1, t, c) for t in (16, 32, 64) for c in caps}
                         | {("prefill", 2, t, 2048) for t in (16, 32, 64)})
    for pool in gd.pools.values():
        assert tuple(pool.k.shape[1::2]) == (2, 2048) and pool.held == [None, None]
    storage = {k: p.k.data_ptr() for k, p in gd.pools.items()}
    got = []
    for dec in (gd, GraphDecoder(model, capture=False)):
        monkeypatch.setattr(model, "graphs", dec)
        a, b = KVSession(model, 2048, 64), KVSession(model, 2048, 64)
        a.prefill(_ids(700, 7))
        b.prefill(_ids(40, 11))
        for t in (5, 6, 7):
            decode_many([a, b], [t, t + 1])
        got.append((a.logits, b.logits))
    assert {k: p.k.data_ptr() for k, p in gd.pools.items()} == storage
    for x, y in zip(*got):
        assert int(x.argmax()) == int(y.argmax()) and (x - y).abs().max().item() <= 1e-4 * y.abs().max().item()


class OneSession:
    """Sessions' surface that end() and keep_late() read, over one session of id 1."""
    def __init__(self, sess):
        self.by_id, self.tokens, self.nbytes = {1: sess}, len(sess), 0

    def get(self, sid: int):
        return self.by_id.get(sid)

    def __len__(self) -> int:
        return len(self.by_id)


def test_a_keep_heard_after_its_job_ended_cuts_the_untouched_session(model, monkeypatch):
    """A tool call's end (CancelJob keep) that reaches inference after its job ended on the
    stop token: the session is cut to it as end() would have (the last kept token run again
    for its logits), and only while no job has used the session since."""
    monkeypatch.setattr(model, "graphs", None)
    loop = Loop()
    loop.model, loop.trace = model, types.SimpleNamespace(line=lambda s: None)
    loop.make_room = lambda *a: True
    loop.done = lambda rid, reason, run=None: Worker.done(loop, rid, reason, run)
    loop.ended = collections.OrderedDict()
    prompt, answer = _ids(40, 7), [11, 12, 13]

    def ended(rid: str) -> KVSession:
        sess = KVSession(model, 2048, 256)
        sess.prefill(prompt + answer[:-1])
        sess.decode(answer[-1])
        sess.decode(2)                                        # the stop token, run (run_last)
        job = m.Job(rid=rid, ids=tuple(prompt), reuse=0, sampling=m.SamplingParams(max_tokens=8), run_last=True)
        loop.sessions = OneSession(sess)
        loop.active[rid] = run = Run(job=job, t0=0.0, sid=1, sess=sess, ids=prompt)
        loop.end(run, "stop")
        assert loop.ended[rid] == (1, 44) and loop.sent[-1].live == tuple(prompt + answer + [2])
        return sess
    sess = ended("a")
    want = KVSession(model, 2048, 256)
    want.prefill(prompt + answer[:-1])
    want.decode(answer[-1])
    loop.keep_late("a", 43)
    assert sess.tokens == prompt + answer and "a" not in loop.ended
    assert torch.equal(sess.logits, want.logits)
    sess = ended("b")
    sess.decode(5)                                            # used since (by a job of its own)
    loop.keep_late("b", 43)
    assert len(sess) == 45 and not loop.ended
    sess = ended("c")
    loop.forget_ended(1)                                      # a job began in it
    assert not loop.ended


def test_the_prefill_waits_briefly_for_an_announced_job(monkeypatch):
    """A job sent with Job.more (the renderer held another request) holds the loop's prefill
    step for at most server.HOLD_S while the model replays graphs, so the next job shares
    its step; decode rounds go on meanwhile, the job without `more` ends the hold, and
    without graphs (the CPU) nothing waits."""
    import time

    import zmq

    from procs.inference import server as srv
    ctx = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    steps = []
    w = types.SimpleNamespace(
        pull=pull, dec=m.decoder(m.InferenceIn), jobs=collections.deque(), cancelled=set(), active={},
        expect_until=0.0, model=types.SimpleNamespace(graphs=types.SimpleNamespace(wanted={})),
        admit=lambda: None, prefill_step=lambda runs, tick: steps.append("prefill"),
        decode_round=lambda runs: steps.append("decode"))
    w.holding = lambda: Worker.holding(w)
    job = lambda rid, more: m.Job(rid=rid, ids=(1, 2, 3), reuse=0, sampling=m.SamplingParams(), more=more)
    try:
        push.send(m.encoder().encode(job("a", True)))
        Worker.drain(w, 1.0)
        assert w.holding() and 0 < w.expect_until - time.monotonic() <= srv.HOLD_S
        w.active = {"a": types.SimpleNamespace(rid="a", logits=None), "x": types.SimpleNamespace(rid="x", logits=1)}
        Worker.step(w, 0)
        assert steps == ["decode"]                         # x decodes; a's prefill waits
        push.send(m.encoder().encode(job("b", False)))
        Worker.drain(w, 1.0)
        assert not w.holding() and [j.rid for j in w.jobs] == ["a", "b"]
        Worker.step(w, 0)
        assert steps == ["decode", "prefill", "decode"]
        push.send(m.encoder().encode(job("c", True)))
        Worker.drain(w, 1.0)
        time.sleep(srv.HOLD_S)                             # the announced job did not come
        assert not w.holding()
        w.expect_until, w.model.graphs = time.monotonic() + 1.0, None
        assert not w.holding()                             # no graphs: no shared step to wait for
    finally:
        pull.close(0)
        push.close(0)
