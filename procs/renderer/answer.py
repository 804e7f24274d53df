"""A running request's answer: Token events in, text deltas, stop strings, tool calls and
usage out to the web worker that asked. A mixin of Renderer (procs/renderer/server.py),
whose state it uses: text, to_web, to_inference, tool_memory, s, enc, to_persister, log.
Invariant: the live session keeps only the tokens of content + the closed call block, so it
and its checkpoints stay a byte prefix of the next turn's prompt."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import zmq

from common import messages as m
from common import metrics
from procs.renderer import harmony, thinking, tools
from procs.renderer.prompt import TextStream, token_logprob


@dataclass
class Pending:
    route: bytes
    req: m.GenerateRequest
    prompt: bytes
    full: list[int]
    ids: list[int] = field(default_factory=list)
    cached: int = 0
    prompt_tokens: int = 0          # set by Begun: inference has begun the job
    picked: float = 0.0             # time.monotonic(): the renderer began rendering it
    admitted: float = 0.0           # rendered, tokenized and queued
    dispatched: float = 0.0         # sent to inference
    first_token: bool = False
    gen_bytes: list[int] = field(default_factory=list)   # cumulative bytes after each generated token
    miss: str = ""                  # why the disk cache had nothing, for the lookup metric
    n_generated: int = 0
    n_reasoning: int = 0            # generated tokens whose text went to the reasoning alone
    stream: TextStream | None = None
    calls: tools.CallParser | None = None   # set when generated tool calls are parsed
    harmony: harmony.Channels | None = None  # a Harmony model's chat answer (its calls too)
    think: thinking.Think | None = None     # a thinking model's <think> block, before the answer
    finished: bool = False          # the web has its Finished/Failed; ignore further tokens
    constraint: m.Constraint | None = None
    # set when dispatched to inference
    since: float = 0.0              # when inference last said something about it
    heard_at_dispatch: bool = False  # inference was heard recently when it was sent
    dispatch_seq: int = 0           # pings sent before it; answers to later ones list it
    session: int = 0                # the resident session it runs in (0: a new one)
    reuse: int = 0                  # that session's tokens it keeps (rows below are not rewritten)
    waits_for: str = ""              # queued: the running job it follows (dispatch waits for it)
    keep: int = -1                  # session tokens its answer keeps (CancelJob.keep: a tool call's
                                    # or a stop string's end), -1: all

    @property
    def n_prompt(self) -> int:
        """The prompt's tokens: inference's count once it has begun the job, else the plan's."""
        return self.prompt_tokens or len(self.ids)


class Answers:
    def on_token(self, p: Pending, ev: m.Token) -> None:
        if p.finished:
            return
        if ev.id < 0:       # no room to generate at all
            self.finish(p, ev.finish or "length")
            return
        p.n_generated += 1
        p.gen_bytes.append((p.gen_bytes[-1] if p.gen_bytes else 0) + len(self.text.pieces[ev.id]))
        if not p.first_token:
            p.first_token = True
            now = time.monotonic()
            metrics.M.ttft.observe(now - p.admitted)
            self.first_token_stages(p, ev, now)
        is_stop_tok = ev.id in self.text.stop_ids
        text = "" if is_stop_tok else p.stream.push(ev.id)
        if is_stop_tok and p.harmony is not None:     # <|call|> or <|return|>: replay needs which
            p.harmony.stop = self.text.pieces[ev.id].decode("utf-8", "replace")
        lps = ()
        if p.req.logprobs:
            lps = (token_logprob(self.text, ev.id, ev.logprob, ev.top),)
        pieces, reasoning = [], ""
        if p.harmony is not None:
            reasoning, text, pieces = p.harmony.push(text)
        elif p.think is not None:
            reasoning, text = p.think.push(text)
        if reasoning and not text and not pieces:
            p.n_reasoning += 1
        if p.calls is not None:
            text, pieces = p.calls.push(text)
            if p.calls.done:      # a call was closed and the model went on with something else
                # (its offset in the sampled text: after the thinking, if any)
                kept = p.calls.close_block() + (p.think.skipped if p.think is not None else 0)
                if pieces:
                    self.to_web(p.route, m.Delta(rid=p.req.rid, logprobs=lps, tool_calls=tuple(pieces)))
                self.finish(p, "tool_calls")
                # the live session keeps only the tokens inside content + block, so that it and
                # its checkpoints stay a byte prefix of the next turn's prompt
                k = sum(1 for b in p.gen_bytes if b <= kept)
                p.keep = p.n_prompt + k
                self.to_inference(m.CancelJob(rid=p.req.rid, keep=p.keep))
                return
        if p.stream.stopped:   # a stop string: end here, and stop the model
            self.to_web(p.route, m.Delta(rid=p.req.rid, text=text, logprobs=lps, tool_calls=tuple(pieces),
                                         reasoning=reasoning))
            self.finish(p, "stop")
            if p.calls is None:    # the session keeps the tokens of the text the client got:
                p.keep = p.n_prompt + sum(1 for b in p.gen_bytes if b <= p.stream.sent)   # a prefix
            self.to_inference(m.CancelJob(rid=p.req.rid, keep=p.keep))      # of the next turn
            return
        if text or lps or pieces or reasoning:
            self.to_web(p.route, m.Delta(rid=p.req.rid, text=text, logprobs=lps, tool_calls=tuple(pieces),
                                         reasoning=reasoning))
        if ev.finish:
            self.finish(p, ev.finish)

    def first_token_stages(self, p: Pending, ev: m.Token, now: float) -> None:
        """Where the time to the first token went, stage by stage (every clock is the host's
        monotonic one): a histogram per stage and, with --trace, one line a request."""
        if len(ev.stamps) != 4:
            return
        begun, placed, ready, sent = ev.stamps
        stages = {"web": p.picked - p.req.received if p.req.received else 0.0,
                  "render": p.admitted - p.picked, "queue": p.dispatched - p.admitted,
                  "wait": begun - p.dispatched, "place": placed - begun, "prefill": ready - placed,
                  "sample": sent - ready, "back": now - sent}
        for stage, secs in stages.items():
            metrics.M.first_token_stage.labels(stage).observe(max(secs, 0.0))
        if self.trace:
            total = now - (p.req.received or p.picked)
            self.trace.line(f"first token {p.req.rid}: " + " ".join(f"{k} {1000 * v:.2f}" for k, v in stages.items())
                            + f" total {1000 * total:.2f} ms")

    def finish(self, p: Pending, reason: str) -> None:
        tail = p.stream.flush() if p.stream else ""
        pieces, reasoning = [], ""
        if p.harmony is not None:
            r1, tail, pieces = p.harmony.push(tail)
            r2, c2, p2 = p.harmony.flush()
            reasoning, tail, pieces = r1 + r2, tail + c2, pieces + p2
            if p.harmony.calls and reason != "length":
                reason = "tool_calls"
            block = p.harmony.block()
            if block is not None:
                self.remember_calls([c[0] for c in p.harmony.calls], block)
        elif p.think is not None:
            r1, tail = p.think.push(tail)
            r2, c2 = p.think.flush()
            reasoning, tail = r1 + r2, tail + c2
        if p.calls is not None:
            tail, pieces = p.calls.push(tail)
            tail += p.calls.flush()
            if p.calls.calls:
                if reason != "length" or p.calls.cut is None:
                    reason = "tool_calls"
                self.remember_calls([c[0] for c in p.calls.calls], p.calls.block)
            pieces += p.calls.cut_pieces()      # a cut call is never remembered: its block has no end to replay
        if tail or pieces or reasoning:
            self.to_web(p.route, m.Delta(rid=p.req.rid, text=tail, tool_calls=tuple(pieces), reasoning=reasoning))
        usage = m.Usage(prompt_tokens=p.n_prompt, completion_tokens=p.n_generated, cached_tokens=p.cached,
                        reasoning_tokens=p.n_reasoning)
        metrics.M.prompt_tokens.inc(usage.prompt_tokens)
        metrics.M.cached_tokens.inc(usage.cached_tokens)
        metrics.M.generated_tokens.inc(usage.completion_tokens)
        self.to_web(p.route, m.Finished(rid=p.req.rid, finish_reason=reason, usage=usage))
        p.finished = True

    def remember_calls(self, ids: list[str], text: str) -> None:
        """The calls' ids -> the exact text of their block (tools.ToolMemory, and the
        persister's KTM sections)."""
        if self.tool_memory is None:
            return
        block = text.encode("utf-8", "surrogateescape")
        self.tool_memory.remember(ids, block)
        if self.s.kv_disk_dir:
            try:
                self.to_persister.send(self.enc.encode(m.ToolIds(entries=tuple((i, block) for i in ids))),
                                       flags=zmq.NOBLOCK)
            except zmq.Again:
                self.log.warning("persister not reachable; tool ids kept in memory only")

    def fail(self, p: Pending, status: int, message: str, code=None, err_type="server_error") -> None:
        if not p.finished:
            self.to_web(p.route, m.Failed(rid=p.req.rid, status=status, message=message, code=code,
                                          err_type=err_type))
            p.finished = True
