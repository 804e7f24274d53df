"""The renderer's readiness: what it must know from the other processes before it serves
(inference's health and live session, the persister's index and tool ids), asked for until
known, and requests held (unrendered) meanwhile. A mixin of Renderer (procs/renderer/
server.py), whose state it reads and writes: inference, last_heard, live, persister_boot,
held, queue, running, unready_since, last_hello, index, tool_memory; it calls admit,
dispatch, fail and to_web. "Not yet known" is never taken for "empty"."""
from __future__ import annotations

import time

import zmq

from common import messages as m

HEALTH_FRESH_S = 5.0      # inference counts as up if it said anything this recently ...
BUSY_FRESH_S = 30.0       # ... or this, while it runs a job: it answers pings between prefill chunks,
                          # and one 512-token chunk at a 20k-token context takes ~7 s on 2 cores
READY_WAIT_S = 120.0      # a request held this long while the server is not ready fails (503)
HELLO_EVERY_S = 2.0       # RendererHello repeats until the persister's state arrives


class Readiness:
    def lacks(self) -> str:
        """What the renderer does not know yet to serve correctly ("" when ready)."""
        missing = []
        window = HEALTH_FRESH_S if not self.running else BUSY_FRESH_S
        if self.inference is None or time.monotonic() - self.last_heard >= window:
            missing.append("the inference process (starting: loading its model)" if self.inference is None
                           else "the inference process (not answering)")
        elif self.live is None:
            missing.append("the live sessions' token ids from inference")
        if self.s.kv_disk_dir and not self.persister_boot:
            missing.append("the disk cache index from the persister")
        return "waiting for " + " and ".join(missing) if missing else ""

    def hold(self, route: bytes, req: m.GenerateRequest) -> bool:
        """Not ready: keep the request unrendered (rendering needs the index for tool-call
        replay, planning needs the live ids) and tell the web it waits."""
        lacks = self.lacks()
        if not lacks:
            return False
        if len(self.held) + len(self.queue) >= self.s.max_queue:
            self.to_web(route, m.Failed(rid=req.rid, status=429, message="too many requests are waiting; retry later",
                                        code="queue_full"))
            return True
        self.held.append((route, req, time.monotonic()))
        self.to_web(route, m.Waiting(rid=req.rid, detail=lacks))
        return True

    def keep_ready(self, now: float) -> None:
        """Ask for what is missing; admit held requests once ready; fail what waited too long."""
        if self.s.kv_disk_dir and not self.persister_boot and now - self.last_hello > HELLO_EVERY_S:
            self.last_hello = now
            self.send_persister(m.RendererHello(boot=self.boot))
        lacks = self.lacks()
        if not lacks:
            if self.unready_since is not None:
                self.log.info("ready (after %.1f s)", now - self.unready_since)
                self.unready_since = None
            while self.held and not self.lacks():
                route, req, _ = self.held.popleft()
                self.admit(route, req)
            self.dispatch()
            return
        if self.unready_since is None:
            self.unready_since = now
            self.log.warning("not ready: %s", lacks)
        while self.held and now - self.held[0][2] > READY_WAIT_S:
            route, req, _ = self.held.popleft()
            self.to_web(route, m.Failed(rid=req.rid, status=503, message=f"the server is not ready ({lacks})",
                                        code="not_ready", err_type="server_error"))
        if now - self.unready_since > READY_WAIT_S:
            for p in [p for p in self.queue if now - max(p.admitted, self.unready_since) > READY_WAIT_S]:
                self.queue.remove(p)
                self.fail(p, 503, f"the server is not ready ({lacks})", code="not_ready")

    def send_persister(self, msg) -> None:
        try:
            self.to_persister.send(self.enc.encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass   # the persister is not reading; what matters is asked again

    def on_persister_state(self, ev: m.PersisterState) -> None:
        """The persister's whole state: after its start (scan done) or our RendererHello."""
        self.index.update(ev.index)
        if self.tool_memory is not None:
            # the persister's ids (its files' KTM sections, and what earlier renderers told it)
            # join the ids read from those files, so a replay counts as one from disk
            known = self.tool_memory.disk
            known.update(ev.tool_ids)
            while len(known) > self.tool_memory.max_ids:
                known.pop(next(iter(known)))
            if self.persister_boot and ev.boot != self.persister_boot and self.tool_memory.mem:
                # a restarted persister knows only the ids in its files: give it ours again
                items = list(self.tool_memory.mem.items())
                for k in range(0, len(items), 1000):
                    self.send_persister(m.ToolIds(entries=tuple(items[k:k + 1000])))
        if ev.boot != self.persister_boot:
            self.log.info("persister %s: %d index entries, %d tool ids", ev.boot[:8], len(ev.index.entries),
                          len(ev.tool_ids))
        self.persister_boot = ev.boot
        self.keep_ready(time.monotonic())

    def on_live_state(self, ev: m.LiveState) -> None:
        p = self.running.get(ev.rid) if ev.rid else None
        if p is not None:
            # inference did not run the job: it was planned against a session it does not hold
            self.log.warning("job %s: planned against a stale live session; planning it again", ev.rid)
            self.mirror(ev.sessions)
            del self.running[ev.rid]
            self.queue.appendleft(p)
            self.dispatch()
        elif not ev.rid and not ev.busy and not self.running and self.live is None \
                and (self.inference is None or ev.boot == self.inference.boot):
            self.mirror(ev.sessions)
            self.keep_ready(time.monotonic())
