"""The persister process: the only one that writes the cache directory.

Knows files; never runs the model. It writes `.kv` files from shared-memory slots that
inference filled, keeps the index and sends it to the renderer (on every change and every
few seconds), bumps hits, evicts, and frees slots. Its whole state (index and tool ids) goes
to the renderer once the directory is scanned and whenever a renderer asks (RendererHello),
so no start-up order leaves a renderer without it.
"""
from __future__ import annotations

import collections
import os
import time
import uuid

import zmq

from common import messages as m
from common.config import Settings
from common.lifecycle import StopFlag
from common import metrics
from common.logs import setup
from common.models import load_text, resolve
from common.sockets import INFERENCE_JOBS, PERSISTER, RENDERER_EVENTS, address, run_dir
from common.trace import Trace
from procs.persister.store import Store
from shm.slots import get_seq, read_slot

SNAPSHOT_EVERY_S = 2.0
SHUTDOWN_GRACE_S = 3.0    # after SIGTERM, wait this long for inference's shutdown save
                          # (honcho kills everything 5 s after its SIGTERM)
KTM_SCAN_IDS = 4096       # newest tool ids checked against each checkpoint's text
# restore rejections that mean the file itself is broken (kvfile reasons): only these delete
CORRUPT = {"bad magic", "wrong version", "truncated", "payload size mismatch", "bad payload magic",
           "wrong payload version", "token count mismatch", "context mismatch", "bad payload header",
           "trailing bytes", "checksum mismatch", "text does not match the name", "token id out of range",
           "bad layer rows"}


class Persister:
    def __init__(self, s: Settings, log):
        self.s, self.log = s, log
        self.trace = Trace(s.trace, "persister")
        self.text = load_text(resolve(s.model, s.models_path()))
        self.store = Store(s.kv_disk_dir, s.kv_disk_space_mb, log, self.trace) if s.kv_disk_dir else None
        ctx = zmq.Context.instance()
        self.pull = ctx.socket(zmq.PULL)
        self.pull.bind(address(s, PERSISTER))
        self.to_inference = ctx.socket(zmq.PUSH)
        self.to_renderer = ctx.socket(zmq.PUSH)
        for sock, name in ((self.to_inference, INFERENCE_JOBS), (self.to_renderer, RENDERER_EVENTS)):
            sock.setsockopt(zmq.LINGER, 200)
            sock.setsockopt(zmq.SNDHWM, 16)
            sock.connect(address(s, name))
        self.enc, self.dec = m.encoder(), m.decoder(m.PersisterIn)
        self.stop = StopFlag()
        self.tool_ids: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self.warned: set[str] = set()
        self.done: dict[int, int] = {}      # slot -> seq of the last save handled from it
        if self.store and self.store.usable and not s.disable_exact_tool_replay:
            for sha1 in list(self.store.index):   # ids of earlier runs, for the files written next
                self.remember(self.store.read_ktm(sha1, s.tool_memory_max_ids).items())
        self.sent_version, self.last_snapshot = -1, 0.0
        self.boot = uuid.uuid4().hex
        self.send(self.to_inference, m.PersisterHello(pid=os.getpid()))
        self.send_state()       # scanned: a running renderer learns of us (and re-sends its tool ids)
        if self.store:
            log.info("cache dir %s: %d entries, budget %d MB%s", s.kv_disk_dir, len(self.store.index),
                     s.kv_disk_space_mb, "" if self.store.usable else " (unusable: cache off)")

    def send(self, sock, msg) -> None:
        try:
            sock.send(self.enc.encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass   # the peer is down; snapshots repeat, slot frees are re-announced by Hello

    def run(self) -> int:
        stop_at = None
        while True:
            if self.stop and stop_at is None:
                stop_at = time.monotonic() + SHUTDOWN_GRACE_S
            if stop_at is not None and time.monotonic() > stop_at:
                break
            if self.pull.poll(100):
                if self.receive() == "bye" and stop_at is not None:
                    self.drain_saves()
                    break
            self.publish()
        self.log.info("stopping")
        return 0

    def drain_saves(self) -> None:
        while self.pull.poll(0):
            self.receive()

    def receive(self) -> str | None:
        """Handle one message; "bye" for InferenceBye. A message that fails is lost, never
        the process (saves catch their own failures and warn once per kind)."""
        try:
            msg = self.dec.decode(self.pull.recv())
            if isinstance(msg, m.InferenceBye):
                return "bye"
            self.handle(msg)
        except Exception:
            self.log.exception("could not handle a message")
        return None

    def handle(self, msg) -> None:
        if isinstance(msg, m.SaveCheckpoint):
            self.save(msg)
        elif self.store is None and not isinstance(msg, m.RendererHello):
            return
        elif isinstance(msg, m.Restored):
            self.store.bump(msg.sha1)
        elif isinstance(msg, m.Rejected):
            if msg.reason in CORRUPT:   # another model's or quantization's files stay
                self.store.remove(msg.sha1, f"rejected on restore: {msg.reason}")
        elif isinstance(msg, m.ToolIds) and not self.s.disable_exact_tool_replay:
            self.remember(msg.entries)
        elif isinstance(msg, m.RendererHello):
            self.send_state()

    def remember(self, entries) -> None:
        for i, block in entries:
            self.tool_ids[i] = block
            self.tool_ids.move_to_end(i)
        while len(self.tool_ids) > self.s.tool_memory_max_ids:
            self.tool_ids.popitem(last=False)

    def ktm_for(self, text: bytes) -> dict[str, bytes]:
        """Ids whose exact block occurs in text (the newest KTM_SCAN_IDS ids are checked)."""
        out = {}
        for n, (i, block) in enumerate(reversed(self.tool_ids.items())):
            if n >= KTM_SCAN_IDS:
                break
            if block in text:
                out[i] = block
        return out

    def save(self, msg: m.SaveCheckpoint) -> None:
        t0 = time.perf_counter()
        mm = body = None
        if self.done.get(msg.slot) == msg.seq:   # sent again after our hello: done already
            self.send(self.to_inference, m.SlotFreed(slot=msg.slot, seq=msg.seq))
            return
        try:
            if self.store is None:
                return
            mm, body = read_slot(msg.slot_path, msg.nbytes)
            if get_seq(mm) != msg.seq:
                self.log.info("skipping a stale save (slot %d reused)", msg.slot)
                return
            text = self.text.piece_bytes(msg.tokens)
            sha1 = self.store.write(msg, body, text, self.ktm_for(text),
                                    still_valid=lambda: get_seq(mm) == msg.seq)
            if sha1:
                dt = time.perf_counter() - t0
                size = self.store.index[sha1].size if sha1 in self.store.index else 0
                from common.kvfile import REASON_NAMES
                self.trace.line(f"KV cache: stored sha1={sha1} ({len(msg.tokens)} tokens, reason "
                                f"{REASON_NAMES.get(msg.reason, '?')}, {size} bytes, {dt * 1000:.0f} ms)")
                self.log.info("stored %s: %d tokens, %s, %.1f MB in %.2f s", sha1, len(msg.tokens),
                              REASON_NAMES.get(msg.reason, "?"), size / 1e6, dt)
                metrics.M.stored.labels(REASON_NAMES.get(msg.reason, "unknown")).inc()
                metrics.M.bytes_written.inc(size)
                metrics.M.save_seconds.observe(dt)
        except Exception as e:  # a failed write loses one checkpoint, never the process
            kind = type(e).__name__ + str(getattr(e, "errno", ""))
            if kind not in self.warned:   # one clear warning per kind of failure (disk full, read-only...)
                self.warned.add(kind)
                self.log.warning("checkpoint not written: %s (further failures of this kind are traced only)", e)
            self.trace.line(f"KV cache: store failed ({e})")
        finally:
            if body is not None:
                body.release()
            if mm is not None:
                try:
                    mm.close()
                except BufferError:   # a view still alive after a failure; GC frees the map
                    pass
            self.done[msg.slot] = msg.seq
            self.send(self.to_inference, m.SlotFreed(slot=msg.slot, seq=msg.seq))

    def send_state(self) -> None:
        snap = self.store.snapshot() if self.store else m.IndexSnapshot(entries=(), version=0)
        self.send(self.to_renderer, m.PersisterState(boot=self.boot, index=snap, tool_ids=tuple(self.tool_ids.items())))
        if self.store:
            self.sent_version, self.last_snapshot = self.store.version, time.monotonic()

    def publish(self) -> None:
        if self.store is None:
            return
        now = time.monotonic()
        if self.store.version != self.sent_version or now - self.last_snapshot > SNAPSHOT_EVERY_S:
            metrics.M.dir_bytes.set(sum(e.size for e in self.store.index.values()))
            metrics.M.dir_entries.set(len(self.store.index))
            self.send(self.to_renderer, self.store.snapshot())
            self.sent_version, self.last_snapshot = self.store.version, now


def run(argv=None) -> int:
    s = Settings.load("persister", argv)
    log = setup("persister", s.log_level)
    metrics.init(run_dir(s))
    return Persister(s, log).run()
