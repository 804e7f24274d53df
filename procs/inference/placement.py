"""Where a job runs: the resident session the renderer's plan names, a new one (a copy of a
resident session's prefix, a restored checkpoint, or a cold start), with room made for it.
A mixin of Worker (procs/inference/server.py), whose state it uses: s, sessions, active,
frontiers, disk, row_bytes, n_ctx, send, send_persister, trace, log.

Invariants: a session some running job uses (busy) is never evicted, cut, dropped or
continued in place by another job; a job may copy the prefix of a busy session (rows below
the running job's start are not written again). A session leaving memory is checkpointed
first (evict) when the plan lists it as unsaved.
"""
from __future__ import annotations

import time

from common import kvfile
from common import messages as m
from common import metrics
from procs.inference.disk import RestoreError
from procs.inference.plan import live_reuse


class Placement:
    def busy(self) -> set[int]:
        """Sessions the running jobs use."""
        return {r.sid for r in self.active.values() if r.sid}

    def evict(self, sid: int, unsaved) -> None:
        """sid leaves memory, checkpointed first when no checkpoint holds it whole."""
        sess = self.sessions.get(sid)
        if sid in unsaved and len(sess) >= self.s.kv_cache_min_tokens and sess.logits is not None:
            self.disk.save(sess, len(sess), sess.logits, kvfile.EVICT)
        self.trace.line(f"KV cache: session {sid} ({len(sess)} tokens) leaves memory")
        self.sessions.drop(sid)
        self.frontiers.pop(sid, None)

    def make_room(self, need: int, keep: set[int], new: bool, unsaved, force: bool = False) -> bool:
        """Evict least recently used sessions (never those in keep, nor busy ones) until need
        more bytes and, if new, one more session fit. False when they cannot (a kept one is in
        the way); then nothing leaves unless force (a new session is made all the same)."""
        victims, fits = self.sessions.room(need, keep | self.busy(), new)
        if fits or not new or force:
            for v in victims:
                self.evict(v, unsaved)
        return fits

    def session_for(self, job: m.Job, run) -> int | None:
        """Put the job's session in place (run.sid, run.sess): the resident one it names, or a
        new one (for a restore, a copy of a resident one's prefix, or a cold prefill), room
        made for it. Returns how many of the source session's tokens it copied when the job
        starts from a copy (0: the copy kept nothing, a cold prefill), None when the plan's
        reuse applies to run.sess itself (Placement.plan)."""
        sess = self.sessions.get(job.session) if job.session else None
        if sess is not None and not job.restore:
            run.sid, run.sess = job.session, sess
            self.sessions.touch(job.session)
            return None
        busy = self.busy()
        self.sessions.drop_empty(but=busy | {job.source})
        src = self.sessions.get(job.source) if job.source and not job.restore else None
        n = job.restore_tokens + len(job.suffix) if job.restore else len(job.ids)
        need = self.row_bytes * min(self.n_ctx, n)
        keep = {job.source} if src is not None else set()
        if src is not None and job.source not in busy and not self.make_room(need, keep, True, job.unsaved):
            # no room beside its source (one session, or a full budget): the source itself
            # goes on in place, checkpointed first like any session leaving memory
            run.sid, run.sess = job.source, src
            self.sessions.touch(job.source)
            if job.source in job.unsaved and len(src) > job.reuse and src.logits is not None:
                self.disk.save(src, len(src), src.logits, kvfile.EVICT)
            return None
        if src is None or job.source in busy:
            self.make_room(need, keep, True, job.unsaved, force=True)
        run.sid, run.sess = self.sessions.add()
        if src is None:
            return None         # cold; or the source is gone, which plan() reports
        r, stale = live_reuse(job.ids, job.reuse, src.tokens, src.logits is not None, self.s.chunk_size,
                              src.can_keep)
        if stale:
            self.log.warning("job %s: the source session differs from the plan; cold prefill", job.rid)
        if r:
            run.sess.copy_prefix(src, r)
            self.frontiers[run.sid] = min(self.frontiers.get(job.source, 0), r)
            self.trace.line(f"KV cache: session {run.sid} starts from {r} tokens of session {job.source}")
        return r

    def plan(self, job: m.Job, sess) -> int:
        """Tokens of the session to keep: the renderer's plan if it still holds."""
        r, stale = live_reuse(job.ids, job.reuse, sess.tokens, sess.logits is not None, self.s.chunk_size,
                              sess.can_keep)
        if stale:
            self.log.warning("job %s: live session differs from the plan or lacks the window rows it "
                             "needs (floor %d); cold prefill", job.rid, sess.window_floor)
        return r

    def start(self, job: m.Job, run) -> tuple[list[int], int]:
        """Put the job's session in place: (effective prompt ids, tokens reused)."""
        copied = self.session_for(job, run)
        sess, sid = run.sess, run.sid
        self.forget_ended(sid)            # a job runs in it: a late keep no longer applies
        if job.evict and len(sess) > 0 and not copied:
            self.disk.save(sess, len(sess), sess.logits, kvfile.EVICT)
        if job.restore:
            t0 = time.perf_counter()
            try:
                n = self.disk.restore(sess, job.restore)
            except RestoreError as e:
                self.log.warning("restore of %s failed (%s); cold prefill", job.restore, e.reason)
                self.trace.line(f"KV cache: rejected sha1={job.restore} (reason: {e.reason}); cold prefill")
                self.send_persister(m.Rejected(sha1=job.restore, reason=e.reason))
                self.send(m.Begun(rid=job.rid, cached=0, prompt_tokens=len(job.ids), source="cold",
                                  detail=f"restore failed: {e.reason}"))
                self.frontiers[sid] = 0
                run.fallback_cold = True
                return list(job.ids), 0
            ids = list(sess.tokens) + list(job.suffix)
            self.send_persister(m.Restored(sha1=job.restore))
            self.trace.line(f"KV cache: hit for sha1={job.restore} (loaded {n} tokens)")
            dt = time.perf_counter() - t0
            self.log.info("restored %s: %d tokens in %.3f s", job.restore, n, dt)
            metrics.M.restore_seconds.observe(dt)
            metrics.M.bytes_read.inc(self.disk.last_restore_bytes)
            self.frontiers[sid] = n
            if not job.suffix:   # nothing to prefill: keep the stored logits
                ids = ids[:n]
            self.send(m.Begun(rid=job.rid, cached=n, prompt_tokens=len(ids), source="disk"))
            return ids, n
        r = copied if copied is not None else self.plan(job, sess)
        sess.truncate(r)
        self.make_room(0, {sid}, False, job.unsaved)
        if self.frontiers.get(sid, 0) > r:
            self.frontiers[sid] = 0
        self.send(m.Begun(rid=job.rid, cached=r, prompt_tokens=len(job.ids), source="live" if r else "cold"))
        return list(job.ids), r
