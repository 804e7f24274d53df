"""Readiness one process at a time: the renderer holds requests until it knows
the persister's index, inference's health and live session; a job planned against a stale
live session comes back and is planned again; the persister hands its whole state to any
renderer that asks. The renderer and persister are the real classes on a temp run dir,
their outgoing messages captured instead of sent."""
from __future__ import annotations

import hashlib
import logging
import signal
import time

import pytest

from common import messages as m
from common.config import Settings
from procs.renderer import readiness
from procs.renderer import server as rs

LOG = logging.getLogger("test")
PROMPT = ("A short note about the mountain railway: the first train leaves the valley station at "
          "seven, the last one comes back at six, and dogs travel free.")


@pytest.fixture
def settings(tmp_path):
    return Settings(run_dir=str(tmp_path / "run"), kv_disk_dir=str(tmp_path / "kv"), kv_cache_min_tokens=4)


@pytest.fixture
def keep_signals():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


class Captured:
    def __init__(self):
        self.web, self.inference, self.persister = [], [], []

    def of(self, where: str, kind) -> list:
        return [x for x in getattr(self, where) if isinstance(x, kind)]


@pytest.fixture
def renderer(settings, keep_signals):
    r = rs.Renderer(settings, LOG)
    out = Captured()
    r.to_web = lambda route, msg: out.web.append(msg)
    r.to_inference = out.inference.append
    r.send_persister = out.persister.append
    r.out = out
    yield r
    for sock in (r.router, r.events, r.jobs, r.to_persister):
        sock.close(0)


def request(r, rid: str, prompt: str = PROMPT) -> None:
    req = m.GenerateRequest(rid=rid, kind="completion", sampling=m.SamplingParams(max_tokens=2), prompt=prompt)
    r.on_request(b"web-1", req)


def entry_for(r, text: bytes) -> m.IndexEntry:
    return m.IndexEntry(sha1=hashlib.sha1(text).hexdigest(), text_len=len(text), n_tokens=len(r.text.encode(text)),
                        quant_bits=0, ctx_size=r.n_ctx, size=1, last_used=0)


def health(r) -> m.Health:
    r.on_request(b"web-1", m.PingRequest(rid="h"))
    return r.out.of("web", m.Health)[-1]


def inference_up(r, boot: str = "inf-1") -> None:
    r.on_event(m.InferenceHealth(rid="renderer", n_ctx=r.n_ctx, vocab_size=r.text.vocab_size, device="cpu",
                                 dtype="float32", live_tokens=0, boot=boot, seq=r.ping_seq))


def test_a_request_before_the_index_waits_and_then_restores_the_checkpoint(renderer):
    r = renderer
    checkpoint = r.text.bos_text() + PROMPT[:80].encode()
    request(r, "a")
    assert [type(x) for x in r.out.web] == [m.Waiting] and not r.out.of("inference", m.Job)
    r.housekeeping()                               # asks every process for what it lacks
    assert r.out.of("persister", m.RendererHello) and r.out.of("inference", m.LiveQuery)
    h = health(r)
    assert not h.ready and "inference" in h.detail and "index" in h.detail and h.holds is False
    inference_up(r)
    assert not health(r).ready and "live session" in health(r).detail
    r.on_event(m.LiveState(rid="", boot="inf-1", sessions=(m.LiveSession(sid=1, tokens=(5, 6)),), busy=True))    # mid-job: not trusted
    assert r.live is None
    r.on_event(m.LiveState(rid="", boot="inf-1", sessions=()))
    h = health(r)
    assert not h.ready and h.detail == "waiting for the disk cache index from the persister"
    assert not r.out.of("inference", m.Job)
    r.on_event(m.PersisterState(boot="p-1", index=m.IndexSnapshot(entries=(entry_for(r, checkpoint),), version=3)))
    assert health(r).ready
    jobs = r.out.of("inference", m.Job)
    assert len(jobs) == 1 and jobs[0].rid == "a" and jobs[0].restore == hashlib.sha1(checkpoint).hexdigest()
    assert r.out.of("web", m.Accepted)[0].rid == "a"


def test_a_job_planned_against_a_stale_live_session_is_planned_again(renderer):
    r = renderer
    checkpoint = r.text.bos_text() + PROMPT[:80].encode()
    inference_up(r)
    live = r.text.encode(r.text.bos_text() + PROMPT.encode())
    r.on_event(m.LiveState(rid="", boot="inf-1", sessions=(m.LiveSession(sid=1, tokens=tuple(live)),)))
    r.on_event(m.PersisterState(boot="p-1", index=m.IndexSnapshot(entries=(entry_for(r, checkpoint),), version=1)))
    request(r, "b", PROMPT + " And bicycles?")
    first = r.out.of("inference", m.Job)[-1]
    assert first.rid == "b" and first.reuse > 0 and not first.restore     # the live session is longer
    # a restarted inference does not hold that session: it sends the job back with what it holds
    r.on_event(m.LiveState(rid="b", boot="inf-2", sessions=()))
    again = r.out.of("inference", m.Job)[-1]
    assert again is not first and again.rid == "b" and again.reuse == 0
    assert again.restore == hashlib.sha1(checkpoint).hexdigest()


def test_an_inference_restart_makes_the_live_session_unknown(renderer):
    r = renderer
    inference_up(r)
    r.on_event(m.LiveState(rid="", boot="inf-1", sessions=(m.LiveSession(sid=1, tokens=(1, 2, 3)),)))
    r.on_event(m.PersisterState(boot="p-1", index=m.IndexSnapshot(entries=(), version=1)))
    assert health(r).ready and r.live[1].tokens == (1, 2, 3)
    inference_up(r, boot="inf-2")
    assert r.live is None and not health(r).ready
    request(r, "c")
    assert isinstance(r.out.web[-1], m.Waiting)
    r.on_event(m.LiveState(rid="", boot="inf-1", sessions=(m.LiveSession(sid=1, tokens=(1, 2, 3)),)))   # the old process's answer
    assert r.live is None
    r.on_event(m.LiveState(rid="", boot="inf-2", sessions=()))
    assert r.live == {} and r.out.of("inference", m.Job)[-1].rid == "c"


def test_tool_ids_travel_both_ways(renderer):
    r = renderer
    r.tool_memory.remember(["call_mine"], b"<tool_call>mine</tool_call>")
    r.on_event(m.PersisterState(boot="p-1", index=m.IndexSnapshot(entries=(), version=1),
                                tool_ids=(("call_theirs", b"<tool_call>theirs</tool_call>"),)))
    assert r.tool_memory.get("call_theirs") is None            # not one of ours...
    assert r.tool_memory.from_disk("call_theirs", ()) == b"<tool_call>theirs</tool_call>"   # ...but known
    assert not r.out.of("persister", m.ToolIds)          # the first persister heard knows its own
    r.on_event(m.PersisterState(boot="p-2", index=m.IndexSnapshot(entries=(), version=0)))
    sent = dict(e for t in r.out.of("persister", m.ToolIds) for e in t.entries)
    assert sent["call_mine"] == b"<tool_call>mine</tool_call>"    # a restarted one gets ours again


def test_held_requests_fail_after_the_bound_and_can_be_cancelled(renderer):
    r = renderer
    request(r, "d")
    request(r, "e")
    r.on_request(b"web-1", m.CancelRequest(rid="e"))
    assert not r.holds("e") and r.holds("d")
    r.keep_ready(r.held[0][2] + readiness.READY_WAIT_S + 1)
    failed = r.out.of("web", m.Failed)
    assert [(f.rid, f.status, f.code) for f in failed] == [("d", 503, "not_ready")]
    assert not r.holds("d")


def test_persister_sends_its_state_at_start_and_when_asked(settings, keep_signals):
    from procs.persister.server import Persister
    sent = []
    Persister.send = lambda self, sock, msg: sent.append(msg) if sock is self.to_renderer else None
    try:
        p = Persister(settings, LOG)
    finally:
        del Persister.send
    p.send = lambda sock, msg: sent.append(msg) if sock is p.to_renderer else None
    assert [type(x) for x in sent] == [m.PersisterState]      # at start, after the scan
    p.handle(m.ToolIds(entries=(("call_1", b"block"),)))
    p.handle(m.RendererHello(boot="r-1"))
    st = sent[-1]
    assert isinstance(st, m.PersisterState) and st.boot == sent[0].boot and st.tool_ids == (("call_1", b"block"),)
    for sock in (p.pull, p.to_inference, p.to_renderer):
        sock.close(0)


def test_a_long_prefill_chunk_does_not_make_the_server_unready(renderer):
    """Inference answers pings between prefill chunks; at a long context one chunk takes
    seconds, more than the idle freshness window. While a job runs, the window is longer."""
    r = renderer
    inference_up(r)
    r.on_event(m.LiveState(rid="", boot="inf-1", sessions=()))
    r.on_event(m.PersisterState(boot="p-1", index=m.IndexSnapshot(entries=(), version=1)))
    request(r, "long")
    assert list(r.running) == ["long"]
    r.last_heard -= readiness.HEALTH_FRESH_S + 2          # silent for longer than the idle window
    assert health(r).ready
    r.last_heard -= readiness.BUSY_FRESH_S                # ... but not forever
    assert not health(r).ready and "not answering" in health(r).detail
    r.running.clear()                                        # idle: the short window again
    r.last_heard = time.monotonic() - readiness.HEALTH_FRESH_S - 1
    assert not health(r).ready


def test_a_step_longer_than_the_silence_limit_is_not_a_dead_process(renderer):
    """A prefill chunk of a large model on a slow CPU outlasts INFERENCE_SILENCE_S: inference's
    heartbeat thread says it is in a step (InferenceBusy), and the job is not failed; a step
    past STEP_LIMIT_S, or the word of another process, is not heard, and the job fails."""
    r = renderer
    inference_up(r)
    r.on_event(m.LiveState(rid="", boot="inf-1", sessions=()))
    r.on_event(m.PersisterState(boot="p-1", index=m.IndexSnapshot(entries=(), version=1)))
    request(r, "slow")
    p = r.running["slow"]
    r.on_event(m.Begun(rid="slow", cached=0, prompt_tokens=900))
    for step_s in (2.0, 4.0):
        r.last_heard -= rs.INFERENCE_SILENCE_S + 1
        p.since = time.monotonic()
        r.on_event(m.InferenceBusy(boot="inf-1", step_s=step_s))
        r.housekeeping()
        assert "slow" in r.running and not r.out.of("web", m.Failed)
    for busy in (m.InferenceBusy(boot="inf-1", step_s=rs.STEP_LIMIT_S + 1), m.InferenceBusy(boot="gone", step_s=3.0)):
        r.last_heard -= rs.INFERENCE_SILENCE_S + 1
        r.on_event(busy)
        assert time.monotonic() - r.last_heard > rs.INFERENCE_SILENCE_S
    r.housekeeping()
    assert "slow" not in r.running and "has not answered" in r.out.of("web", m.Failed)[-1].message


def test_slots_look_a_session_up_on_disk_only_when_it_or_the_index_changed(renderer, monkeypatch):
    """GET /slots answers each resident session's longest checkpoint; a lookup hashes the
    session's whole text, so it is made again only for a new session state or a new index."""
    r = renderer
    ids = r.text.encode(PROMPT.encode())
    r.on_event(m.PersisterState(boot="p-1", index=m.IndexSnapshot(entries=(), version=1)))
    r.mirror((m.LiveSession(sid=1, tokens=tuple(ids)), m.LiveSession(sid=2, tokens=tuple(ids[:9]))))
    looked = []
    real = r.index.lookup
    monkeypatch.setattr(r.index, "lookup", lambda *a, **k: looked.append(a[0]) or real(*a, **k))
    assert [(x.sid, x.on_disk) for x in r.slot_states()] == [(2, 0), (1, 0)] and len(looked) == 2
    r.slot_states()
    assert len(looked) == 2
    half = r.text.piece_bytes(ids[:len(ids) // 2])
    r.on_event(m.IndexSnapshot(entries=(entry_for(r, half),), version=2))
    assert {x.sid: x.on_disk for x in r.slot_states()} == {1: len(ids) // 2, 2: 0} and len(looked) == 4
    r.mirror((m.LiveSession(sid=1, tokens=tuple(ids)), m.LiveSession(sid=3, tokens=tuple(ids[:5]))))
    r.slot_states()
    assert len(looked) == 6 and set(r.on_disk) == {1, 3}      # both states new; sid 2 forgotten
