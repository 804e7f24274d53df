"""The renderer process: requests in from every web worker, jobs out to inference.

Knows text and tokens, nothing of tensors. It renders and tokenizes prompts, holds the one
FIFO queue of requests for the model, sends up to --parallel of them to inference at once
(each planned when it is sent), mirrors the resident sessions' token ids (inference reports
them after every job) to plan reuse, and turns Token events into text deltas, stop strings
and usage for the web worker that asked (its ROUTER identity is the route).
Readiness: what it learns from other processes (the persister's index and tool ids, the
live session's ids, inference's health) it asks for whenever it does not know it, and a
request that arrives meanwhile is held, unrendered, never planned against "empty".

Here: the sockets, run(), admission and the events. Decisions live beside it: dispatch.py
(which queued request goes to inference, and its job), plan.py (the reuse plan),
readiness.py (what must be known before serving), answer.py (Token events to the web's
messages), grammar.py, prompt.py, tools.py, toolfmt.py, cache.py.
"""
from __future__ import annotations

import collections
import json
import time
import uuid

import zmq

from common import messages as m
from common.config import Settings
from common.lifecycle import StopFlag
from common import metrics
from common.logs import setup
from common.params import ParamError, validate_sampling
from common.models import ModelError, context_size, load_text, resolve, served_model_id
from common.sockets import INFERENCE_JOBS, PERSISTER, RENDERER, RENDERER_EVENTS, address, run_dir
from common.tokenizer import template_kwargs
from common.trace import Trace
from procs.renderer.cache import DiskIndex
from procs.renderer.answer import Answers, Pending
from procs.renderer.dispatch import Dispatch
from procs.renderer.readiness import Readiness
from common import guidance
from procs.renderer.encoding import PromptEncoder
from procs.renderer import grammar, thinking, toolfmt, tools
from procs.renderer.prompt import PromptError, render, tool_choice

JOB_SILENCE_S = 120.0     # a running job with no event for this long is failed (lost job)
# Inference answers pings between prefill chunks and tokens, so a process heard when a job
# started and silent this long since is dead or hung: its job is failed sooner. Only a job it
# has begun: one it has not may wait in the socket for a restarting process (which lists it
# in its first ping answer, or the job is failed then as lost), however long its model loads.
INFERENCE_SILENCE_S = 20.0
# While one step of its loop runs (a prefill chunk can take tens of seconds for a large model
# on a slow CPU), a thread of inference says so (InferenceBusy); a step longer than this is
# taken for a hang, and its announcements no longer count as being heard.
STEP_LIMIT_S = 600.0
MAX_HINTS = 10_000        # session hints remembered (each names a resident session, or a gone one)


class Renderer(Readiness, Answers, Dispatch):
    def __init__(self, s: Settings, log):
        self.s, self.log = s, log
        path = resolve(s.model, s.models_path())
        self.text = load_text(path, s.chat_template_file)
        try:
            self.text.template_kwargs = template_kwargs(s.chat_template_kwargs, "--chat-template-kwargs")
        except ValueError as e:
            raise ModelError(str(e)) from None
        self.n_ctx = context_size(path, s.ctx_size, warn=False)   # inference says why
        self.model_id = served_model_id(s.model_id, s.model)
        ctx = zmq.Context.instance()
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.router.bind(address(s, RENDERER))
        self.events = ctx.socket(zmq.PULL)
        self.events.bind(address(s, RENDERER_EVENTS))
        self.jobs = ctx.socket(zmq.PUSH)
        self.jobs.setsockopt(zmq.LINGER, 0)
        self.jobs.setsockopt(zmq.SNDHWM, 100)
        self.jobs.connect(address(s, INFERENCE_JOBS))
        self.trace = Trace(s.trace, "renderer")
        self.tool_memory = None if s.disable_exact_tool_replay else \
            tools.ToolMemory(s.tool_memory_max_ids, s.kv_disk_dir)
        self.to_persister = ctx.socket(zmq.PUSH)
        self.to_persister.setsockopt(zmq.LINGER, 0)
        self.to_persister.setsockopt(zmq.SNDHWM, 1000)
        self.to_persister.connect(address(s, PERSISTER))
        self.index = DiskIndex(s, self.trace)
        added = self.text.tokenizer.get_added_tokens_decoder()
        self.grammars = grammar.Checker(guidance.tokenizer(self.text),
                                        specials=frozenset(a.content for a in added.values() if a.special))
        self.call_format = toolfmt.detect(self.text.chat_template)   # the model family's call syntax
        self.thinks = thinking.detect(self.text.chat_template)       # answers may open with <think>: its tags
        self.prompts = PromptEncoder(self.text)
        self.enc = m.encoder()
        self.dec_in, self.dec_ev = m.decoder(m.RendererIn), m.decoder(m.EventsIn)
        self.queue: collections.deque[Pending] = collections.deque()
        self.inbox: collections.deque[tuple] = collections.deque()   # (route, request) read, not handled
        self.running: dict[str, Pending] = {}    # rid -> a request inference has (at most s.batch)
        # the resident sessions, least recently used first; None: not known (ask: LiveQuery)
        self.live: dict[int, m.LiveSession] | None = None
        # sid -> (its LiveSession, the index's version, tokens on disk): /slots looks a
        # session up again only when either changed (a lookup hashes the session's text)
        self.on_disk: dict[int, tuple[m.LiveSession, int, int]] = {}
        self.hints: collections.OrderedDict[str, int] = collections.OrderedDict()  # session_hint -> sid
        self.inference: m.InferenceHealth | None = None
        self.last_heard = 0.0
        self.stopped: dict[str, None] = {}      # rids of foreign jobs already cancelled
        self.last_ping = 0.0
        self.ping_seq = 0
        self.boot = uuid.uuid4().hex
        self.persister_boot = ""                # "": no PersisterState yet (index unknown)
        self.last_hello = 0.0
        self.held: collections.deque[tuple[bytes, m.GenerateRequest, float]] = collections.deque()
        self.unready_since: float | None = time.monotonic()
        self.stop = StopFlag()
        log.info("started: %s, context %d, %d tokens in vocabulary, tool calls in the %s format", self.model_id,
                 self.n_ctx, self.text.vocab_size, self.call_format.name)

    # -- plumbing --
    def to_web(self, route: bytes, msg) -> None:
        try:
            self.router.send_multipart([route, self.enc.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass   # that web worker is gone; nothing to deliver to

    def to_inference(self, msg) -> None:
        try:
            self.jobs.send(self.enc.encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.log.warning("inference not reachable; dropped %s", type(msg).__name__)

    def run(self) -> int:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.events, zmq.POLLIN)
        while not self.stop:
            # (requests read while planning a job, Job.more, wait in the inbox: no wait for them)
            ready = dict(poller.poll(0 if self.inbox else 200))
            if self.events in ready:
                self.read_events()
            if self.router in ready or self.inbox:
                self.read_requests()
                while self.inbox:
                    self.on_request(*self.inbox.popleft())
                    self.read_requests()
                self.read_events()      # what came while requests were tokenized: before any timeout
            self.housekeeping()
        self.log.info("stopping")
        return 0

    def read_events(self) -> None:
        while self.events.poll(0):
            self.on_event(self.dec_ev.decode(self.events.recv()))

    def housekeeping(self) -> None:
        now = time.monotonic()
        if now - self.last_ping > 1.0:
            self.last_ping = now
            self.ping_seq += 1
            self.to_inference(m.InferencePing(rid="renderer", seq=self.ping_seq))
            if self.live is None and not self.running:
                self.to_inference(m.LiveQuery())
        self.keep_ready(now)
        for p in list(self.running.values()):
            if now - p.since > JOB_SILENCE_S:
                self.lose(p, f"no word from inference about it for {JOB_SILENCE_S:.0f} s")
            elif p.heard_at_dispatch and p.prompt_tokens and now - self.last_heard > INFERENCE_SILENCE_S:
                self.lose(p, f"the inference process has not answered for {INFERENCE_SILENCE_S:.0f} s")

    def lose(self, p: Pending, why: str) -> None:
        """A running job will never finish (inference died, restarted or lost it): its
        request fails with a 503 and the queue moves on."""
        self.log.error("job %s: %s; failing it", p.req.rid, why)
        self.fail(p, 503, f"the inference process failed this request ({why})", code="inference_unavailable",
                  err_type="server_error")
        self.to_inference(m.CancelJob(rid=p.req.rid))     # in case it is alive after all
        self.live = None        # unknown now: asked for again before the next plan
        self.running.pop(p.req.rid, None)
        self.dispatch()

    # -- web requests --
    def read_requests(self) -> None:
        """Every request waiting at the router into the inbox, decoded, in arrival order."""
        while self.router.poll(0):
            route, raw = self.router.recv_multipart()
            try:
                self.inbox.append((route, self.dec_in.decode(raw)))
            except Exception as e:
                self.log.warning("undecodable request from web: %s", e)

    def more_coming(self) -> bool:
        """Whether a request to generate has arrived and is not yet handled (Job.more); a
        count of tokens (Anthropic's count_tokens, which Claude Code sends beside its turns)
        makes no job."""
        self.read_requests()
        return any(isinstance(msg, m.GenerateRequest) and not msg.count_only for _, msg in self.inbox)

    def on_request(self, route: bytes, msg) -> None:
        if isinstance(msg, m.PingRequest):
            lacks = self.lacks()
            i = self.inference
            self.to_web(route, m.Health(rid=msg.rid, ready=not lacks, model=self.model_id, n_ctx=self.n_ctx,
                                        device=i.device if i else "", dtype=i.dtype if i else "",
                                        detail=lacks, holds=bool(msg.about) and self.holds(msg.about),
                                        slots=self.slot_states() if msg.slots and not lacks else (),
                                        parallel=self.s.batch, queued=len(self.queue) + len(self.held)))
        elif isinstance(msg, m.CancelRequest):
            self.cancel(msg.rid)
        else:
            self.admit(route, msg)

    def admit(self, route: bytes, req: m.GenerateRequest) -> None:
        if self.hold(route, req):
            return
        picked = time.monotonic()
        try:
            validate_sampling(req.sampling, self.text.vocab_size)
            stats = tools.Rendered()
            prompt = render(self.text, req, self.tool_memory, self.index.entries, stats)
            if any(x.tool_calls for x in req.messages):
                self.trace.line(f"request {req.rid}: {stats.line()}")
                for how in ("memory", "disk", "json"):
                    if getattr(stats, how):
                        metrics.M.tool_calls.labels(how).inc(getattr(stats, how))
            full = self.prompts.encode(prompt)
            if req.count_only:
                self.to_web(route, m.Finished(rid=req.rid, finish_reason="count",
                                              usage=m.Usage(prompt_tokens=len(full), completion_tokens=0,
                                                            cached_tokens=0)))
                return
            if not full:
                raise PromptError("prompt" if req.kind == "completion" else "messages", "the prompt is empty")
            if len(full) >= self.n_ctx:
                raise PromptError("messages" if req.kind == "chat" else "prompt",
                                  f"This model's maximum context length is {self.n_ctx} tokens, but the "
                                  f"prompt has {len(full)} tokens (at least one more is needed to answer).",
                                  code="context_length_exceeded", prompt_tokens=len(full), limit=self.n_ctx)
            if len(self.queue) >= self.s.max_queue:
                raise PromptError(None, "too many requests are waiting; retry later", code="queue_full", status=429)
            constraint = self.constrain(req)
        except (ParamError, grammar.GrammarError) as e:
            self.to_web(route, m.Failed(rid=req.rid, status=400, message=str(e), param=e.param))
            return
        except PromptError as e:
            self.to_web(route, m.Failed(rid=req.rid, status=e.status, message=str(e), code=e.code, param=e.param,
                                        prompt_tokens=e.prompt_tokens, limit=e.limit))
            return
        self.to_web(route, m.Accepted(rid=req.rid, prompt_tokens=len(full)))
        self.queue.append(Pending(route, req, prompt, full, picked=picked, admitted=time.monotonic(),
                                  constraint=constraint))
        self.dispatch()

    def constrain(self, req: m.GenerateRequest) -> m.Constraint | None:
        if req.kind != "chat" or not (req.tools or req.response_format):
            return None
        fmt = json.loads(req.response_format) if req.response_format else None
        return self.grammars.make(json.loads(req.tools) if req.tools else [], tool_choice(req), fmt,
                                  req.parallel_tool_calls, self.call_format)

    def holds(self, rid: str) -> bool:
        return (rid in self.running or any(p.req.rid == rid for p in self.queue)
                or any(h[1].rid == rid for h in self.held))

    def cancel(self, rid: str) -> None:
        for h in list(self.held):
            if h[1].rid == rid:
                self.held.remove(h)
                return
        for p in list(self.queue):
            if p.req.rid == rid:
                self.queue.remove(p)
                return
        p = self.running.get(rid)
        if p is not None:
            p.finished = True
            self.to_inference(m.CancelJob(rid=rid))

    # -- the mirror of inference's resident sessions --
    def slot_states(self) -> tuple[m.SlotState, ...]:
        """The resident sessions, most recently used first, then the running jobs in a session
        not among them (a new one: inference names it only when the job ends). A failure
        answers an empty list: a monitoring answer never ends the renderer's loop."""
        try:
            running = {p.session: p for p in self.running.values() if p.session}
            quant = self.inference.quant_bits if self.inference else 0
            live = self.live or {}
            out = []
            self.on_disk = {sid: c for sid, c in self.on_disk.items() if sid in live}
            for sid, ls in reversed(live.items()):
                p = running.get(sid)
                cached = self.on_disk.get(sid)
                if cached and cached[0] is ls and cached[1] == self.index.version:
                    n = cached[2]
                else:
                    entry = None
                    if self.s.kv_disk_dir and ls.tokens:
                        entry, _ = self.index.lookup(self.text.piece_bytes(ls.tokens), self.n_ctx, quant, why=False)
                    n = entry.n_tokens if entry else 0
                    self.on_disk[sid] = (ls, self.index.version, n)
                out.append(m.SlotState(sid=sid, n_tokens=p.n_prompt + p.n_generated if p else len(ls.tokens),
                                       rid=p.req.rid if p else "", n_decoded=p.n_generated if p else 0,
                                       on_disk=n))
            out += [m.SlotState(sid=p.session, n_tokens=p.n_prompt + p.n_generated, rid=p.req.rid, n_decoded=p.n_generated)
                    for p in self.running.values() if p.session not in live]
            return tuple(out)
        except Exception as e:   # noqa: BLE001
            self.log.error("GET /slots: %s", e, exc_info=e)
            return ()

    def mirror(self, sessions) -> None:
        self.live = {ls.sid: ls for ls in sessions}

    def job_session(self, p, sid: int, tokens, keep_from: int, resident, answer_from: int = 0,
                    marks: tuple[int, ...] | None = None) -> None:
        """After a job: its session's ids, and which sessions are resident (in LRU order)."""
        old = self.live or {}
        if sid:
            old[sid] = m.LiveSession(sid=sid, tokens=tuple(tokens), keep_from=keep_from,
                                     answer_from=answer_from if answer_from <= len(tokens) else 0,
                                     marks=None if marks is None else tuple(x for x in marks if x < len(tokens)))
        self.live = {i: old[i] for i in resident if i in old}
        if sid and p.req.session_hint:
            self.hints[p.req.session_hint] = sid
            self.hints.move_to_end(p.req.session_hint)
            while len(self.hints) > MAX_HINTS:
                self.hints.popitem(last=False)

    # -- inference events --
    def on_event(self, ev) -> None:
        if isinstance(ev, m.IndexSnapshot):   # from the persister
            self.index.update(ev)
            return
        if isinstance(ev, m.PersisterState):
            self.on_persister_state(ev)
            return
        if isinstance(ev, m.InferenceBusy):
            if ev.step_s < STEP_LIMIT_S and (self.inference is None or ev.boot == self.inference.boot):
                self.last_heard = time.monotonic()
            return
        self.last_heard = time.monotonic()
        if isinstance(ev, m.LiveState):
            self.on_live_state(ev)
            return
        if isinstance(ev, m.InferenceHealth):
            if self.inference is not None and ev.boot != self.inference.boot:
                self.log.warning("the inference process restarted")
                self.live = None        # its session is not the one mirrored: ask
                if not self.running:
                    self.to_inference(m.LiveQuery())
            self.inference = ev
            # pings and jobs travel in one pipe: an answer to a ping sent after the job that
            # does not list it means the process that has the job is gone (it finished: its
            # JobDone came first, on the event pipe)
            for p in [p for p in self.running.values() if ev.seq > p.dispatch_seq and p.req.rid not in ev.jobs]:
                self.lose(p, "the inference process does not hold it (it restarted)")
            return
        p = self.running.get(ev.rid)
        if p is None:
            # a late event of a job failed here, or of one a previous renderer started: stop it
            if isinstance(ev, (m.Begun, m.Token, m.Progress)) and ev.rid not in self.stopped:
                self.stopped[ev.rid] = None
                if len(self.stopped) > 1000:
                    self.stopped.pop(next(iter(self.stopped)))
                self.to_inference(m.CancelJob(rid=ev.rid))
            return
        p.since = time.monotonic()
        if isinstance(ev, m.Begun):
            p.cached, p.prompt_tokens = ev.cached, ev.prompt_tokens
            self.to_web(p.route, m.Started(rid=p.req.rid, prompt_tokens=ev.prompt_tokens, cached_tokens=ev.cached))
            outcome = {"live": "live", "disk": "disk"}.get(ev.source, "miss")
            reason = "" if outcome != "miss" else (ev.detail.split(":")[0] if ev.detail else p.miss or "none")
            metrics.M.lookups.labels(outcome, reason).inc()
        elif isinstance(ev, m.Token):
            self.on_token(p, ev)
        elif isinstance(ev, m.JobDone):
            if not p.finished:     # cancelled by inference itself (shutdown)
                self.finish(p, "length" if ev.reason == "length" else "stop")
            # a job that ended before hearing its keep (a tool call's end, a stop string's):
            # inference cuts the session when the keep reaches it, before any job sent after now
            live = ev.live[:p.keep] if 0 < p.keep < len(ev.live) else ev.live
            self.job_session(p, ev.session, live, ev.keep_from, ev.resident, ev.answer_from, ev.marks)
            del self.running[ev.rid]
            self.dispatch()
        elif isinstance(ev, m.JobError):
            self.fail(p, 500, ev.message, err_type="server_error")
            self.job_session(p, ev.session, ev.live, 0, ev.resident)
            del self.running[ev.rid]
            self.dispatch()


def run(argv=None) -> int:
    s = Settings.load("renderer", argv)
    log = setup("renderer", s.log_level)
    metrics.init(run_dir(s))
    try:
        r = Renderer(s, log)
    except ModelError as e:
        log.error("%s", e)
        return 2
    return r.run()
