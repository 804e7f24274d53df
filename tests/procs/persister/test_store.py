"""The persister's Store without processes: atomic writes from a slot body, LRU eviction,
the startup scan, file and directory modes."""
from __future__ import annotations

import os
import stat
import time

import numpy as np
import pytest

from common import kvfile as kf
from common import messages as m
from common.trace import Trace
from tests.helpers import LOG, sha1


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
                            reason=reason, geometry=kf.Geometry(ctx_size=ctx, chunk_size=512, kv_capacity=ctx, **g),
                            quant_bits=4, fingerprint=FP, **extra)
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
