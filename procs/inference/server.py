"""The inference process: the only one that touches the model.

Knows tokens and tensors; nothing of HTTP or files it writes. It owns the one live KV
session, runs one Job at a time (the renderer queues them), re-checks the renderer's reuse
plan against the live token ids (a mismatch falls back to a cold prefill), prefills in
aligned chunks, samples and streams Token events back.
"""
from __future__ import annotations

import collections
import time

import zmq

from common import messages as m
from common.config import Settings
from common.lifecycle import StopFlag
from common.logs import setup
from common.sockets import INFERENCE_JOBS, RENDERER_EVENTS, address
from procs.inference.model import KVSession
from procs.inference.runtime import build
from procs.inference.sampling import Sampler


class Cancelled(Exception):
    pass


class Worker:
    def __init__(self, s: Settings, log):
        self.s, self.log = s, log
        self.model, self.n_ctx, load_s = build(s)
        self.live = KVSession(self.model, self.n_ctx, s.chunk_size)
        log.info("model loaded in %.2f s: %s on %s, context %d", load_s, self.model.dtype,
                 self.model.device, self.n_ctx)
        ctx = zmq.Context.instance()
        self.pull = ctx.socket(zmq.PULL)
        self.pull.bind(address(s, INFERENCE_JOBS))
        self.push = ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 1000)
        self.push.connect(address(s, RENDERER_EVENTS))
        self.enc, self.dec = m.encoder(), m.decoder(m.InferenceIn)
        self.jobs: collections.deque[m.Job] = collections.deque()
        self.cancelled: set[str] = set()
        self.stop = StopFlag()

    def send(self, msg) -> None:
        self.push.send(self.enc.encode(msg))

    def health(self, rid: str) -> m.InferenceHealth:
        return m.InferenceHealth(rid=rid, n_ctx=self.n_ctx, vocab_size=self.model.cfg.vocab_size,
                                 device=str(self.model.device), dtype=str(self.model.dtype).replace("torch.", ""),
                                 live_tokens=len(self.live))

    def drain(self, timeout_ms: int = 0) -> None:
        """Read every waiting message: jobs queue up, cancels are noted, pings answered."""
        while self.pull.poll(timeout_ms):
            timeout_ms = 0
            msg = self.dec.decode(self.pull.recv())
            if isinstance(msg, m.Job):
                self.jobs.append(msg)
            elif isinstance(msg, m.CancelJob):
                self.cancelled.add(msg.rid)
            else:
                self.send(self.health(msg.rid))

    def check(self, rid: str) -> None:
        self.drain()
        if rid in self.cancelled or self.stop:
            raise Cancelled

    def run(self) -> int:
        while not self.stop:
            self.drain(100)
            while self.jobs and not self.stop:
                job = self.jobs.popleft()
                if job.rid in self.cancelled:
                    self.cancelled.discard(job.rid)
                    self.send(m.JobDone(rid=job.rid, reason="cancelled", live=tuple(self.live.tokens)))
                    continue
                try:
                    self.execute(job)
                except Exception as e:  # the request fails; the process and the next ones go on
                    self.log.exception("job %s failed", job.rid)
                    self.live.truncate(0)
                    self.send(m.JobError(rid=job.rid, message=f"inference error: {e}", live=()))
                self.cancelled.discard(job.rid)
        self.log.info("stopping")
        return 0

    def plan(self, job: m.Job) -> int:
        """Tokens of the live session to keep: the renderer's plan if it still holds."""
        ids, r = job.ids, job.reuse
        live = self.live.tokens
        if r > len(live) or list(ids[:r]) != live[:r]:
            self.log.warning("job %s: live session differs from the plan; cold prefill", job.rid)
            r = 0
        if r >= len(ids):          # the whole prompt is cached: re-run its last token for logits
            r = len(ids) - 1 if (len(live) != len(ids) or self.live.logits is None) else len(ids)
        return r

    def execute(self, job: m.Job) -> None:
        t0 = time.perf_counter()
        r = self.plan(job)
        self.live.truncate(r)
        self.send(m.Begun(rid=job.rid, cached=r, prompt_tokens=len(job.ids)))
        todo = len(job.ids) - r
        last_log = [t0]

        def progress(done: int, total: int) -> None:
            self.send(m.Progress(rid=job.rid, done=done, total=total))
            now = time.perf_counter()
            if total >= 2048 and now - last_log[0] > 2:
                last_log[0] = now
                rate = done / (now - t0)
                self.log.info("prefill %s: %d%% (%d/%d), %.0f tok/s, %.1f s left", job.rid,
                              100 * done // total, done, total, rate, (total - done) / rate)
            self.check(job.rid)

        reason, n = "cancelled", 0
        try:
            self.live.prefill(list(job.ids[r:]), on_chunk=progress)
            t1 = time.perf_counter()
            sampler = Sampler(job.sampling)
            stop_ids = set(job.sampling.stop_ids)
            logits = self.live.logits
            budget = min(job.sampling.max_tokens, self.n_ctx - len(self.live))
            if budget <= 0:
                reason = "length"
                self.send(m.Token(rid=job.rid, id=-1, logprob=0.0, finish="length"))
            while budget > 0:
                tok, lp, top = sampler(logits)
                n += 1
                finish = "stop" if tok in stop_ids else ("length" if n >= budget else "")
                self.send(m.Token(rid=job.rid, id=tok, logprob=lp, top=tuple(top), finish=finish))
                if not finish:
                    self.check(job.rid)
                if len(self.live) < self.n_ctx:   # the live session holds every sampled token
                    logits = self.live.decode(tok)
                if finish:
                    reason = finish
                    break
        except Cancelled:
            t1 = time.perf_counter()
        t2 = time.perf_counter()
        self.send(m.JobDone(rid=job.rid, reason=reason, live=tuple(self.live.tokens)))
        self.log.info("job %s: cached %d, prefilled %d in %.2f s (%.0f tok/s), %d tokens at %.1f tok/s, %s",
                      job.rid, r, todo, t1 - t0, todo / max(t1 - t0, 1e-9), n,
                      n / max(t2 - t1, 1e-9), reason)


def run(argv=None) -> int:
    s = Settings.load("inference", argv)
    log = setup("inference", s.log_level)
    return Worker(s, log).run()
