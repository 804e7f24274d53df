"""Dispatch: which queued request goes to inference next, and the job it becomes. A mixin of
Renderer (procs/renderer/server.py), whose state it uses: s, text, n_ctx, index, inference,
queue, running, live, hints, trace, call_format, thinks, last_heard, ping_seq, to_inference, lacks.
Invariant: a job is planned when it is sent, against the sessions as they will be while the
other running jobs go on (a session one of them uses is a copy source, never continued)."""
from __future__ import annotations

import json
import time

import msgspec

from common import messages as m
from common.policy import common_prefix
from procs.renderer import grammar, harmony, thinking, tools, toolxml
from procs.renderer.answer import Pending
from procs.renderer.plan import plan_job
from procs.renderer.prompt import TextStream, tool_choice
from procs.renderer.readiness import HEALTH_FRESH_S


class Dispatch:
    def dispatch(self) -> None:
        """Send queued requests to inference, in order, while fewer than s.batch run; each is
        planned now, against the sessions as they will be: a session a running job uses is
        copied from, never continued in place. A request that follows a running job (below)
        waits for that job; the requests behind it go on."""
        if self.lacks():         # planned only against known state (queued requests wait)
            return
        i = 0
        while i < len(self.queue) and len(self.running) < self.s.batch:
            p = self.queue[i]
            if p.waits_for in self.running:     # not planned again until that job is done
                i += 1
                continue
            busy = {q.session: q.reuse for q in self.running.values() if q.session}
            pl = plan_job(self.s, self.text, self.n_ctx, self.index, self.planning_view(busy),
                          self.inference.quant_bits if self.inference else 0, p.req, p.prompt, p.full,
                          self.hints.get(p.req.session_hint, 0) if p.req.session_hint else 0, set(busy))
            q = next((q for q in self.running.values() if self.follows(p, q, pl.cached)), None)
            if q is not None:
                p.waits_for = q.req.rid
                i += 1
                continue
            del self.queue[i]
            # more: a request read behind this one, or one queued here that may go next
            self.send_job(p, pl, more=len(self.running) + 1 < self.s.batch
                          and (i < len(self.queue) or self.more_coming()))

    def follows(self, p: Pending, q: Pending, cached: int) -> bool:
        """Whether p should wait for the running q: p's prompt extends q's (q's conversation's
        next turn, sent as q's last token arrived, before inference reported its session),
        or shares with it at least a checkpoint's worth more tokens than p's plan reuses (a
        side request beside a cold first turn: waiting beats computing the prefix twice)."""
        if len(p.prompt) > len(q.prompt) and p.prompt.startswith(q.prompt):
            return True
        return common_prefix(p.full, q.ids) - cached >= max(self.s.kv_cache_min_tokens, 1)

    def planning_view(self, busy: dict[int, int]) -> dict[int, m.LiveSession]:
        """The resident sessions as a new job may use them: a session a running job uses
        holds, for sure, only the tokens that job keeps (it cuts the rest and appends)."""
        if not busy:
            return self.live
        return {sid: ls if sid not in busy else
                m.LiveSession(sid=sid, tokens=ls.tokens[:busy[sid]], keep_from=ls.keep_from,
                              answer_from=ls.answer_from if ls.answer_from <= busy[sid] else 0,
                              marks=None if ls.marks is None else tuple(x for x in ls.marks if x < busy[sid]))
                for sid, ls in self.live.items()}

    def no_calls(self, sampling: m.SamplingParams) -> m.SamplingParams:
        """tool_choice none: a format whose call opener is one token (Qwen's `<tool_call>`)
        gets that token banned, else a model that saw calls in the history writes one as
        text. A longer opener is left to the model."""
        trig = self.text.encode(self.call_format.trigger.encode())
        if len(trig) != 1:
            return sampling
        return msgspec.structs.replace(sampling, logit_bias=tuple(sorted({**dict(sampling.logit_bias),
                                                                           trig[0]: -100.0}.items())))

    def send_job(self, p: Pending, pl, more: bool = False) -> None:
        for line in pl.notes:
            self.trace.line(line)
        p.ids, p.miss = pl.ids, pl.miss
        budget = min(p.req.sampling.max_tokens, self.n_ctx - pl.n_prompt, self.s.n_predict or self.n_ctx)
        # the client's parameters, every field kept, with the budget and stop ids decided here
        sampling = msgspec.structs.replace(p.req.sampling, max_tokens=budget,
                                           stop_ids=tuple(sorted(self.text.stop_ids)), vocab=self.text.vocab_size)
        p.stream = TextStream(self.text, p.req.stop)
        if self.call_format.kind == "harmony" and p.req.kind == "chat":   # channels, calls included
            opened = harmony.opener(tool_choice(p.req) if p.req.tools else "none", bool(p.req.response_format))
            p.harmony = harmony.Channels(self.call_format.new_id, opened)
        elif p.req.kind == "chat" and self.thinks:
            p.think = thinking.Think(thinking.opened(p.prompt[-64:].decode("utf-8", "replace"), self.thinks),
                                     self.thinks)
        if p.harmony is None and p.req.tools:
            choice = tool_choice(p.req)
            if choice == "none":
                sampling = self.no_calls(sampling)
            else:
                c = p.constraint
                xml = self.call_format.kind == "xml"
                p.calls = tools.CallParser(opened=self.call_format.opener(choice), fmt=self.call_format,
                                           names=grammar.names(p.req.tools), grow=c is not None,
                                           grow_fenced=c is not None and bool(c.fence),
                                           strings=toolxml.string_params(json.loads(p.req.tools)) if xml else None)
        p.since = p.dispatched = time.monotonic()
        p.heard_at_dispatch = p.since - self.last_heard < HEALTH_FRESH_S
        p.dispatch_seq = self.ping_seq
        p.session, p.reuse = pl.session, pl.reuse
        self.running[p.req.rid] = p
        r = pl.restore
        self.to_inference(m.Job(rid=p.req.rid, ids=tuple(pl.ids), reuse=pl.reuse, sampling=sampling,
                                restore=r.sha1 if r else "", restore_tokens=r.n_tokens if r else 0,
                                suffix=pl.suffix, saves=pl.saves, evict=pl.evict,
                                run_last=p.calls is not None or p.harmony is not None, constraint=p.constraint,
                                session=pl.session, source=pl.source, unsaved=pl.unsaved, more=more))
