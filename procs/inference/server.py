"""The inference process: the only one that touches the model.

Knows tokens and tensors; nothing of HTTP or files it writes. It owns the resident KV
sessions (sessions.py: several conversations under a memory budget), runs one Job at a time
(the renderer queues them) in the session the renderer's plan names, re-checks that plan
against the session's token ids (a mismatch falls back to a cold prefill), prefills in
aligned chunks, samples and streams Token events back.
"""
from __future__ import annotations

import collections
import os
import time
import uuid

import zmq

from common import kvfile
from common import messages as m
from common.config import Settings
from common.lifecycle import StopFlag
from common import metrics
from common.logs import setup
from common.policy import continued_frontiers
from common.sockets import INFERENCE_JOBS, PERSISTER, RENDERER_EVENTS, address, run_dir
from common.trace import Trace
from common.models import load_text, resolve
from procs.inference.disk import Disk, RestoreError
from procs.inference.guide import Guides
from procs.inference.kvsession import KVSession
from procs.inference.plan import live_reuse, prompt_saves
from procs.inference.runtime import build, explain
from procs.inference.sampling import Sampler
from procs.inference.sessions import Sessions, budget_bytes


class Cancelled(Exception):
    pass


MAX_CANCELLED = 10_000      # remembered cancels beyond which those of unknown jobs are forgotten


class Worker:
    def __init__(self, s: Settings, log):
        self.s, self.log = s, log
        self.model, self.n_ctx, load_s = build(s)
        self.sessions = Sessions(lambda: KVSession(self.model, self.n_ctx, s.chunk_size, exact=s.deterministic),
                                 budget_bytes(s.kv_ram_space_mb), s.max_live_sessions)
        self.sid, self.live = self.sessions.add()   # the session of the running (or last) job
        c = self.model.cfg
        self.row_bytes = 2 * c.n_layers * c.n_kv_heads * c.head_dim * self.live.k.element_size()
        self.guides = Guides(load_text(resolve(s.model, s.models_path())))
        log.info("model loaded in %.2f s on %s, context %d: %s", load_s, self.model.device, self.n_ctx,
                 explain(s, self.model))
        log.info("resident sessions: at most %d in %.0f MiB of K/V (%d bytes a token)",
                 self.sessions.max_sessions, self.sessions.budget / 2**20, self.row_bytes)
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
        self.jobs: collections.deque[m.Job] = collections.deque()
        self.cancelled: set[str] = set()
        self.keep: dict[str, int] = {}   # rid -> live tokens to keep when it is cancelled
        self.sent_back: dict[str, None] = {}   # rids of jobs sent back once (the next run goes cold)
        self.boot = uuid.uuid4().hex
        self.running = ""                # rid of the job being executed
        self.stop = StopFlag()

    def send(self, msg) -> None:
        self.push.send(self.enc.encode(msg))

    def send_persister(self, msg) -> None:
        self.to_persister.send(self.enc.encode(msg))

    def health(self, rid: str, seq: int = 0) -> m.InferenceHealth:
        return m.InferenceHealth(rid=rid, n_ctx=self.n_ctx, vocab_size=self.model.cfg.vocab_size,
                                 device=str(self.model.device), dtype=str(self.model.dtype).replace("torch.", ""),
                                 live_tokens=self.sessions.tokens, quant_bits=self.model.cfg.quant_bits,
                                 boot=self.boot, seq=seq,
                                 jobs=((self.running,) if self.running else ()) + tuple(j.rid for j in self.jobs),
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
            elif isinstance(msg, m.CancelJob):
                self.cancelled.add(msg.rid)
                if len(self.cancelled) > MAX_CANCELLED:   # cancels of jobs this process never saw
                    known = {j.rid for j in self.jobs} | {self.running}
                    self.cancelled &= known | {msg.rid}
                if msg.keep >= 0:
                    self.keep[msg.rid] = msg.keep
            elif isinstance(msg, m.SlotFreed):
                self.disk.slot_freed(msg.slot, msg.seq)
            elif isinstance(msg, m.PersisterHello):
                self.disk.all_free()
            elif isinstance(msg, m.LiveQuery):
                self.send(m.LiveState(rid="", boot=self.boot, sessions=self.sessions.state(),
                                      busy=bool(self.running or self.jobs)))
            else:
                self.send(self.health(msg.rid, msg.seq))

    def check(self, rid: str) -> None:
        self.drain()
        if rid in self.cancelled or self.stop:
            raise Cancelled

    def run(self) -> int:
        while not self.stop:
            self.drain(0.1)
            while self.jobs and not self.stop:
                job = self.jobs.popleft()
                if job.rid in self.cancelled:
                    self.cancelled.discard(job.rid)
                    self.send(self.done(job.rid, "cancelled"))
                    continue
                if self.send_back(job):
                    continue
                self.running = job.rid
                try:
                    self.execute(job)
                except Exception as e:  # the request fails; the process and the next ones go on
                    self.log.exception("job %s failed", job.rid)
                    self.live.truncate(0)
                    self.sessions.drop(self.sid)
                    self.send(m.JobError(rid=job.rid, message=f"inference error: {e}", live=(), session=0,
                                         resident=tuple(self.sessions.by_id)))
                self.cancelled.discard(job.rid)
                self.running = ""
        self.shutdown()
        return 0

    def done(self, rid: str, reason: str) -> m.JobDone:
        return m.JobDone(rid=rid, reason=reason, live=tuple(self.live.tokens), keep_from=self.live.keep_from,
                         session=self.sid if self.sid in self.sessions.by_id else 0,
                         resident=tuple(self.sessions.by_id))

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

    # -- the resident sessions --
    @property
    def last_frontier(self) -> int:
        return self.frontiers.get(self.sid, 0)

    @last_frontier.setter
    def last_frontier(self, pos: int) -> None:
        self.frontiers[self.sid] = pos

    def use(self, sid: int) -> None:
        self.sid, self.live = sid, self.sessions.get(sid)
        self.sessions.touch(sid)

    def evict(self, sid: int, unsaved) -> None:
        """sid leaves memory, checkpointed first when no checkpoint holds it whole."""
        sess = self.sessions.get(sid)
        if sid in unsaved and len(sess) >= self.s.kv_cache_min_tokens and sess.logits is not None:
            self.disk.save(sess, len(sess), sess.logits, kvfile.EVICT)
        self.trace.line(f"KV cache: session {sid} ({len(sess)} tokens) leaves memory")
        self.sessions.drop(sid)
        self.frontiers.pop(sid, None)

    def make_room(self, need: int, keep: set[int], new: bool, unsaved) -> bool:
        """Evict least recently used sessions (never those in keep) until need more bytes
        and, if new, one more session fit. False when they cannot (a kept one is in the way)."""
        victims, fits = self.sessions.room(need, keep, new)
        if fits or not new:
            for v in victims:
                self.evict(v, unsaved)
        return fits

    def session_for(self, job: m.Job) -> int:
        """Put the job's session in place: the resident one it names, or a new one (for a
        restore, a copy of a resident one's prefix, or a cold prefill), room made for it.
        Returns how many of the source session's tokens a new session copies (0: none)."""
        sess = self.sessions.get(job.session) if job.session else None
        if sess is not None and not job.restore:
            self.use(job.session)
            return 0
        self.sessions.drop_empty(but=job.source)
        src = self.sessions.get(job.source) if job.source and not job.restore else None
        n = job.restore_tokens + len(job.suffix) if job.restore else len(job.ids)
        need = self.row_bytes * min(self.n_ctx, n)
        if src is not None and not self.make_room(need, {job.source}, True, job.unsaved):
            # no room beside its source (one session, or a full budget): the source itself
            # goes on in place, checkpointed first like any session leaving memory
            self.use(job.source)
            if job.source in job.unsaved and len(src) > job.reuse and src.logits is not None:
                self.disk.save(src, len(src), src.logits, kvfile.EVICT)
            return 0
        if src is None:
            self.make_room(need, set(), True, job.unsaved)
        self.use(self.sessions.add()[0])
        if src is None:
            return 0
        r, stale = live_reuse(job.ids, job.reuse, src.tokens, src.logits is not None, self.s.chunk_size,
                              src.can_keep)
        if stale:
            self.log.warning("job %s: the source session differs from the plan; cold prefill", job.rid)
        if r:
            self.live.copy_prefix(src, r)
            self.frontiers[self.sid] = min(self.frontiers.get(job.source, 0), r)
            self.trace.line(f"KV cache: session {self.sid} starts from {r} tokens of session {job.source}")
        return r

    def plan(self, job: m.Job) -> int:
        """Tokens of the live session to keep: the renderer's plan if it still holds."""
        r, stale = live_reuse(job.ids, job.reuse, self.live.tokens, self.live.logits is not None,
                              self.s.chunk_size, self.live.can_keep)
        if stale:
            self.log.warning("job %s: live session differs from the plan or lacks the window rows "
                             "it needs (floor %d); cold prefill", job.rid, self.live.window_floor)
        return r

    def start(self, job: m.Job) -> tuple[list[int], int]:
        """Put the job's session in place: (effective prompt ids, tokens reused)."""
        copied = self.session_for(job)
        if job.evict and len(self.live) > 0 and not copied:
            self.disk.save(self.live, len(self.live), self.live.logits, kvfile.EVICT)
        if job.restore:
            t0 = time.perf_counter()
            try:
                n = self.disk.restore(self.live, job.restore)
            except RestoreError as e:
                self.log.warning("restore of %s failed (%s); cold prefill", job.restore, e.reason)
                self.trace.line(f"KV cache: rejected sha1={job.restore} (reason: {e.reason}); cold prefill")
                self.send_persister(m.Rejected(sha1=job.restore, reason=e.reason))
                self.send(m.Begun(rid=job.rid, cached=0, prompt_tokens=len(job.ids), source="cold",
                                  detail=f"restore failed: {e.reason}"))
                self.last_frontier = 0
                self.fallback_cold = True
                return list(job.ids), 0
            ids = list(self.live.tokens) + list(job.suffix)
            self.send_persister(m.Restored(sha1=job.restore))
            self.trace.line(f"KV cache: hit for sha1={job.restore} (loaded {n} tokens)")
            dt = time.perf_counter() - t0
            self.log.info("restored %s: %d tokens in %.3f s", job.restore, n, dt)
            metrics.M.restore_seconds.observe(dt)
            metrics.M.bytes_read.inc(self.disk.last_restore_bytes)
            self.last_frontier = n
            if not job.suffix:   # nothing to prefill: keep the stored logits
                ids = ids[:n]
            self.send(m.Begun(rid=job.rid, cached=n, prompt_tokens=len(ids), source="disk"))
            return ids, n
        r = copied or self.plan(job)
        self.live.truncate(r)
        self.make_room(0, {self.sid}, False, job.unsaved)
        if self.last_frontier > r:
            self.last_frontier = 0
        self.send(m.Begun(rid=job.rid, cached=r, prompt_tokens=len(job.ids), source="live" if r else "cold"))
        return list(job.ids), r

    def redo_answer(self, n_prompt: int, prompt_logits, end: int) -> None:
        """Exact mode: the rows decode appended (int4 kernels) are not what a prefill
        computes. Replace them by a prefill of the same tokens (the answer is sent already;
        only the next job waits), so the session and its checkpoints hold prefill rows only
        and the next turn still finds the answer cached."""
        redo = self.live.tokens[n_prompt:end]
        self.live.truncate(n_prompt)
        self.live.logits = prompt_logits
        if not redo:
            return
        s = self.s
        frontiers = continued_frontiers(n_prompt, end, s.kv_cache_continued_interval_tokens,
                                        s.kv_cache_boundary_align_tokens, self.last_frontier) \
            if self.disk.enabled else []
        got = self.live.prefill(redo, logits_at=frontiers)
        if frontiers:
            self.save_frontiers(n_prompt, end, got)

    def save_frontiers(self, start: int, end: int, logits_at: dict) -> None:
        s = self.s
        for f in continued_frontiers(start, end, s.kv_cache_continued_interval_tokens,
                                     s.kv_cache_boundary_align_tokens, self.last_frontier):
            if self.disk.save(self.live, f, logits_at.get(f), kvfile.CONTINUED):
                self.last_frontier = f

    def execute(self, job: m.Job) -> None:
        t0 = time.perf_counter()
        self.fallback_cold = False
        ids, r = self.start(job)
        todo = len(ids) - r
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

        reason, n, t1 = "cancelled", 0, None
        got: dict = {}
        s = self.s
        try:
            saves, frontiers = prompt_saves(s, job.saves, r, len(ids), self.fallback_cold, self.last_frontier) \
                if self.disk.enabled else ([], [])
            want = {p.pos for p in saves} | set(frontiers)
            got = self.live.prefill(ids[r:], logits_at=want, on_chunk=progress)
            got[len(self.live)] = self.live.logits
            t1 = time.perf_counter()

            def save_prompt_checkpoints():   # after the first token: not on the TTFT path
                for p in saves:
                    self.disk.save(self.live, p.pos, got.get(p.pos), p.reason)
                if self.disk.enabled:
                    self.save_frontiers(r, len(ids), got)
            sampler = Sampler(job.sampling)
            guide = self.guides.start(job.constraint)
            stop_ids = set(job.sampling.stop_ids)
            logits = self.live.logits
            budget = min(job.sampling.max_tokens, self.n_ctx - len(self.live))
            if budget <= 0:
                reason = "length"
                self.send(m.Token(rid=job.rid, id=-1, logprob=0.0, finish="length"))
                save_prompt_checkpoints()
            while budget > 0:
                tok, lp, top = sampler(logits, guide.mask(logits) if guide else None)
                if guide:
                    guide.advance(tok)
                n += 1
                finish = "stop" if tok in stop_ids else ("length" if n >= budget else "")
                self.send(m.Token(rid=job.rid, id=tok, logprob=lp, top=tuple(top), finish=finish))
                if n == 1:
                    save_prompt_checkpoints()
                if finish:
                    # the last token is not run (unless asked): the next turn's prompt starts
                    # with it, and its prefill takes it for almost nothing
                    reason = finish
                    if job.run_last and len(self.live) < self.n_ctx:
                        self.live.decode(tok)
                    break
                self.check(job.rid)
                logits = self.live.decode(tok)
                if self.disk.enabled and not self.live.exact:   # exact: decode rows are redone at the end
                    self.save_frontiers(len(self.live) - 1, len(self.live), {len(self.live): logits})
        except Cancelled:
            t1 = t1 or time.perf_counter()
        keep = self.keep.pop(job.rid, -1)
        if self.live.exact and len(self.live) > len(ids) and len(ids) in got:
            self.redo_answer(len(ids), got[len(ids)], keep if 0 < keep < len(self.live) else len(self.live))
        elif 0 < keep < len(self.live):   # tokens the answer does not keep (after a tool call):
            last = self.live.tokens[keep - 1]   # cut them, and re-run the last kept token for
            self.live.truncate(keep - 1)        # its logits (decode rows, as when generated),
            self.live.decode(last)              # so the session can still be checkpointed
        t2 = time.perf_counter()
        self.make_room(0, {self.sid}, False, job.unsaved)   # the session grew: others may leave
        self.send(self.done(job.rid, reason))
        source = "disk" if job.restore and r else ("live" if r else "cold")
        self.log.info("job %s: %s, cached %d, suffix %d prefilled in %.2f s (%.0f tok/s), %d tokens at %.1f tok/s, %s",
                      job.rid, source, r, todo, t1 - t0, todo / max(t1 - t0, 1e-9), n,
                      n / max(t2 - t1, 1e-9), reason)
        if todo >= 16:
            metrics.M.prefill_rate.observe(todo / max(t1 - t0, 1e-9))
        if n >= 8:
            metrics.M.decode_rate.observe(n / max(t2 - t1, 1e-9))
        metrics.M.live_tokens.set(self.sessions.tokens)
        metrics.M.live_sessions.set(len(self.sessions))
        metrics.M.resident_bytes.set(self.sessions.nbytes)


def run(argv=None) -> int:
    s = Settings.load("inference", argv)
    log = setup("inference", s.log_level)
    metrics.init(run_dir(s))
    return Worker(s, log).run()
