"""The jobs in flight and how they advance: each Run prefills its prompt a chunk at a time
and then decodes, and every decoding run advances in one batched step (steps.decode_many:
one read of each weight for all of them). A mixin of Worker (procs/inference/server.py),
whose state it uses: s, active, sessions, frontiers, disk, guides, keep, cancelled, n_ctx,
threads, send, start, make_room, log.

Order: the loop (Worker.run) gives at most one chunk's worth of prompt tokens to the
prefilling runs (prefill_step), then one decode step to every decoding run, so a long prompt
delays the others' streams by one chunk at a time. The prefilling run served first is the one
whose prompt would be in first had each been served alone from its arrival (fair queuing's
virtual finish: the loop's clock counts the prompt tokens it has prefilled, and a run's mark
is that clock at its begin plus its tokens to prefill): prompts that arrive together go one
after the other in arrival order, not chunk by chunk in turn (which would put every one of
them in at the burst's end); a short prompt passes a long one begun earlier only when it
would be done first; and the order is fixed at arrival, so no prompt waits for ever. Where
the model replays graphs (CUDA), the prefilling runs' next chunks share one step instead
(prefill_step, prefill_together).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from common import kvfile
from common import messages as m
from common import metrics
from common.policy import continued_frontiers
from procs.inference.kvsession import KVSession
from procs.inference.steps import decode_many, prefill_many
from procs.inference.lookup import Drafts, speculate
from procs.inference.plan import prompt_saves
from procs.inference.sampling import Sampler, sample_many


MAX_ENDED = 64    # ended jobs whose late keep is still applied (runs.keep_late)


def cut_to(sess, keep: int) -> None:
    """Keep the session's first `keep` tokens and re-run the last for its logits (a decode row,
    as when generated; a prefill row in exact mode), so it can still be checkpointed."""
    last = sess.tokens[keep - 1]
    sess.rewind(keep - 1)           # a recurrent state: from the mark below, prefilled again
    if sess.exact:
        sess.prefill([last])
    else:
        sess.decode(last)


@dataclass(eq=False)
class Run:
    job: m.Job
    t0: float
    sid: int = 0
    sess: KVSession | None = None
    ids: list[int] = field(default_factory=list)   # the effective prompt
    r: int = 0                                       # its tokens reused (live or restored)
    fallback_cold: bool = False                      # the planned restore failed
    saves: list = field(default_factory=list)        # checkpoints inside the prompt
    want: set = field(default_factory=set)           # positions whose logits the saves need
    got: dict = field(default_factory=dict)          # position -> logits there
    served: int = 0                                  # the loop's tick when it last got a chunk
    mark: int = 0                                    # its place in the prefill order (see above)
    last_log: float = 0.0
    t1: float | None = None                          # prefill done
    begun: float = 0.0                               # time.monotonic() at begin, when its session
    placed: float = 0.0                              # was in place, and when the prompt was in
    ready: float = 0.0                               # (the first token's stamps)
    sampler: Sampler | None = None
    guide: object = None
    stop_ids: frozenset = frozenset()
    budget: int = 0
    n: int = 0                                       # tokens generated
    logits: torch.Tensor | None = None               # next-token logits; set: decoding
    # prompt lookup (--draft-lookup, procs/inference/lookup.py): its state, and a token sent
    # but not yet in the session (sampled where a draft was not kept: the next round runs it)
    drafts: Drafts | None = None
    pending: int | None = None

    @property
    def rid(self) -> str:
        return self.job.rid


class Runs:
    def begin(self, job: m.Job) -> Run:
        """Put a job's session in place (restore, copy or cut) and make it a Run."""
        run = self.active[job.rid] = Run(job=job, t0=time.perf_counter(), begun=time.monotonic())
        run.last_log = run.t0
        run.ids, run.r = self.start(job, run)
        run.placed = time.monotonic()
        self.place(run)
        if self.disk.enabled:
            run.saves, frontiers = prompt_saves(self.s, job.saves, run.r, len(run.ids), run.fallback_cold,
                                                self.frontiers.get(run.sid, 0))
            run.want = {p.pos for p in run.saves} | set(frontiers)
        if len(run.sess) >= len(run.ids):     # nothing to prefill
            self.prefilled(run)
        return run

    def place(self, run: Run) -> None:
        """Its place in the prefill order: when its prompt would be in, served alone from now."""
        run.mark = self.clock + len(run.ids) - len(run.sess)

    def prefill_step(self, prefilling: list[Run], tick: int) -> None:
        """The prefill between two decode rounds: at most one chunk's worth of prompt tokens
        (the most a decoding stream waits), the first prompt in the prefill order's next
        chunk at least. Without graphs, chunks one after the other in that order while they
        fit: a prompt whose new tokens cross a chunk boundary (a turn's ~200 tokens, half the
        time) is in after one step, not two with the others' decode round between them.
        With graphs, every prefilling run's next chunk goes in one shared step (at most
        --parallel chunks): a step replayed from a graph is bound by its launches and reads of
        the weights, not its rows (H200, SmolLM2 at 4k of context: one prompt's 256 tokens
        17.7 ms, four prompts' 256 each in one step 21.2 ms), so a burst of turns is in at
        once rather than one after the other (bench/bench_graphs.py prints both)."""
        prefilling.sort(key=lambda r: r.mark)     # stable: ties go in begin order
        first = prefilling[0]
        if self.model.graphs is not None and len(prefilling) > 1 and self.prefill_together(prefilling, tick):
            return
        room = first.sess.chunk
        for r in prefilling:
            while r.rid in self.active and r.logits is None:
                n = len(self.next_chunk(r))
                if n > room and room < first.sess.chunk:   # the step's first chunk always goes
                    return
                room -= n
                done = len(r.sess)
                self.guarded(self.prefill_chunk, r, tick)
                if len(r.sess) == done:     # failed (or no progress): the step ends
                    return

    @staticmethod
    def next_chunk(run: Run) -> list[int]:
        """The prompt's tokens up to the session's next chunk boundary."""
        start = len(run.sess)
        return run.ids[start:run.sess.boundaries(start, len(run.ids))[0]]

    def prefill_chunk(self, run: Run, tick: int) -> None:
        run.served = tick
        chunk = self.next_chunk(run)
        self.clock += len(chunk)
        run.got.update(run.sess.prefill(chunk, logits_at=run.want, marks=run.want))
        self.chunk_done(run)

    def prefill_together(self, runs: list[Run], tick: int) -> bool:
        """One chunk of each run's prompt in one step of the model's graphs (steps.prefill_many:
        on CUDA several short chunks cost about one). False, nothing done, where that step is
        not a graph's (yet: graphs.prefill_many). A failure of the shared step is each run's."""
        chunks = [self.next_chunk(r) for r in runs]
        try:
            got = prefill_many([r.sess for r in runs], chunks, [r.want for r in runs])
        except Exception as e:
            for r in runs:
                if r.rid in self.active:
                    self.fail(r, e)
            return True
        if got is None:
            return False
        self.clock += max(map(len, chunks))
        for run, g in zip(runs, got):
            run.served = tick
            run.got.update(g)
            self.guarded(self.chunk_done, run)
        return True

    def chunk_done(self, run: Run) -> None:
        """After a chunk of run's prompt: progress to the renderer, a log line on long
        prompts, and the first token's turn once the prompt is in."""
        job, end = run.job, len(run.ids)
        hi = len(run.sess)
        done, total = hi - run.r, end - run.r
        self.send(m.Progress(rid=job.rid, done=done, total=total))
        now = time.perf_counter()
        if total >= 2048 and now - run.last_log > 2:
            run.last_log = now
            rate = done / (now - run.t0)
            self.log.info("prefill %s: %d%% (%d/%d), %.0f tok/s, %.1f s left", job.rid, 100 * done // total,
                          done, total, rate, (total - done) / rate)
        if hi == end:
            self.prefilled(run)

    def prefilled(self, run: Run) -> None:
        sess, job = run.sess, run.job
        run.got[len(sess)] = sess.logits
        sess.answer_from = len(sess)
        sess.mark()      # a recurrent state: the next turn may rewrite the answer (a template's)
        run.t1, run.ready = time.perf_counter(), time.monotonic()
        run.sampler = Sampler(job.sampling, run.ids)
        run.guide = self.guides.start(job.constraint)
        run.stop_ids = frozenset(job.sampling.stop_ids)
        run.budget = min(job.sampling.max_tokens, self.n_ctx - len(sess))
        run.logits = sess.logits
        if run.budget <= 0:
            self.send(m.Token(rid=job.rid, id=-1, logprob=0.0, finish="length"))
            self.save_prompt(run)
            self.end(run, "length")

    def save_prompt(self, run: Run) -> None:
        """The prompt's checkpoints: after the first token, so never on the TTFT path."""
        for p in run.saves:
            self.disk.save(run.sess, p.pos, run.got.get(p.pos), p.reason)
        if self.disk.enabled:
            self.save_frontiers(run, run.r, len(run.ids), run.got)

    def save_frontiers(self, run: Run, start: int, end: int, logits_at: dict) -> None:
        s = self.s
        for f in continued_frontiers(start, end, s.kv_cache_continued_interval_tokens,
                                     s.kv_cache_boundary_align_tokens, self.frontiers.get(run.sid, 0)):
            if self.disk.save(run.sess, f, logits_at.get(f), kvfile.CONTINUED):
                self.frontiers[run.sid] = f

    def emit(self, run: Run, tok: int, lp: float, top, settle=None) -> bool:
        """Send a sampled token; True when it ends the run (which is then ended). settle():
        puts the session where the token's logits came from, before an ending runs it."""
        job = run.job
        if run.guide:
            run.guide.advance(tok)
        run.n += 1
        finish = "stop" if tok in run.stop_ids else ("length" if run.n >= run.budget else "")
        stamps = (run.begun, run.placed, run.ready, time.monotonic()) if run.n == 1 else ()
        self.send(m.Token(rid=job.rid, id=tok, logprob=lp, top=tuple(top), finish=finish, stamps=stamps))
        if run.n == 1:
            self.save_prompt(run)
        if not finish:
            return False
        if settle is not None:
            settle()
        # the last token is not run (unless asked): the next turn's prompt starts with it,
        # and its prefill takes it for almost nothing
        if job.run_last and len(run.sess) < self.n_ctx:
            run.sess.decode(tok)
        self.end(run, finish)
        return True

    def decode_round(self, runs: list[Run]) -> list[Run]:
        """Sample one token for each decoding run and send it; the runs that go on advance in
        one batched step, or a run decoding alone checks a draft (lookup.speculate). Returns the runs
        of that step (a failure there is theirs)."""
        going, tokens = [], []
        fresh = [r for r in runs if r.pending is None]
        picks = dict(zip(map(id, fresh), sample_many([r.sampler for r in fresh], [r.logits for r in fresh],
                                                     [r.guide.mask(r.logits) if r.guide else None for r in fresh])))
        for run in runs:
            if run.pending is not None:          # sent when its draft was checked
                tok, run.pending = run.pending, None
            else:
                tok, lp, top = picks[id(run)]
                if self.emit(run, tok, lp, top):
                    continue
            going.append(run)
            tokens.append(tok)
        if not going:
            return going
        # (not with CUDA graphs: one graph replay per token is cheaper than an eager step)
        if len(going) == 1 and self.s.draft_lookup > 0 and self.model.graphs is None:
            run = going[0]
            run.drafts = run.drafts or Drafts(self.s.draft_lookup)
            if speculate(self, run, tokens[0]):
                return going
        metrics.M.batch_size.observe(len(going))
        shared = self.sharing.rows
        rows = self.threads.step(lambda: decode_many([r.sess for r in going], tokens, self.sharing), len(going))
        metrics.M.shared_rows.inc(self.sharing.rows - shared)
        for run, logits in zip(going, rows):
            run.logits = logits
            sess = run.sess
            if self.disk.enabled and not sess.exact:   # exact: decode rows are redone at the end
                self.save_frontiers(run, len(sess) - 1, len(sess), {len(sess): logits})
        return going

    def redo_answer(self, run: Run, n_prompt: int, prompt_logits, end: int) -> None:
        """Exact mode: the rows decode appended (int4 kernels) are not what a prefill
        computes. Replace them by a prefill of the same tokens (the answer is sent already;
        only the next job waits), so the session and its checkpoints hold prefill rows only
        and the next turn still finds the answer cached."""
        sess, s = run.sess, self.s
        redo = sess.tokens[n_prompt:end]
        sess.truncate(n_prompt)
        sess.logits = prompt_logits
        if not redo:
            return
        frontiers = continued_frontiers(n_prompt, end, s.kv_cache_continued_interval_tokens,
                                        s.kv_cache_boundary_align_tokens, self.frontiers.get(run.sid, 0)) \
            if self.disk.enabled else []
        got = sess.prefill(redo, logits_at=frontiers)
        if frontiers:
            self.save_frontiers(run, n_prompt, end, got)

    def end(self, run: Run, reason: str) -> None:
        """The job is over (finished, cut by its client, or stopped): its session keeps what
        the answer keeps, and the renderer hears JobDone."""
        job, sess = run.job, run.sess
        t1 = run.t1 or time.perf_counter()
        keep = self.keep.pop(job.rid, -1)
        if run.pending is not None and len(sess) < self.n_ctx:   # sent: the session holds it, as any
            sess.decode(run.pending)
        run.pending = None
        if sess.exact and len(sess) > len(run.ids) and len(run.ids) in run.got:
            self.redo_answer(run, len(run.ids), run.got[len(run.ids)], keep if 0 < keep < len(sess) else len(sess))
        elif 0 < keep < len(sess):   # tokens the answer does not keep (after a tool call)
            cut_to(sess, keep)
        t2 = time.perf_counter()
        self.active.pop(job.rid, None)
        self.cancelled.discard(job.rid)
        if keep < 0 and run.sid:
            self.ended[job.rid] = (run.sid, len(sess))
            while len(self.ended) > MAX_ENDED:
                self.ended.popitem(last=False)
        self.make_room(0, {run.sid}, False, job.unsaved)   # the session grew: others may leave
        todo, n, d = len(run.ids) - run.r, run.n, run.drafts
        # counted before the client hears the job is done: a scrape after the answer sees it
        if d and d.drafted:
            metrics.M.drafted.inc(d.drafted)
            metrics.M.draft_kept.inc(d.kept)
        if todo >= 16:
            metrics.M.prefill_rate.observe(todo / max(t1 - run.t0, 1e-9))
        if n >= 8:
            metrics.M.decode_rate.observe(n / max(t2 - t1, 1e-9))
        metrics.M.live_tokens.set(self.sessions.tokens)
        metrics.M.live_sessions.set(len(self.sessions))
        self.send(self.done(job.rid, reason, run))
        source = "disk" if job.restore and run.r else ("live" if run.r else "cold")
        self.log.info("job %s: %s, cached %d, suffix %d prefilled in %.2f s (%.0f tok/s), %d tokens at %.1f tok/s%s, %s",
                      job.rid, source, run.r, todo, t1 - run.t0, todo / max(t1 - run.t0, 1e-9), n,
                      n / max(t2 - t1, 1e-9), f" ({d.kept} of {d.drafted} drafted kept)" if d and d.drafted else "",
                      reason)
        metrics.M.resident_bytes.set(self.sessions.nbytes)
        if self.model.device.type == "cuda":
            metrics.M.device_peak.set(torch.cuda.max_memory_allocated(self.model.device))

    def forget_ended(self, sid: int) -> None:
        for rid in [r for r, (s, _) in self.ended.items() if s == sid]:
            del self.ended[rid]

    def keep_late(self, rid: str, keep: int) -> None:
        """A keep (a call's end, a stop string's start) heard after its job ended: the session
        is cut as end() would have cut it, if nothing has used it since (the renderer mirrors
        it cut)."""
        sid, n = self.ended.pop(rid)
        sess = self.sessions.get(sid)
        if sess is None or len(sess) != n or not 0 < keep < n or not sess.can_keep(keep - 1):
            return
        cut_to(sess, keep)
        self.trace.line(f"KV cache: session {sid} cut to {keep} tokens (its answer's end, heard late)")
        metrics.M.live_tokens.set(self.sessions.tokens)

    def fail(self, run: Run, e: Exception) -> None:
        """The request fails; the process and the other requests go on. Its session is
        dropped (its rows may be half written)."""
        self.log.error("job %s failed: %s", run.rid, e, exc_info=e)
        self.active.pop(run.rid, None)
        self.cancelled.discard(run.rid)
        self.keep.pop(run.rid, None)
        if run.sess is not None:
            run.sess.truncate(0)
            self.sessions.drop(run.sid)
            self.frontiers.pop(run.sid, None)
        self.send(m.JobError(rid=run.rid, message=f"inference error: {e}", live=(), session=0,
                             resident=tuple(self.sessions.by_id)))
