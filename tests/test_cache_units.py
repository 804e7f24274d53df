"""The disk cache's pieces without processes: the renderer's index lookup and save plan, the
persister's Store (atomic writes from a slot body, LRU eviction, startup scan, modes), and
inference's Disk save -> shared-memory slot -> Store -> restore round trip on the real model
(restored K/V and logits bit-identical, and decoding on from them identical)."""
from __future__ import annotations

import hashlib
import logging
import os
import stat
import struct
import time

import xxhash

import numpy as np
import pytest

from common import kvfile as kf
from common import messages as m
from common.config import Settings
from common.trace import Trace

LOG = logging.getLogger("test-cache-units")


def sha1(b: bytes) -> str:
    return hashlib.sha1(b).hexdigest()


# ------------------------------------------------------------------ renderer: DiskIndex.lookup

PROMPT = (b"<|im_start|>system\nYou answer questions about a bakery.<|im_end|>\n"
          b"<|im_start|>user\nWhat bread do you bake on Sundays?<|im_end|>\n<|im_start|>assistant\n")


def entry(text: bytes, n_tokens: int, *, quant_bits=4, ctx_size=8192, size=1000, last_used=0):
    return m.IndexEntry(sha1=sha1(text), text_len=len(text), n_tokens=n_tokens, quant_bits=quant_bits,
                        ctx_size=ctx_size, size=size, last_used=last_used)


def index(*entries, **settings):
    from procs.renderer.cache import DiskIndex
    s = Settings(kv_disk_dir="/nonexistent", kv_cache_min_tokens=8, **settings)
    ix = DiskIndex(s, Trace("", "renderer"))
    ix.update(m.IndexSnapshot(entries=tuple(entries), version=3))
    return ix


def test_lookup_longest_byte_prefix_wins():
    short, mid, longest = PROMPT[:20], PROMPT[:70], PROMPT[:len(PROMPT) - 5]
    other = b"X" + PROMPT[1:90]                       # same length class, different bytes
    beyond = PROMPT + b"Fresh rye."                   # longer than the prompt
    ix = index(entry(short, 10), entry(mid, 30), entry(other, 40), entry(longest, 50), entry(beyond, 60))
    assert ix.version == 3
    hit, why = ix.lookup(PROMPT, 8192, 4)
    assert hit is not None and hit.sha1 == sha1(longest) and why == ""
    # without the longest, the next longer prefix; the non-prefix never
    ix = index(entry(short, 10), entry(mid, 30), entry(other, 40))
    assert ix.lookup(PROMPT, 8192, 4)[0].sha1 == sha1(mid)
    # the whole prompt is a prefix of itself
    ix = index(entry(mid, 30), entry(PROMPT, 70))
    assert ix.lookup(PROMPT, 8192, 4)[0].sha1 == sha1(PROMPT)
    # an entry that is not a byte prefix is a miss (no trace: a short reason)
    ix = index(entry(other, 40), entry(beyond, 60))
    hit, why = ix.lookup(PROMPT, 8192, 4)
    assert hit is None and why.startswith("prefix mismatch")
    assert index().lookup(PROMPT, 8192, 4) == (None, "no checkpoints")


def test_lookup_bytes_not_characters():
    text = "Caffè latte e cornetto, per favore.".encode()
    cut = text.index("è".encode()) + 1               # in the middle of a UTF-8 character
    ix = index(entry(text[:cut], 9))
    assert ix.lookup(text, 8192, 4)[0].sha1 == sha1(text[:cut])


def test_lookup_ignores_small_larger_ctx_and_other_quant_with_flag():
    small, big_ctx, q8, good = PROMPT[:80], PROMPT[:90], PROMPT[:100], PROMPT[:40]
    entries = (entry(small, 7),                          # below min tokens (8)
               entry(big_ctx, 40, ctx_size=16384),       # written with a larger context
               entry(q8, 45, quant_bits=8),              # another quantization
               entry(good, 8))                           # exactly min tokens: a candidate
    ix = index(*entries)
    # by default another quantization of the same geometry is reusable
    assert ix.lookup(PROMPT, 8192, 4)[0].sha1 == sha1(q8)
    assert {e.sha1 for e in ix.candidates(8192, 4)} == {sha1(q8), sha1(good)}
    # a larger current context accepts the larger-context entry
    assert ix.lookup(PROMPT, 16384, 4)[0].sha1 == sha1(q8)
    ix = index(*entries, kv_cache_reject_different_quant=True)
    assert ix.lookup(PROMPT, 8192, 4)[0].sha1 == sha1(good)
    assert ix.lookup(PROMPT, 8192, 8)[0].sha1 == sha1(q8)
    ix = index(entry(small, 7), entry(big_ctx, 40, ctx_size=16384))
    assert ix.lookup(PROMPT, 8192, 4) == (None, "no usable checkpoints")


def test_lookup_miss_reason_with_trace(tmp_path):
    """With --trace the miss names the byte where the best candidate stopped matching."""
    from procs.renderer.cache import DiskIndex
    text = PROMPT[:30] + b"Z" * 20
    g = kf.Geometry(ctx_size=64, chunk_size=16, kv_capacity=64, n_layers=1, kv_heads=1, head_dim=2,
                    vocab_size=4, kv_dtype=kf.KV_F32)
    z = np.zeros((1, 3, 1, 2), np.float32)
    (tmp_path / kf.entry_name(text)).write_bytes(
        kf.pack(text, [1, 2, 3], np.zeros(4, np.float32), z, z, g, bytes(16), 4, kf.COLD))
    s = Settings(kv_disk_dir=str(tmp_path), kv_cache_min_tokens=1)
    ix = DiskIndex(s, Trace(str(tmp_path / "trace"), "renderer"))
    ix.update(m.IndexSnapshot(entries=(entry(text, 3, ctx_size=64),), version=1))
    assert ix.lookup(PROMPT, 8192, 4) == (None, "prefix mismatch at byte 30")


# ------------------------------------------------------------------ renderer: save plan, evict

def settings(**kw):
    d = dict(kv_disk_dir="/x", kv_cache_min_tokens=64, kv_cache_cold_max_tokens=30000,
             kv_cache_boundary_align_tokens=64, kv_cache_boundary_trim_tokens=8,
             kv_cache_continued_interval_tokens=256)
    d.update(kw)
    return Settings(**d)


def test_save_plan():
    from procs.renderer.cache import save_plan
    s = settings()
    cold = lambda *pos: tuple(m.SavePoint(pos=p, reason=kf.COLD) for p in pos)
    assert save_plan(s, 400, 0, 150) == cold(150, 376)            # prefix end + aligned cold
    assert save_plan(s, 400, 0, 0) == cold(376)
    assert save_plan(s, 400, 200, 150) == cold(376)                # the prefix was reused
    assert save_plan(s, 400, 376, 150) == ()                       # nothing beyond reused
    assert save_plan(s, 400, 0, 40) == cold(376)                   # system part below min
    assert save_plan(s, 63, 0, 0) == ()                            # prompt below min
    assert save_plan(s, 100, 0, 0) == cold(92)                     # 64 - 8 < 64: n - trim
    assert save_plan(s, 70, 0, 0) == ()                            # 70 - 8 < 64
    assert save_plan(settings(kv_cache_cold_max_tokens=300), 400, 0, 150) == ()
    assert save_plan(s, 376, 0, 376) == cold(312, 376)


class FakeText:
    """piece_bytes of ids: one byte each."""

    @staticmethod
    def piece_bytes(ids) -> bytes:
        return bytes(i % 256 for i in ids)


def test_evict_needed():
    from procs.renderer.cache import evict_needed
    s = settings()
    live = list(range(100))
    assert evict_needed(s, index(), FakeText, live, 0)
    assert evict_needed(s, index(), FakeText, live, 36)            # loses exactly min (64)
    assert not evict_needed(s, index(), FakeText, live, 37)        # loses 63 < 64
    assert not evict_needed(s, index(), FakeText, [], 0)
    assert not evict_needed(settings(kv_disk_dir=""), index(), FakeText, live, 0)
    text = FakeText.piece_bytes(live)
    assert not evict_needed(s, index(entry(text, 100)), FakeText, live, 0)   # already on disk
    assert evict_needed(s, index(entry(text, 99)), FakeText, live, 0)        # not that state
    assert evict_needed(s, index(entry(text[:50], 50)), FakeText, live, 0)


# ------------------------------------------------------------------ persister: Store

GEOM = dict(n_layers=2, kv_heads=2, head_dim=64, vocab_size=1000, kv_dtype=kf.KV_BF16)
FP = bytes(range(100, 116))


def fake_slot(n: int, seed: int = 0, g=GEOM, ctx=4096, reason=kf.COLD):
    """A SaveCheckpoint and the slot body bytes laid out as shm/slots.py says:
    tokens u32[n] | logits f32[vocab] | per layer K[n, KV, D] then V[n, KV, D]."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50000, n).astype("<u4")
    logits = rng.standard_normal(g["vocab_size"]).astype("<f4")
    shape = (g["n_layers"], 2, n, g["kv_heads"], g["head_dim"])
    kv = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
    body = tokens.tobytes() + logits.tobytes() + kv.tobytes()
    extra = {"seq": 1} if "seq" in m.SaveCheckpoint.__struct_fields__ else {}
    save = m.SaveCheckpoint(slot=0, slot_path="", nbytes=len(body), tokens=tuple(int(t) for t in tokens),
                            reason=reason, ctx_size=ctx, chunk_size=512, quant_bits=4, fingerprint=FP,
                            **g, **extra)
    return save, body, (tokens, logits, kv)


def text_for(seed: int, n: int) -> bytes:
    return f"<|im_start|>user\nconversation {seed}: ".encode() + b"x" * n


def store(path, budget_mb=100, trace=None):
    from procs.persister.store import Store
    return Store(str(path), budget_mb, LOG, trace or Trace("", "persister"))


def put(st, seed, n=300, now=None, monkeypatch=None, reason=kf.COLD):
    if now is not None:
        monkeypatch.setattr(time, "time", lambda: float(now))
    save, body, arrays = fake_slot(n, seed, reason=reason)
    text = text_for(seed, n)
    got = st.write(save, memoryview(body), text, {})
    assert got == sha1(text)
    return got, text, arrays


def entry_files(d) -> dict[str, int]:
    return {f: os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if kf.is_entry_name(f)}


def test_store_write_reads_back_exactly(tmp_path):
    d = tmp_path / "kv"
    st = store(d)
    save, body, (tokens, logits, kv) = fake_slot(37, seed=5, reason=kf.CONTINUED)
    text = "Caffè".encode()[:-1]                      # may end in the middle of a character
    got = st.write(save, memoryview(body), text, {})
    path = d / (sha1(text) + ".kv")
    assert got == sha1(text) and path.is_file()
    assert os.listdir(d) == [path.name]               # no temp file left behind
    e = kf.read(str(path))
    assert e.text == text and e.fingerprint == FP
    assert e.header.reason == kf.CONTINUED and e.header.quant_bits == 4 and e.header.ctx_size == 4096
    assert e.header.n_tokens == 37 and e.header.hits == 0 and e.header.flags == 0
    assert np.array_equal(e.tokens, tokens) and np.array_equal(e.logits, logits)
    assert np.array_equal(e.k, kv[:, 0]) and np.array_equal(e.v, kv[:, 1])
    assert e.geometry.n_layers == 2 and e.geometry.kv_dtype == kf.KV_BF16
    assert kf.verify(str(path)) == []
    # the payload between fingerprint and checksum is the slot body, byte for byte
    raw = path.read_bytes()
    p0 = kf.TEXT_OFFSET + len(text) + kf.PAYLOAD_HEAD_SIZE + kf.FINGERPRINT_SIZE
    assert raw[p0:p0 + len(body)] == body
    ix = st.index[sha1(text)]
    assert (ix.n_tokens, ix.text_len, ix.size, ix.quant_bits) == (37, len(text), len(raw), 4)
    # the same state again is not rewritten
    v = st.version
    mtime = path.stat().st_mtime_ns
    assert st.write(save, memoryview(body), text, {}) == sha1(text)
    assert st.version == v and path.stat().st_mtime_ns == mtime


def test_store_rejects_a_body_of_the_wrong_size(tmp_path):
    st = store(tmp_path / "kv")
    save, body, _ = fake_slot(10)
    with pytest.raises(ValueError):
        st.write(save, memoryview(body[:-2]), b"abc", {})
    assert os.listdir(tmp_path / "kv") == [] and st.index == {}


def test_store_modes(tmp_path):
    old = os.umask(0o022)
    try:
        st = store(tmp_path / "kv")
        sha, _, _ = put(st, 1, n=10)
        assert stat.S_IMODE(os.stat(tmp_path / "kv").st_mode) == 0o700
        assert stat.S_IMODE(os.stat(tmp_path / "kv" / f"{sha}.kv").st_mode) == 0o600
        # an existing dir that only others can read is tightened to 0700
        d2 = tmp_path / "kv2"
        d2.mkdir(mode=0o755)
        os.chmod(d2, 0o755)
        st2 = store(d2)
        assert st2.usable and stat.S_IMODE(os.stat(d2).st_mode) == 0o700
        # one that others can write is not used at all
        d3 = tmp_path / "kv3"
        d3.mkdir()
        os.chmod(d3, 0o777)
        st3 = store(d3)
        save, body, _ = fake_slot(10)
        assert not st3.usable and st3.write(save, memoryview(body), b"t", {}) is None
        assert os.listdir(d3) == []
    finally:
        os.umask(old)


def test_store_eviction_lru_keeps_just_written(tmp_path, monkeypatch):
    d = tmp_path / "kv"
    trace = tmp_path / "trace"
    st = store(d, budget_mb=1, trace=Trace(str(trace), "persister"))
    budget = 1 << 20
    a, _, _ = put(st, 1, now=1000, monkeypatch=monkeypatch)
    size = entry_files(d)[a + ".kv"]
    assert 3 * size <= budget < 4 * size, size          # three fit, four do not
    b, _, _ = put(st, 2, now=1001, monkeypatch=monkeypatch)
    c, _, _ = put(st, 3, now=1002, monkeypatch=monkeypatch)
    assert set(entry_files(d)) == {a + ".kv", b + ".kv", c + ".kv"}
    e, _, _ = put(st, 4, now=1003, monkeypatch=monkeypatch)
    assert set(entry_files(d)) == {b + ".kv", c + ".kv", e + ".kv"}        # the LRU one went
    assert f"evicted sha1={a}" in trace.read_text()
    # a restore makes b the most recently used: c goes next
    monkeypatch.setattr(time, "time", lambda: 1010.0)
    st.bump(b)
    assert kf.read_meta(str(d / f"{b}.kv")).header.hits == 1
    assert kf.read_meta(str(d / f"{b}.kv")).header.last_used == 1010
    f, _, _ = put(st, 5, now=1011, monkeypatch=monkeypatch)
    assert set(entry_files(d)) == {b + ".kv", e + ".kv", f + ".kv"}
    # the entry just written stays even when it is the least recently used one
    g, _, _ = put(st, 6, now=500, monkeypatch=monkeypatch)
    files = entry_files(d)
    assert g + ".kv" in files and len(files) == 3 and e + ".kv" not in files
    assert sum(files.values()) <= budget
    assert set(st.index) == {x[:-3] for x in files}
    # an entry that alone exceeds the budget is not written at all (it would be its own
    # victim); the others stay, and the trace says why
    monkeypatch.setattr(time, "time", lambda: 1100.0)
    save, body, _ = fake_slot(1300, 7)
    text = text_for(7, 1300)
    assert st.write(save, memoryview(body), text, {}) is None
    assert sha1(text) not in st.index and entry_files(d) == files
    assert f"not stored sha1={sha1(text)} (1300 tokens" in trace.read_text()


def test_store_eviction_ties_broken_by_creation_time(tmp_path, monkeypatch):
    """X created at 100 and restored at 200, Y created at 200: both last used at 200, X is the
    older one and must go first. The seeds make Y's name sort first, so that a tie broken by
    name alone picks Y."""
    seeds = sorted(range(10, 40), key=lambda i: sha1(text_for(i, 300)))
    y_seed, x_seed = seeds[0], seeds[-1]
    d = tmp_path / "kv"
    st = store(d, budget_mb=1)
    x, _, _ = put(st, x_seed, now=100, monkeypatch=monkeypatch)
    y, _, _ = put(st, y_seed, now=200, monkeypatch=monkeypatch)
    monkeypatch.setattr(time, "time", lambda: 200.0)
    st.bump(x)
    h = kf.read_meta(str(d / f"{x}.kv")).header
    assert (h.created, h.last_used) == (100, 200)
    put(st, 1, now=300, monkeypatch=monkeypatch)
    put(st, 2, now=301, monkeypatch=monkeypatch)          # four do not fit: one victim
    files = entry_files(d)
    assert len(files) == 3
    assert y + ".kv" in files and x + ".kv" not in files


def test_store_startup_scan(tmp_path, monkeypatch):
    d = tmp_path / "kv"
    trace = tmp_path / "trace"
    st = store(d)
    keep = [put(st, i, now=2000 + i, monkeypatch=monkeypatch)[0] for i in range(4)]
    # leftovers of a crash, foreign files, unsound entries
    (d / f"{keep[0]}.kv.tmp.12345").write_bytes(b"half a file")
    (d / "0123456789abcdef0123456789abcdef01234567.kv.tmp.9").write_bytes(b"")
    (d / "notes.txt").write_bytes(b"not a cache entry" * 100000)
    (d / ("A" * 40 + ".kv")).write_bytes((d / f"{keep[1]}.kv").read_bytes())     # upper-case: not a name
    wrong = "f" * 40
    (d / f"{wrong}.kv").write_bytes((d / f"{keep[2]}.kv").read_bytes())          # text is not "f"*40
    bad = "e" * 40
    blob = bytearray((d / f"{keep[3]}.kv").read_bytes())
    blob[0:3] = b"KVX"
    (d / f"{bad}.kv").write_bytes(bytes(blob))
    st2 = store(d, trace=Trace(str(trace), "persister"))
    assert set(st2.index) == set(keep)
    names = set(os.listdir(d))
    assert not any(".kv.tmp." in n for n in names)
    assert {"notes.txt", "A" * 40 + ".kv", f"{wrong}.kv", f"{bad}.kv"} <= names   # ignored, not deleted
    t = trace.read_text()
    assert f"rejected sha1={wrong} (reason: name mismatch)" in t
    assert f"rejected sha1={bad} (reason: bad magic)" in t
    # startup eviction: a smaller budget keeps the most recently used entries only
    size = st2.index[keep[0]].size
    st3 = store(d, budget_mb=1)
    assert 3 * size <= (1 << 20) < 4 * size
    assert set(st3.index) == set(keep[1:])
    assert set(entry_files(d)) >= {k + ".kv" for k in keep[1:]} and keep[0] + ".kv" not in entry_files(d)
    assert sum(st3.index[k].size for k in st3.index) <= 1 << 20


# ------------------------------------------------------------------ inference: Disk round trip

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
    from procs.inference.model import KVSession
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
    from procs.inference.model import KVSession
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
