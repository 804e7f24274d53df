"""The slot handoff between inference's Disk and the persister process's loop, over real
ZeroMQ sockets and shared-memory slots, on the real model: a persister's hello that reaches
inference after a save was handed loses no save (it used to free the slot, which the next
save overwrote mid-write: a clean-clone run lost the first cold checkpoint so), and a save
handed to a persister that died before reading it is written by the next one."""
from __future__ import annotations

import zmq

from common import kvfile as kf
from common import messages as m
from common.config import Settings
from common.sockets import INFERENCE_JOBS, PERSISTER, RENDERER_EVENTS, address
from procs.inference.disk import Disk
from procs.inference.kvsession import KVSession
from procs.persister.server import Persister
from tests.helpers import LOG

N_CTX = 256


class Inference:
    """What the inference process is to the persister: its bound PULL (hello, SlotFreed), a
    PUSH to the persister, and a Disk over the slots."""

    def __init__(self, s: Settings, model):
        ctx = zmq.Context.instance()
        self.pull = ctx.socket(zmq.PULL)
        self.pull.bind(address(s, INFERENCE_JOBS))
        self.renderer = ctx.socket(zmq.PULL)      # the persister's index snapshots land here
        self.renderer.bind(address(s, RENDERER_EVENTS))
        self.push = ctx.socket(zmq.PUSH)
        self.push.connect(address(s, PERSISTER))
        self.enc, self.dec = m.encoder(), m.decoder(m.InferenceIn)
        self.disk = Disk(s, model, N_CTX, s.run_dir, lambda msg: self.push.send(self.enc.encode(msg)),
                         lambda t=0: None, LOG)
        self.hellos = []

    def messages(self, timeout_ms: int = 2000) -> list:
        """What has reached inference so far (waiting for the first one)."""
        out = []
        while self.pull.poll(timeout_ms):
            out.append(self.dec.decode(self.pull.recv()))
            timeout_ms = 100
        return out

    def handle(self, msgs) -> None:
        for msg in msgs:
            if isinstance(msg, m.SlotFreed):
                self.disk.slot_freed(msg.slot, msg.seq)
            elif isinstance(msg, m.PersisterHello):
                self.disk.persister_hello()

    def close(self) -> None:
        self.disk.pool.close()
        for sock in (self.pull, self.renderer, self.push):
            sock.close(linger=0)


def settings(tmp_path) -> Settings:
    (tmp_path / "run").mkdir()
    return Settings(kv_disk_dir=str(tmp_path / "kv"), run_dir=str(tmp_path / "run"), chunk_size=32,
                    trace=str(tmp_path / "trace.txt"))


def close(p: Persister) -> None:
    for sock in (p.pull, p.to_inference, p.to_renderer):
        sock.close(linger=0)


def serve(p: Persister) -> int:
    """The persister's loop, until no message has come for 0.3 s; the messages handled."""
    n, timeout_ms = 0, 2000
    while p.pull.poll(timeout_ms):
        p.receive()
        n, timeout_ms = n + 1, 300
    return n


def stored(tmp_path) -> list[str]:
    trace = tmp_path / "trace.txt"
    return [ln for ln in trace.read_text().splitlines() if "KV cache: stored" in ln] if trace.exists() else []


def session(model, n: int) -> KVSession:
    sess = KVSession(model, N_CTX, 32)
    sess.prefill(list(range(200, 200 + n)))
    return sess


def test_a_late_hello_loses_no_save(model_bf16, tmp_path):
    s = settings(tmp_path)
    inf = Inference(s, model_bf16)
    p = Persister(s, LOG)                          # its hello is on its way to inference
    try:
        sess = session(model_bf16, 70)
        assert inf.disk.save(sess, 60, sess.logits, kf.COLD)       # handed before the hello is read
        inf.handle(m_ for m_ in inf.messages() if isinstance(m_, m.PersisterHello))   # the late hello
        assert inf.disk.save(sess, 64, sess.logits, kf.CONTINUED)  # must not take the handed slot
        handled = serve(p)
        lines = stored(tmp_path)
        assert len(lines) == 2 and " (60 tokens, reason cold" in lines[0] and " (64 tokens" in lines[1], lines
        assert len(list((tmp_path / "kv").glob("*.kv"))) == 2
        assert handled == 3                        # the two saves, and the first one sent again
        freed = inf.messages()
        inf.handle(freed)
        assert [(f.slot, f.seq) for f in freed].count((0, freed[0].seq)) == 2   # freed twice, written once
        assert not inf.disk.pool.busy
    finally:
        close(p)
        inf.close()


def test_a_save_the_dead_persister_never_read_is_written_by_the_next(model_bf16, tmp_path):
    s = settings(tmp_path)
    inf = Inference(s, model_bf16)
    first = Persister(s, LOG)
    try:
        inf.handle(inf.messages())                 # its hello
        sess = session(model_bf16, 70)
        assert inf.disk.save(sess, 64, sess.logits, kf.COLD)
        assert first.pull.poll(2000)
        close(first)                               # killed with the save unread
        assert inf.disk.pool.busy
        second = Persister(s, LOG)
        inf.handle(inf.messages())                 # the new one's hello: the save goes to it
        assert serve(second) == 1
        inf.handle(inf.messages())
        assert not inf.disk.pool.busy
        assert len(stored(tmp_path)) == 1 and len(list((tmp_path / "kv").glob("*.kv"))) == 1
        close(second)
    finally:
        inf.close()
