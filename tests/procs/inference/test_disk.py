"""Inference's Disk on the real model: save -> shared-memory slot -> persister's Store ->
restore (restored K/V and logits bit-identical, and decoding on from them identical), and
the reasons a restore is refused."""
from __future__ import annotations

import os
import struct

import pytest
import xxhash

from common import kvfile as kf
from common import messages as m
from common.config import Settings
from common.trace import Trace
from tests.helpers import LOG, sha1


N_CTX, CHUNK = 192, 32


class Harness:
    """Disk on the real model, its saves routed straight through the slot into a Store."""

    def __init__(self, model, text_model, tmp_path):
        from procs.inference.disk import Disk
        from procs.persister.store import Store
        self.dir = tmp_path / "kv"
        self.trace = Trace(str(tmp_path / "trace"), "persister")
        self.store = Store(str(self.dir), 1000, LOG, self.trace)
        self.text = text_model
        self.s = Settings(kv_disk_dir=str(self.dir), run_dir=str(tmp_path / "run"), chunk_size=CHUNK)
        os.makedirs(self.s.run_dir, exist_ok=True)
        self.saved: list[str] = []
        self.waits = 0
        self.disk = Disk(self.s, model, N_CTX, self.s.run_dir, self.send, self.wait, LOG)

    def send(self, msg) -> None:
        from shm.slots import read_slot
        assert isinstance(msg, m.SaveCheckpoint)
        mm, body = read_slot(msg.slot_path, msg.nbytes)
        try:
            self.saved.append(self.store.write(msg, body, self.text.piece_bytes(msg.tokens), {}))
        finally:
            body.release()
            mm.close()
        if hasattr(msg, "seq"):
            self.disk.slot_freed(msg.slot, msg.seq)
        else:
            self.disk.slot_freed(msg.slot)

    def wait(self, timeout) -> None:
        self.waits += 1

    def close(self):
        self.disk.close()


@pytest.fixture
def harness(model_bf16, text_model, tmp_path):
    h = Harness(model_bf16, text_model, tmp_path)
    yield h
    h.close()


def conversation_ids(text_model, n: int) -> list[int]:
    msgs = [{"role": "system", "content": "You are a patient teacher of Italian cooking. Keep answers short, "
                                          "name the region of every dish, and never invent recipes. When a "
                                          "student asks about wine, suggest one from the same region."},
            {"role": "user", "content": "How do I make a simple risotto alla milanese at home, and which rice should I buy?"}]
    ids = text_model.encode(text_model.bos_text() + text_model.render_chat(msgs).encode())
    assert len(ids) >= n
    return ids[:n]


def greedy(sess, steps: int):
    toks, logits = [], []
    lg = sess.logits
    for _ in range(steps):
        t = int(lg.argmax())
        toks.append(t)
        lg = sess.decode(t)
        logits.append(lg.clone())
    return toks, logits


def test_disk_save_restore_bit_exact(model_bf16, text_model, harness):
    import torch
    from procs.inference.kvsession import KVSession
    model = model_bf16
    ids = conversation_ids(text_model, 70)
    live = KVSession(model, N_CTX, CHUNK)
    got = live.prefill(ids, logits_at={64})
    # a checkpoint at an aligned position inside the prompt and one of the whole session
    assert harness.disk.save(live, 64, got[64], kf.CONTINUED)
    assert harness.disk.save(live, len(live), live.logits, kf.SHUTDOWN)
    assert not harness.disk.pool.busy and len(harness.saved) == 2
    sha_whole = sha1(text_model.piece_bytes(ids))
    sha_64 = sha1(text_model.piece_bytes(ids[:64]))
    assert harness.saved == [sha_64, sha_whole]
    e = kf.read(str(harness.dir / f"{sha_whole}.kv"))
    assert e.header.reason == kf.SHUTDOWN and e.header.n_tokens == 70
    assert e.header.quant_bits == model.cfg.quant_bits == 4 and e.fingerprint == model.fingerprint
    assert e.geometry == harness.disk.geometry and e.text == text_model.piece_bytes(ids)
    assert kf.verify(str(harness.dir / f"{sha_whole}.kv")) == []
    assert os.path.getsize(harness.dir / f"{sha_whole}.kv") == \
        kf.TEXT_OFFSET + len(e.text) + kf.payload_size(70, e.geometry)

    # the whole session: rows, ids and logits equal; decoding on is identical
    fresh = KVSession(model, N_CTX, CHUNK)
    assert harness.disk.restore(fresh, sha_whole) == 70
    assert fresh.tokens == live.tokens
    assert torch.equal(fresh.k[:, :, :70], live.k[:, :, :70])
    assert torch.equal(fresh.v[:, :, :70], live.v[:, :, :70])
    assert fresh.logits.dtype == torch.float32 and torch.equal(fresh.logits, live.logits)
    t_live, l_live = greedy(live, 4)
    t_disk, l_disk = greedy(fresh, 4)
    assert t_disk == t_live
    assert all(torch.equal(a, b) for a, b in zip(l_disk, l_live))

    # the aligned prefix: resuming the prefill from 64 gives the uninterrupted logits
    part = KVSession(model, N_CTX, CHUNK)
    assert harness.disk.restore(part, sha_64) == 64
    assert torch.equal(part.logits, got[64])
    assert torch.equal(part.k[:, :, :64], live.k[:, :, :64])
    part.prefill(ids[64:])
    ref = KVSession(model, N_CTX, CHUNK)
    ref.prefill(ids)
    assert torch.equal(part.logits, ref.logits)
    assert torch.equal(part.k[:, :, :70], ref.k[:, :, :70])


def test_disk_restore_rejects(model_bf16, text_model, harness):
    from procs.inference.disk import RestoreError
    from procs.inference.kvsession import KVSession
    ids = conversation_ids(text_model, 40)
    live = KVSession(model_bf16, N_CTX, CHUNK)
    live.prefill(ids)
    assert harness.disk.save(live, 40, live.logits, kf.COLD)
    good = sha1(text_model.piece_bytes(ids))
    path = harness.dir / f"{good}.kv"
    blob = path.read_bytes()
    sess = KVSession(model_bf16, N_CTX, CHUNK)

    def reject(data: bytes | None, name: str = good) -> str:
        if data is not None:
            (harness.dir / f"{name}.kv").write_bytes(data)
        sess.prefill(ids[:5])                    # something to lose
        with pytest.raises(RestoreError) as ei:
            harness.disk.restore(sess, name)
        assert len(sess) == 0                    # a failed restore leaves the session empty
        return ei.value.reason

    flipped = bytearray(blob)
    flipped[len(blob) - 100] ^= 0x01
    assert reject(bytes(flipped)) == "checksum mismatch"
    assert reject(b"KVX" + blob[3:]) == "bad magic"
    assert reject(blob[:3] + b"\x02" + blob[4:]) == "wrong version"
    assert reject(blob[:len(blob) // 2]) == "truncated"
    fp = bytearray(blob)
    off = kf.TEXT_OFFSET + len(text_model.piece_bytes(ids)) + kf.PAYLOAD_HEAD_SIZE
    fp[off] ^= 0xFF
    assert reject(bytes(fp)) == "checksum mismatch"          # a flipped byte is corruption
    p0 = kf.TEXT_OFFSET + len(text_model.piece_bytes(ids))
    struct.pack_into("<Q", fp, len(fp) - 8, xxhash.xxh3_64_intdigest(bytes(fp[p0:len(fp) - 8])))
    assert reject(bytes(fp)) == "fingerprint mismatch"       # a sound file of another model
    other = "0" * 40
    assert reject(blob, other) == "text does not match the name"
    assert reject(None, "1" * 40) == "file gone"
    assert reject(None, "../../etc/passwd") == "bad sha1"
    q = bytearray(blob)
    q[kf.OFF_QUANT] = 8
    (harness.dir / f"{good}.kv").write_bytes(bytes(q))
    sess2 = KVSession(model_bf16, N_CTX, CHUNK)
    assert harness.disk.restore(sess2, good) == 40        # another quant is reusable by default
    harness.s.kv_cache_reject_different_quant = True
    assert reject(None) == "different quantization"
