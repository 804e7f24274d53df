"""The inference process: the only one that touches the model.

Knows tokens and tensors; nothing of HTTP or files it writes. It owns the resident KV
sessions (sessions.py: several conversations under a memory budget) and runs up to
--parallel jobs at once, each in the session the renderer's plan names (placement.py: the
plan re-checked against the session's token ids; a mismatch falls back to a cold prefill):
prompts prefill a chunk at a time, the answers decode in one batched step for all
(runs.py), and Token events stream back.
"""
from __future__ import annotations

import collections
import contextlib
import threading
import time
import os
import uuid

import zmq

from common import kvfile
from common import messages as m
from common.config import Settings
from common.lifecycle import StopFlag
from common import metrics
from common.logs import setup
from common.sockets import INFERENCE_JOBS, PERSISTER, RENDERER_EVENTS, address, run_dir
from common.trace import Trace
from common.models import load_text, resolve
from procs.inference.disk import Disk
from procs.inference.guide import Guides
from procs.inference.kvsession import KVSession
from procs.inference.sharing import Sharing
from procs.inference.placement import Placement
from procs.inference.runs import Run, Runs
from procs.inference.runtime import build, explain
from procs.inference.sessions import Sessions, budget_bytes
from procs.inference.threads import DecodeThreads

MAX_CANCELLED = 10_000      # remembered cancels beyond which those of unknown jobs are forgotten
BUSY_EVERY_S = 2.0          # Heartbeat: how often a running step is announced
# the longest a prefill waits for a job announced by Job.more: the renderer renders a prompt
# in ~1-6 ms; a job that does not come (rejected, or waiting for another) costs this once
HOLD_S = 0.010


class Heartbeat:
    """While a step of the loop runs, a thread says so (InferenceBusy) every BUSY_EVERY_S on
    its own socket, so that a slow step (a 512-token chunk of a 1.5B model at 6k tokens took
    21 s on 2 busy cores) is not taken for a dead process. It runs while torch's and the
    kernels' calls release the GIL; a loop stuck holding the GIL silences it too."""

    def __init__(self, endpoint: str, boot: str):
        self.started: float | None = None        # monotonic start of the running step
        self.boot = boot
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._beat, args=(endpoint,), name="heartbeat", daemon=True)
        self.thread.start()

    @contextlib.contextmanager
    def step(self):
        self.started = time.monotonic()
        try:
            yield
        finally:
            self.started = None

    def _beat(self, endpoint: str) -> None:
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)
        sock.connect(endpoint)
        enc = m.encoder()
        while not self.done.wait(BUSY_EVERY_S):
            t = self.started
            if t is not None:
                try:
                    sock.send(enc.encode(m.InferenceBusy(boot=self.boot, step_s=time.monotonic() - t)), zmq.NOBLOCK)
                except zmq.Again:       # the renderer is not there to hear it
                    pass
        sock.close()

    def close(self) -> None:
        self.done.set()
        self.thread.join(timeout=2 * BUSY_EVERY_S)


class Worker(Placement, Runs):
    def __init__(self, s: Settings, log):
        self.s, self.log = s, log
        self.model, self.n_ctx, load_s = build(s)
        self.sessions = Sessions(lambda: KVSession(self.model, self.n_ctx, s.chunk_size, exact=s.deterministic),
                                 budget_bytes(s.kv_ram_space_mb, self.model.device), s.max_live_sessions)
        c = self.model.cfg
        self.row_bytes = c.kv_tensors * c.kv_layers * c.n_kv_heads * c.head_dim * self.model.norm.element_size()
        self.guides = Guides(load_text(resolve(s.model, s.models_path())))
        log.info("model loaded in %.2f s on %s, context %d: %s", load_s, self.model.device, self.n_ctx,
                 explain(s, self.model))
        log.info("resident sessions: at most %d in %.0f MiB of K/V (%d bytes a token); %d jobs at once",
                 self.sessions.max_sessions, self.sessions.budget / 2**20, self.row_bytes, s.batch)
        if self.model.graphs is not None:      # CUDA: no capture on a request's path
            t0 = time.perf_counter()
            try:
                made = self.model.graphs.warm(s.batch, s.chunk_size)
            except Exception as e:             # the steps capture when first needed, as without it
                log.warning("CUDA graphs not captured ahead: %s", e, exc_info=e)
                made = 0
            if self.model.graphs is not None:
                log.info("CUDA graphs: %d captured ahead in %.1f s; K/V pools %.0f MiB (outside the K/V budget)",
                         made, time.perf_counter() - t0, self.model.graphs.nbytes / 2**20)
        ctx = zmq.Context.instance()
        self.pull = ctx.socket(zmq.PULL)
        self.pull.bind(address(s, INFERENCE_JOBS))
        self.push = ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 200)
        self.push.connect(address(s, RENDERER_EVENTS))
        self.to_persister = ctx.socket(zmq.PUSH)
        self.to_persister.setsockopt(zmq.LINGER, 300)
        self.to_persister.connect(address(s, PERSISTER))
        self.enc, self.dec = m.encoder(), m.decoder(m.InferenceIn)
        self.trace = Trace(s.trace, "inference")
        self.disk = Disk(s, self.model, self.n_ctx, run_dir(s), self.send_persister, self.drain, log)
        self.frontiers: dict[int, int] = {}   # sid -> its last continued checkpoint position
        self.sharing = Sharing()               # rows the batched sessions hold alike
        self.threads = DecodeThreads.for_model(s, self.model, log)
        self.jobs: collections.deque[m.Job] = collections.deque()   # received, not begun
        self.active: dict[str, Run] = {}       # rid -> the job in flight (at most s.batch), in begin order
        self.clock = 0                         # prompt tokens prefilled so far (runs.py: the prefill order)
        self.expect_until = 0.0                # monotonic time until which a job announced by Job.more is awaited
        self.cancelled: set[str] = set()
        self.keep: dict[str, int] = {}   # rid -> live tokens to keep when it is cancelled
        # rid -> (session, its length) of a job that may still hear its keep (a tool call's
        # end, a stop string's start): it ended on its own, its session untouched since (runs.end)
        self.ended: collections.OrderedDict[str, tuple[int, int]] = collections.OrderedDict()
        self.sent_back: dict[str, None] = {}   # rids of jobs sent back once (the next run goes cold)
        self.boot = uuid.uuid4().hex
        self.stop = StopFlag()
        self.beat = Heartbeat(address(s, RENDERER_EVENTS), self.boot)

    def send(self, msg) -> None:
        self.push.send(self.enc.encode(msg))

    def send_persister(self, msg) -> None:
        self.to_persister.send(self.enc.encode(msg))

    def health(self, rid: str, seq: int = 0) -> m.InferenceHealth:
        return m.InferenceHealth(rid=rid, n_ctx=self.n_ctx, vocab_size=self.model.cfg.vocab_size,
                                 device=str(self.model.device), dtype=str(self.model.dtype).replace("torch.", ""),
                                 live_tokens=self.sessions.tokens, quant_bits=self.model.cfg.quant_bits,
                                 boot=self.boot, seq=seq,
                                 jobs=tuple(self.active) + tuple(j.rid for j in self.jobs),
                                 live_sessions=len(self.sessions), resident_bytes=self.sessions.nbytes)

    def drain(self, wait_s: float = 0.0) -> None:
        """Read every waiting message, waiting up to wait_s for the first: jobs queue up,
        cancels are noted, pings answered, freed slots released."""
        timeout_ms = int(wait_s * 1000)
        while self.pull.poll(timeout_ms):
            timeout_ms = 0
            msg = self.dec.decode(self.pull.recv())
            if isinstance(msg, m.Job):
                self.jobs.append(msg)
                self.expect_until = time.monotonic() + HOLD_S if msg.more else 0.0
            elif isinstance(msg, m.CancelJob):
                self.cancelled.add(msg.rid)
                if len(self.cancelled) > MAX_CANCELLED:   # cancels of jobs this process never saw
                    known = {j.rid for j in self.jobs} | set(self.active)
                    self.cancelled &= known | {msg.rid}
                # a keep often comes after its job ended (a call's end: on the stop token; a
                # stop string: at the token limit): kept for a job still here, applied late to an
                # ended one's untouched session (the renderer's next job for it comes after
                # this message), else forgotten
                if msg.keep >= 0 and (msg.rid in self.active or any(j.rid == msg.rid for j in self.jobs)):
                    self.keep[msg.rid] = msg.keep
                elif msg.keep >= 0 and msg.rid in self.ended:
                    self.keep_late(msg.rid, msg.keep)
            elif isinstance(msg, m.SlotFreed):
                self.disk.slot_freed(msg.slot, msg.seq)
            elif isinstance(msg, m.PersisterHello):
                self.disk.persister_hello()
            elif isinstance(msg, m.LiveQuery):
                self.send(m.LiveState(rid="", boot=self.boot, sessions=self.sessions.state(),
                                      busy=bool(self.active or self.jobs)))
            else:
                self.send(self.health(msg.rid, msg.seq))

    def run(self) -> int:
        tick = 0
        while not self.stop:
            wait = 0.0 if self.active else 0.1
            if self.holding() and all(r.logits is None for r in self.active.values()):
                wait = self.expect_until - time.monotonic()     # nothing decodes: until the job comes
            self.drain(wait)
            with self.beat.step():
                tick = self.step(tick)
        for run in list(self.active.values()):
            self.guarded(self.end, run, "cancelled")
        self.shutdown()
        self.beat.close()
        return 0

    def step(self, tick: int) -> int:
        """Jobs admitted, cancels ended, one prefill step (at most a chunk's worth of tokens) and one
        decode round; idle, one graph that a step wanted captured."""
        self.admit()
        if not self.active and self.model.graphs is not None and self.model.graphs.wanted:
            try:
                self.model.graphs.capture_wanted()
            except Exception as e:     # a failed capture costs only the shared step it wanted
                self.log.warning("idle capture of a shared prefill step failed: %s", e, exc_info=e)
            return tick
        for run in [r for r in self.active.values() if r.rid in self.cancelled]:
            self.guarded(self.end, run, "cancelled")
        prefilling = [r for r in self.active.values() if r.logits is None]
        if prefilling and not self.holding():
            tick += 1
            t0 = time.perf_counter()
            self.prefill_step(prefilling, tick)
            metrics.M.busy.labels("prefill").inc(time.perf_counter() - t0)
        decoding = [r for r in self.active.values() if r.logits is not None and r.rid not in self.cancelled]
        if decoding:
            t0 = time.perf_counter()
            try:
                self.decode_round(decoding)
            except Exception as e:   # the batched step failed: each of its runs fails
                for r in decoding:
                    if r.rid in self.active:
                        self.fail(r, e)
            metrics.M.busy.labels("decode").inc(time.perf_counter() - t0)
        return tick

    def holding(self) -> bool:
        """Whether the prefill waits for a job the renderer said follows (Job.more), to share
        its step: with graphs, where a step of several prompts' chunks costs about one's."""
        return self.model.graphs is not None and time.monotonic() < self.expect_until

    def guarded(self, step, run: Run, *args) -> None:
        try:
            step(run, *args)
        except Exception as e:
            if run.rid in self.active:
                self.fail(run, e)

    def admit(self) -> None:
        """Begin received jobs while fewer than s.batch run. A job whose session another
        running job uses waits for it (the renderer does not plan such a job, but a resent
        plan may); the jobs behind it go on."""
        i = 0
        while i < len(self.jobs) and len(self.active) < self.s.batch and not self.stop:
            job = self.jobs[i]
            if job.session and not job.restore and job.session in self.busy():
                i += 1
                continue
            del self.jobs[i]
            if job.rid in self.cancelled:
                self.cancelled.discard(job.rid)
                self.keep.pop(job.rid, None)
                self.send(self.done(job.rid, "cancelled"))
                continue
            if self.send_back(job):
                continue
            try:
                self.begin(job)
            except Exception as e:
                self.fail(self.active.get(job.rid) or Run(job=job, t0=0.0), e)

    def done(self, rid: str, reason: str, run: Run | None = None) -> m.JobDone:
        sess = run.sess if run is not None else None
        sid = run.sid if run is not None and run.sid in self.sessions.by_id else 0
        return m.JobDone(rid=rid, reason=reason, live=tuple(sess.tokens) if sid else (),
                         keep_from=sess.keep_from if sid else 0, session=sid, resident=tuple(self.sessions.by_id),
                         answer_from=sess.answer_from if sid else 0, marks=sess.kept_marks if sid else None)

    def send_back(self, job: m.Job) -> bool:
        """A job planned to keep tokens of a session this process does not hold (the
        renderer's mirror is stale: this process restarted, or the mirror was lost) goes back
        once with the real sessions, to be planned again (a disk checkpoint may serve it), not
        run cold."""
        r = job.reuse
        sid = job.session or job.source
        sess = self.sessions.get(sid) if sid else None
        if job.restore or not r or job.rid in self.sent_back:
            return False
        if sess is not None and r <= len(sess) and list(job.ids[:r]) == sess.tokens[:r]:
            return False
        self.sent_back[job.rid] = None
        if len(self.sent_back) > MAX_CANCELLED:
            self.sent_back.pop(next(iter(self.sent_back)))
        self.log.info("job %s: planned against a session this process does not hold; sent back", job.rid)
        self.send(m.LiveState(rid=job.rid, boot=self.boot, sessions=self.sessions.state()))
        return True

    def shutdown(self) -> None:
        """Every resident session worth keeping is checkpointed (shutdown), most recent first:
        the budget of the persister's slots may drop the rest."""
        for sid in reversed(list(self.sessions.by_id)):
            sess = self.sessions.get(sid)
            if self.disk.enabled and len(sess) >= self.s.kv_cache_min_tokens and sess.logits is not None:
                if self.disk.save(sess, len(sess), sess.logits, kvfile.SHUTDOWN):
                    self.log.info("shutdown checkpoint of %d tokens handed to the persister", len(sess))
        self.send_persister(m.InferenceBye(pid=os.getpid()))
        self.disk.close()
        self.log.info("stopping")


def run(argv=None) -> int:
    s = Settings.load("inference", argv)
    log = setup("inference", s.log_level)
    metrics.init(run_dir(s))
    return Worker(s, log).run()
