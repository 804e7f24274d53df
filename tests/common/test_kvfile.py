import hashlib
import os
import shutil
import struct
import subprocess

import numpy as np
import pytest
import xxhash

from common import kvfile as kf
from common.kvfile import Geometry, KVFileError

FP = bytes(range(16))
TEXT = b"<|system|>You are a helpful assistant.<|user|>Ciao<|assistant|>Ciao!"
NOW = 1_700_000_000


def geom(kv_dtype=kf.KV_BF16, **kw):
    d = dict(ctx_size=4096, chunk_size=512, kv_capacity=4096, n_layers=3, kv_heads=2,
             head_dim=8, vocab_size=50, kv_dtype=kv_dtype)
    d.update(kw)
    return Geometry(**d)


def data(g, n, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 2**32 - 1, n, dtype=np.uint64).astype(np.uint32)
    logits = rng.standard_normal(g.vocab_size).astype(np.float32)
    shape = (g.n_layers, n, g.kv_heads, g.head_dim)
    if g.kv_dtype == kf.KV_F32:
        k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    else:
        k, v = (rng.integers(0, 2**16, shape, dtype=np.uint16) for _ in range(2))
    return tokens, logits, k, v


def make(g=None, n=7, text=TEXT, ktm=None, reason=kf.COLD, seed=0, **kw):
    g = g or geom()
    tokens, logits, k, v = data(g, n, seed)
    return kf.pack(text, tokens, logits, k, v, g, FP, 4, reason, ktm=ktm, now=NOW, **kw), \
        (tokens, logits, k, v)


def write(tmp_path, blob, name=None):
    p = tmp_path / (name or kf.entry_name(TEXT))
    p.write_bytes(blob)
    return p


@pytest.mark.parametrize("dt", [kf.KV_BF16, kf.KV_F32, kf.KV_F16])
def test_round_trip(tmp_path, dt):
    g = geom(dt)
    blob, (tokens, logits, k, v) = make(g, n=11)
    for src in (blob, write(tmp_path, blob)):
        e = kf.read(src, expect_geometry=g, expect_fingerprint=FP)
        assert e.text == TEXT and e.fingerprint == FP and e.geometry == g
        assert e.tokens.dtype == np.uint32 and np.array_equal(e.tokens, tokens)
        assert e.logits.dtype == np.float32 and np.array_equal(e.logits, logits)
        assert e.k.shape == k.shape == (3, 11, 2, 8)
        assert e.k.dtype == kf.KV_NUMPY[dt]
        assert np.array_equal(e.k.view(k.dtype), k) and np.array_equal(e.v.view(v.dtype), v)
        assert e.header.n_tokens == 11 and e.header.reason == kf.COLD and e.ktm == {}
        assert e.sha1 == hashlib.sha1(TEXT).hexdigest()
    assert len(blob) == kf.TEXT_OFFSET + len(TEXT) + kf.payload_size(11, g)


def test_raw_bytes_kv_and_streaming_equal_arrays():
    g = geom()
    tokens, logits, k, v = data(g, 5)
    a = kf.pack(TEXT, tokens, logits, k, v, g, FP, 4, kf.EVICT, now=NOW)
    parts = list(kf.write_parts(TEXT, list(map(int, tokens)), logits, k.tobytes(), v.tobytes(),
                                g, FP, 4, kf.EVICT, now=NOW))
    assert b"".join(parts) == a and len(parts) > 3


def test_zero_tokens_and_strided_input():
    g = geom(kf.KV_F32)
    tokens, logits, k, v = data(g, 6)
    kt = np.ascontiguousarray(k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)  # non-contiguous
    e = kf.read(kf.pack(TEXT, tokens, logits, kt, v, g, FP, 16, kf.SHUTDOWN, now=NOW))
    assert np.array_equal(e.k, k)
    e0 = kf.read(kf.pack(b"", [], logits, k[:, :0], v[:, :0], g, FP, 16, kf.SHUTDOWN, now=NOW))
    assert e0.text == b"" and e0.tokens.size == 0 and e0.k.shape == (3, 0, 2, 8)


def test_header_offsets():
    g = geom()
    blob, _ = make(g, n=9, reason=kf.CONTINUED)
    assert blob[0:3] == b"KVC" and blob[3] == 1 and blob[4] == 4 and blob[5] == 2
    assert blob[6] == 0 and blob[7] == 0 and blob[20:24] == bytes(4)
    assert struct.unpack_from("<I", blob, 8)[0] == 9
    assert struct.unpack_from("<I", blob, 12)[0] == 0
    assert struct.unpack_from("<I", blob, 16)[0] == 4096
    assert struct.unpack_from("<QQ", blob, 24) == (NOW, NOW)
    payload = struct.unpack_from("<Q", blob, 40)[0]
    assert payload == kf.payload_size(9, g)
    assert struct.unpack_from("<I", blob, 48)[0] == len(TEXT)
    assert blob[52:52 + len(TEXT)] == TEXT
    p0 = 52 + len(TEXT)
    assert blob[p0:p0 + 4] == b"DENS"
    assert struct.unpack_from("<12I", blob, p0 + 4) == (1, 4096, 512, 4096, 0, 0, 9, 3, 2, 8, 50, 1)
    assert blob[p0 + 52:p0 + 68] == FP
    assert len(blob) == p0 + payload
    assert struct.unpack_from("<Q", blob, len(blob) - 8)[0] == xxhash.xxh3_64_intdigest(blob[p0:-8])
    h = kf.parse_header(blob)
    assert kf.Header.unpack(h.pack()) == h and h.pack() == blob[:48]


def test_hexdump_shows_text(tmp_path):
    p = write(tmp_path, make()[0])
    if shutil.which("hexdump") is None:
        pytest.skip("no hexdump")
    out = subprocess.run(["hexdump", "-C", str(p)], capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()[:80]
    right = "".join(ln[ln.index("|") + 1:-1] for ln in lines if "|" in ln)
    assert right.startswith("KVC")
    assert "You are a helpful assistant." in right.replace("\n", "")
    assert lines[3].startswith("00000030") and "<|sy" in lines[3]   # text from byte 52


def test_checksum_mismatch(tmp_path):
    blob, _ = make()
    p0 = kf.TEXT_OFFSET + len(TEXT)
    for off in (p0 + 70, len(blob) - 20, len(blob) - 1):
        bad = bytearray(blob)
        bad[off] ^= 0x01
        with pytest.raises(KVFileError) as ei:
            kf.read(bytes(bad))
        assert ei.value.reason == "checksum mismatch"
        kf.read(bytes(bad), full=False)          # structure is fine without the checksum
        assert any("checksum" in s for s in kf.verify(write(tmp_path, bytes(bad))))


def reason_of(blob, **kw):
    with pytest.raises(KVFileError) as ei:
        kf.read(blob, **kw)
    return ei.value.reason


def test_distinct_reasons():
    g = geom()
    blob, _ = make(g)
    p0 = kf.TEXT_OFFSET + len(TEXT)
    patched = lambda off, b: blob[:off] + b + blob[off + len(b):]   # noqa: E731
    reasons = {
        "bad magic": reason_of(patched(0, b"KVX")),
        "wrong version": reason_of(patched(3, b"\x02")),
        "truncated": reason_of(blob[:-5]),
        "truncated header": reason_of(blob[:30]),
        "fingerprint": reason_of(blob, expect_fingerprint=bytes(16)),
        "geometry": reason_of(blob, expect_geometry=geom(head_dim=16)),
        "dtype": reason_of(blob, expect_geometry=geom(kf.KV_F32)),
        "context": reason_of(blob, expect_geometry=geom(ctx_size=2048, kv_capacity=2048)),
        "payload magic": reason_of(patched(p0, b"DSV4")),
        "payload version": reason_of(patched(p0 + 4, struct.pack("<I", 4))),
        "token count": reason_of(patched(8, struct.pack("<I", 8))),
        "payload size": reason_of(patched(40, struct.pack("<Q", kf.payload_size(7, g) - 2))),
        "trailing": reason_of(blob + b"x"),
        "header context": reason_of(patched(16, struct.pack("<I", 2048))),
        "kv dtype": reason_of(patched(p0 + 48, struct.pack("<I", 7))),
    }
    assert reasons["bad magic"] == "bad magic"
    assert reasons["wrong version"] == "wrong version"
    assert reasons["truncated"] == reasons["truncated header"] == "truncated"
    assert reasons["fingerprint"] == "fingerprint mismatch"
    assert reasons["geometry"] == reasons["dtype"] == "geometry mismatch"
    assert reasons["context"] == "context too large"
    del reasons["truncated header"], reasons["dtype"]
    assert len(set(reasons.values())) == len(reasons), reasons
    # a smaller context of the writer and another chunk size are fine
    kf.read(blob, expect_geometry=geom(ctx_size=8192, kv_capacity=8192, chunk_size=64))


def test_missing_and_empty_file(tmp_path):
    (tmp_path / "empty.kv").write_bytes(b"")
    with pytest.raises(KVFileError) as ei:
        kf.read(tmp_path / "empty.kv")
    assert ei.value.reason == "truncated"
    with pytest.raises(OSError):
        kf.read(tmp_path / "nope.kv")


def test_writer_validates():
    g = geom()
    tokens, logits, k, v = data(g, 4)
    args = lambda **o: {**dict(text=TEXT, tokens=tokens, logits=logits, k=k, v=v, geometry=g,  # noqa: E731
                                fingerprint=FP, quant_bits=4, reason=kf.COLD), **o}
    for bad in (dict(logits=logits[:-1]), dict(k=k[:, :3]), dict(v=v.astype(np.float32)),
                dict(k=k.tobytes()[:-2]), dict(fingerprint=b"x"), dict(reason=9),
                dict(ctx_size=100), dict(tokens=[-1, 0, 0, 0])):
        with pytest.raises(ValueError):
            kf.write_parts(**args(**bad))       # eager: raised before any byte is yielded
    kf.pack(**args(ctx_size=g.ctx_size))


def test_ktm_round_trip_and_filter(tmp_path):
    ktm = {"call_" + "a" * 32: b"Ciao!", "call_" + "b" * 32: b"not in the text",
           "call_" + "c" * 32: b"<|user|>", "": b"Ciao", "call_big": b""}
    blob, _ = make(ktm=ktm)
    assert blob[6] & 1
    e = kf.read(blob)
    assert e.ktm == {"call_" + "a" * 32: b"Ciao!", "call_" + "c" * 32: b"<|user|>"}
    p = write(tmp_path, blob)
    assert kf.read_ktm(p, 100000) == e.ktm
    assert kf.verify(p) == []
    none, _ = make(ktm={"call_x": b"absent"})
    assert none[6] == 0 and kf.read(none).ktm == {}
    assert kf.read_ktm(write(tmp_path, none, "x.kv"), 10) == {}


def ktm_entry(i: bytes, b: bytes, il=None, bl=None) -> bytes:
    return struct.pack("<II", len(i) if il is None else il, len(b) if bl is None else bl) + i + b


def with_ktm(section: bytes) -> bytes:
    blob, _ = make()
    return blob[:6] + b"\x01" + blob[7:] + section


@pytest.mark.parametrize("bad,last", [
    (ktm_entry(b"", b"Ciao"), False),                          # id length 0
    (ktm_entry(b"x" * 257, b"Ciao"), False),                   # id too long
    (ktm_entry(b"call_z", b"", bl=0), False),                  # block length 0
    (ktm_entry(b"call_z", b"", bl=(16 << 20) + 1), False),     # block too long
    (ktm_entry(b"call_z", b"Ci", bl=4), True),                 # truncated block
    (b"\x05\x00", True),                                       # truncated length fields
])
def test_ktm_reader_stops_at_first_malformed(tmp_path, bad, last):
    good = ktm_entry(b"call_1", b"Ciao") + ktm_entry(b"x" * 256, b"Ciao!")
    after = b"" if last else ktm_entry(b"call_3", b"<|user|>")
    blob = with_ktm(b"KTM\x01" + struct.pack("<I", 4) + good + bad + after)
    want = {"call_1": b"Ciao", "x" * 256: b"Ciao!"}
    assert kf.read(blob).ktm == want
    p = write(tmp_path, blob)
    assert kf.read_ktm(p, 100) == want
    assert any("KTM malformed" in s for s in kf.verify(p))


def test_ktm_count_limit(tmp_path):
    entries = b"".join(ktm_entry(b"call_%d" % i, b"Ciao") for i in range(9))
    p = write(tmp_path, with_ktm(b"KTM\x01" + struct.pack("<I", 9) + entries))
    assert len(kf.read_ktm(p, 3)) == 9           # 9 <= 12
    assert kf.read_ktm(p, 2) == {}               # 9 > 8: the section is ignored
    assert kf.read(p, ktm_max_ids=2).ktm == {}
    assert kf.read_ktm(write(tmp_path, with_ktm(b"KTX\x01" + bytes(4)), "y.kv"), 2) == {}


def test_bump_hits_changes_only_its_bytes(tmp_path):
    blob, _ = make()
    p = write(tmp_path, blob)
    assert kf.bump_hits(p, NOW + 100) == 1
    assert kf.bump_hits(p, NOW + 250) == 2
    after = p.read_bytes()
    assert len(after) == len(blob)
    diff = {i for i in range(len(blob)) if blob[i] != after[i]}
    assert diff and diff <= set(range(12, 16)) | set(range(32, 40))
    assert struct.unpack_from("<I", after, 12)[0] == 2
    assert struct.unpack_from("<Q", after, 32)[0] == NOW + 250
    assert struct.unpack_from("<Q", after, 24)[0] == NOW
    e = kf.read(p)                                # checksum does not cover the header
    assert e.header.hits == 2 and e.header.last_used == NOW + 250
    junk = write(tmp_path, b"not a kv file at all, but long enough for a header....", "j.kv")
    with pytest.raises(KVFileError):
        kf.bump_hits(junk, NOW)
    assert junk.read_bytes().startswith(b"not a kv")


def test_read_meta_and_text(tmp_path):
    g = geom()
    blob, _ = make(g, n=5)
    p = write(tmp_path, blob)
    m = kf.read_meta(p)
    assert m.header.n_tokens == 5 and m.text_len == len(TEXT) and m.size == len(blob)
    assert m.sha1 + ".kv" == p.name and m.geometry == g and m.fingerprint == FP
    assert kf.read_text(p) == TEXT
    with pytest.raises(KVFileError) as ei:
        kf.read_meta(write(tmp_path, blob[:-3], "t.kv"))
    assert ei.value.reason == "truncated"


def test_is_entry_name():
    good = hashlib.sha1(b"x").hexdigest() + ".kv"
    assert kf.is_entry_name(good) and kf.entry_name(b"x") == good
    for bad in (good.upper(), good[1:], "a" + good, good + ".tmp.123", good[:-3] + ".kvx",
                "g" * 40 + ".kv", good[:-3], "x/" + good):
        assert not kf.is_entry_name(bad), bad


def test_verify(tmp_path):
    blob, _ = make()
    assert kf.verify(write(tmp_path, blob)) == []
    assert "not an entry name" in kf.verify(write(tmp_path, blob, "other.kv"))
    wrong = write(tmp_path, blob, "0" * 40 + ".kv")
    assert any(s.startswith("name mismatch") for s in kf.verify(wrong))
    assert any(s.startswith("bad magic") for s in kf.verify(write(tmp_path, b"KVX" + blob[3:])))
    res = blob[:20] + b"\x01" + blob[21:]
    assert kf.verify(write(tmp_path, res)) == ["reserved bytes set"]
    stray = with_ktm(b"KTM\x01" + struct.pack("<I", 1) + ktm_entry(b"call_q", b"elsewhere"))
    assert kf.verify(write(tmp_path, stray)) == ["KTM block not in the text"]
    os.remove(tmp_path / kf.entry_name(TEXT))
    assert kf.verify(tmp_path / kf.entry_name(TEXT))[0].startswith("unreadable")


def test_a_flipped_fingerprint_byte_is_corruption_not_a_foreign_model():
    g = geom()
    blob, _ = make(g)
    p0 = kf.TEXT_OFFSET + len(TEXT)
    off = p0 + kf.PAYLOAD_HEAD_SIZE + 3
    flipped = blob[:off] + bytes([blob[off] ^ 0x80]) + blob[off + 1:]
    assert reason_of(flipped, expect_fingerprint=FP) == "checksum mismatch"
    assert reason_of(blob, expect_fingerprint=bytes(16)) == "fingerprint mismatch"
    # the same for a geometry field: a sound file of another geometry is "geometry mismatch"
    assert reason_of(blob, expect_geometry=geom(head_dim=16)) == "geometry mismatch"


# -- version 2: models with sliding-window layers (docs/kv-format.md section 4) ----------------

WINDOWS = (4, 0, 4)     # two windowed layers of 4 rows around a global one


def wgeom(kv_dtype=kf.KV_BF16, windows=WINDOWS, **kw):
    return geom(kv_dtype, windows=windows, sliding_window=max(windows), **kw)


def v1_payload(g, tokens, logits, k, v) -> bytes:
    """A version 1 payload built by hand from section 4 (what the writer wrote before v2)."""
    n = len(tokens)
    body = struct.pack("<4s12I", b"DENS", 1, g.ctx_size, g.chunk_size, g.kv_capacity, g.sliding_window,
                       g.compressed_capacity, n, g.n_layers, g.kv_heads, g.head_dim, g.vocab_size, g.kv_dtype)
    body += FP + np.asarray(tokens, "<u4").tobytes() + np.asarray(logits, "<f4").tobytes()
    for layer in range(g.n_layers):
        body += k[layer].tobytes() + v[layer].tobytes()
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


@pytest.mark.parametrize("dt", [kf.KV_BF16, kf.KV_F32])
def test_dense_payload_is_version_1_byte_for_byte(dt):
    g = geom(dt)
    assert not g.windowed and kf.payload_version(g) == 1
    blob, (tokens, logits, k, v) = make(g, n=9)
    assert blob[kf.TEXT_OFFSET + len(TEXT):] == v1_payload(g, tokens, logits, k, v)


@pytest.mark.parametrize("n", [0, 3, 4, 11])        # below, at and above the window of 4
def test_v2_round_trip(tmp_path, n):
    g = wgeom()
    rows = g.rows(n)
    assert rows == (min(n, 4), n, min(n, 4)) and kf.payload_version(g) == 2
    blob, (tokens, logits, k, v) = make(g, n=n)
    assert len(blob) == kf.TEXT_OFFSET + len(TEXT) + kf.payload_size(n, g)
    assert kf.payload_size(n, g) == kf.payload_size(n, g, rows)
    p0 = kf.TEXT_OFFSET + len(TEXT)
    assert struct.unpack_from("<4s12I", blob, p0)[:2] == (b"DENS", 2)
    assert struct.unpack_from("<I", blob, p0 + 20)[0] == 4                 # field 5: the largest window
    assert struct.unpack_from("<3I", blob, p0 + 52) == rows
    assert blob[p0 + 64:p0 + 80] == FP
    # layer by layer after tokens and logits: K then V, the layer's last rows in logical order
    off, expect = p0 + 80 + 4 * n + 4 * g.vocab_size, b""
    for layer, r in enumerate(rows):
        expect += k[layer, n - r:].tobytes() + v[layer, n - r:].tobytes()
    assert blob[off:off + len(expect)] == expect and off + len(expect) + 8 == len(blob)
    for src in (blob, write(tmp_path, blob)):
        e = kf.read(src, expect_geometry=g, expect_fingerprint=FP)
        assert e.rows == rows and e.geometry.sliding_window == 4 and e.geometry.windows == ()
        assert np.array_equal(e.tokens, tokens) and np.array_equal(e.logits, logits)
        for layer, r in enumerate(rows):
            assert e.k[layer].shape == (r, 2, 8)
            assert np.array_equal(e.k[layer], k[layer, n - r:]) and np.array_equal(e.v[layer], v[layer, n - r:])
    p = write(tmp_path, blob)
    assert kf.verify(p) == []
    meta = kf.read_meta(p)
    assert meta.rows == rows and meta.size == len(blob)
    # the same payload from per-layer arrays and from raw bytes of the held rows
    kl = [k[i, n - r:] for i, r in enumerate(rows)]
    vl = [v[i, n - r:] for i, r in enumerate(rows)]
    assert kf.pack(TEXT, tokens, logits, kl, vl, g, FP, 4, kf.COLD, now=NOW) == blob
    raw = lambda xs: b"".join(x.tobytes() for x in xs)   # noqa: E731
    assert kf.pack(TEXT, tokens, logits, raw(kl), raw(vl), g, FP, 4, kf.COLD, now=NOW) == blob


def test_v2_sizes_against_dense():
    g, d = wgeom(), geom()
    row = 2 * 2 * 8 * 2                  # K and V of one position in one layer, bf16
    for n in (1, 4, 1000):
        held = sum(g.rows(n))
        assert kf.payload_size(n, g) - kf.payload_size(n, d) == 12 + (held - 3 * n) * row


def test_v2_refusals(tmp_path):
    g = wgeom()
    blob, _ = make(g, n=11)
    p0 = kf.TEXT_OFFSET + len(TEXT)

    def repack(b):   # patched payload bytes with a valid checksum again
        b = bytearray(b)
        b[-8:] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(b[p0:-8])))
        return bytes(b)
    patched = lambda off, b: repack(blob[:off] + b + blob[off + len(b):])   # noqa: E731
    # another layout of windows with the same largest window: the rows disagree
    assert reason_of(blob, expect_geometry=wgeom(windows=(0, 4, 4))) == "layer rows mismatch"
    assert reason_of(blob, expect_geometry=wgeom(windows=(4, 0, 6))) == "geometry mismatch"
    assert reason_of(blob, expect_geometry=geom()) == "geometry mismatch"       # a dense model
    # rows no geometry can mean, rows that disagree with the size, and unknown versions
    assert reason_of(patched(p0 + 52, struct.pack("<I", 12))) == "bad layer rows"   # > 11 tokens
    assert reason_of(patched(p0 + 52, struct.pack("<I", 5))) == "bad layer rows"    # > field 5
    assert reason_of(patched(p0 + 52, struct.pack("<I", 3))) == "payload size mismatch"
    assert reason_of(patched(p0 + 20, struct.pack("<I", 0))) == "bad layer rows"    # v2 needs a window
    for ver in (0, 4, 0xFFFFFFFF):
        assert reason_of(patched(p0 + 4, struct.pack("<I", ver))) == "wrong payload version"
    # version 3 reads its state fields where version 2 has rows, and never with a window
    assert reason_of(patched(p0 + 4, struct.pack("<I", 3))) == "bad state fields"
    # a short payload table: the row table would run past the payload
    assert reason_of(patched(p0 + 32, struct.pack("<I", 10**6))) == "payload size mismatch"
    with pytest.raises(KVFileError) as ei:     # read_meta (the index) refuses the same way
        kf.read_meta(write(tmp_path, patched(p0 + 52, struct.pack("<I", 12))))
    assert ei.value.reason == "bad layer rows"


def test_v1_files_read_into_windowed_models_only_when_their_rows_agree():
    """A version 1 file holds all n rows; a windowed model takes it when that is what it
    needs (n <= every window) and the rest of the geometry agrees, never otherwise."""
    blob_small, _ = make(geom(sliding_window=4), n=3)
    e = kf.read(blob_small, expect_geometry=wgeom())
    assert e.rows == (3, 3, 3) and e.k.shape == (3, 3, 2, 8)       # version 1: one array
    blob_long, _ = make(geom(sliding_window=4), n=11)
    assert reason_of(blob_long, expect_geometry=wgeom()) == "layer rows mismatch"


def test_geometry_rows_and_messages():
    import msgspec
    g = wgeom()
    assert g.windowed and not geom().windowed and not geom(windows=(0, 0, 0)).windowed
    assert geom().rows(5) == (5, 5, 5) and g.rows(0) == (0, 0, 0) and g.rows(9) == (4, 9, 4)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(g), type=Geometry) == g
    with pytest.raises(ValueError):      # field 5 must be the largest window
        kf.pack(TEXT, *data(g, 2), geom(windows=WINDOWS, sliding_window=3), FP, 4, kf.COLD)
    assert kf.geometry_problem(g, 9, wgeom(windows=(4, 4, 4)))[0] == "geometry mismatch"
    assert kf.geometry_problem(g, 9, g) is None


def sgeom(**kw):
    """A model with linear-attention layers: 1 attention layer's K/V, 3 layers' states."""
    return geom(**{"n_layers": 1, "state_layers": 3, "conv_values": 12, "ssm_values": 10, **kw})


def states(g, seed=1):
    rng = np.random.default_rng(seed)
    conv = rng.integers(0, 2**16, (g.state_layers, g.conv_values), dtype=np.uint16)
    ssm = rng.standard_normal((g.state_layers, g.ssm_values)).astype(np.float32)
    return conv, ssm


@pytest.mark.parametrize("n", [1, 9])
def test_v3_round_trip(tmp_path, n):
    """Version 3: three u32 after the 13 fields (state layers, convolution and recurrent
    values per layer), the K/V rows of the attention layers, then the states (convolution
    inputs in the KV dtype, recurrent states in f32), then the checksum."""
    g = sgeom()
    assert kf.payload_version(g) == 3 and g.state_bytes == 3 * (12 * 2 + 10 * 4)
    conv, ssm = states(g)
    state = conv.tobytes() + ssm.tobytes()
    blob, (tokens, logits, k, v) = make(g, n=n, state=state)
    p0 = kf.TEXT_OFFSET + len(TEXT)
    assert len(blob) == p0 + kf.payload_size(n, g)
    assert kf.payload_size(n, g) == kf.payload_size(n, geom(n_layers=1)) + 12 + g.state_bytes
    assert struct.unpack_from("<4s12I", blob, p0)[:2] == (b"DENS", 3)
    assert struct.unpack_from("<3I", blob, p0 + 52) == (3, 12, 10)
    assert blob[-8 - len(state):-8] == state
    for src in (blob, write(tmp_path, blob)):
        e = kf.read(src, expect_geometry=g, expect_fingerprint=FP)
        assert np.array_equal(e.conv, conv) and np.array_equal(e.ssm, ssm)
        assert np.array_equal(e.k, k) and np.array_equal(e.tokens, tokens)
    assert kf.verify(write(tmp_path, blob)) == []
    assert kf.read_meta(write(tmp_path, blob)).geometry == g


def test_v3_refusals():
    g = sgeom()
    conv, ssm = states(g)
    blob, (tokens, logits, k, v) = make(g, n=5, state=conv.tobytes() + ssm.tobytes())
    assert reason_of(blob, expect_geometry=sgeom(ssm_values=11)) == "geometry mismatch"
    assert reason_of(blob, expect_geometry=geom(n_layers=1)) == "geometry mismatch"   # no states
    with pytest.raises(ValueError, match="state of"):
        kf.pack(TEXT, tokens, logits, k, v, g, FP, 4, kf.COLD, now=NOW, state=b"short")
    with pytest.raises(ValueError, match="state of"):        # a dense geometry takes no state
        kf.pack(TEXT, tokens, logits, k, v, geom(n_layers=1), FP, 4, kf.COLD, now=NOW, state=b"xx")
