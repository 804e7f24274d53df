"""Reading `.kv` files: whole (checked byte for byte), their metadata, text or KTM section
alone, and the two in-place header updates (hits, last used)."""
from __future__ import annotations

import hashlib
import mmap
import os
import struct
import time
from dataclasses import dataclass, field

import numpy as np
import xxhash

from common.kvfile.layout import (CHECKSUM_SIZE, FINGERPRINT_SIZE, FLAG_KTM, Geometry, HEADER_SIZE, Header, KTM_MAGIC, KTM_MAX_BLOCK, KTM_MAX_ID, KTM_VERSION, KVFileError, KV_ITEMSIZE, KV_NUMPY, OFF_HITS, OFF_LAST_USED, PAYLOAD_HEAD_FMT, PAYLOAD_HEAD_SIZE, PAYLOAD_MAGIC, PAYLOAD_V1, PAYLOAD_V2, PAYLOAD_V3, REASON_NAMES, STATE_HEAD_FMT, STATE_HEAD_SIZE, TEXT_OFFSET, geometry_problem, is_entry_name, parse_header, payload_size)


@dataclass
class Entry:
    header: Header
    geometry: Geometry
    fingerprint: bytes
    text: bytes
    tokens: np.ndarray          # uint32 [n]
    logits: np.ndarray          # float32 [vocab]
    # Indexed by layer: [rows[l], kv_heads, head_dim], the layer's last rows[l] positions.
    # Version 1: one array [layers, n, kv_heads, head_dim]; version 2: a list of per-layer
    # arrays. bf16 as uint16; views of the file's mmap (read-only, maybe unaligned).
    k: np.ndarray | list[np.ndarray]
    v: np.ndarray | list[np.ndarray]
    checksum: int
    ktm: dict[str, bytes] = field(default_factory=dict)
    rows: tuple[int, ...] = ()  # rows held per layer (version 1: n for every layer)
    # version 3: the linear-attention layers' states, views of the mmap: convolution inputs
    # [state layers, conv values] in the KV dtype and recurrent states [state layers, ssm
    # values] f32; None otherwise
    conv: np.ndarray | None = None
    ssm: np.ndarray | None = None

    @property
    def sha1(self) -> str:
        return hashlib.sha1(self.text).hexdigest()


def _buffer(path_or_bytes):
    if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
        return memoryview(path_or_bytes).cast("B")
    with open(path_or_bytes, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return memoryview(b"")
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))


def _frame(head, size: int):
    """(header, text length, payload offset) from the first 52 bytes and the file size."""
    h = parse_header(head[:HEADER_SIZE])
    if len(head) < TEXT_OFFSET:
        raise KVFileError("truncated", "no text length")
    (tl,) = struct.unpack_from("<I", head, HEADER_SIZE)
    p0 = TEXT_OFFSET + tl
    if h.payload_bytes < PAYLOAD_HEAD_SIZE + FINGERPRINT_SIZE + CHECKSUM_SIZE:
        raise KVFileError("payload size mismatch", f"header says {h.payload_bytes}")
    if size < p0 + h.payload_bytes:
        raise KVFileError("truncated", f"{size} bytes, need {p0 + h.payload_bytes}")
    return h, tl, p0


def _payload_head(h: Header, read) -> tuple[Geometry, tuple[int, ...] | None, bytes, int]:
    """(geometry, rows per layer (None: version 1, all n), fingerprint, offset of the token
    ids in the payload), checked against h. read(offset, size) gives payload bytes; _frame
    has checked that the header's payload byte count lies within the file, and nothing is
    read beyond it."""
    magic, ver, *f = struct.unpack_from(PAYLOAD_HEAD_FMT, read(0, PAYLOAD_HEAD_SIZE), 0)
    if magic != PAYLOAD_MAGIC:
        raise KVFileError("bad payload magic", repr(magic))
    if ver not in (PAYLOAD_V1, PAYLOAD_V2, PAYLOAD_V3):
        raise KVFileError("wrong payload version", f"payload version {ver}")
    ctx, chunk, cap, sw, comp, n, layers, heads, hd, vocab, dt = f
    if n != h.n_tokens:
        raise KVFileError("token count mismatch", f"header {h.n_tokens}, payload {n}")
    if ctx != h.ctx_size:
        raise KVFileError("context mismatch", f"header {h.ctx_size}, payload {ctx}")
    if dt not in KV_ITEMSIZE or n > ctx or n > cap:
        raise KVFileError("bad payload header", f"dtype {dt}, {n} tokens, ctx {ctx}, cap {cap}")
    state = (0, 0, 0)
    if ver == PAYLOAD_V3:
        state = struct.unpack_from(STATE_HEAD_FMT, read(PAYLOAD_HEAD_SIZE, STATE_HEAD_SIZE), 0)
        if not all(state) or sw:
            raise KVFileError("bad state fields", f"{state}, sliding window {sw}")
    g = Geometry(ctx_size=ctx, chunk_size=chunk, kv_capacity=cap, sliding_window=sw,
                 compressed_capacity=comp, n_layers=layers, kv_heads=heads, head_dim=hd,
                 vocab_size=vocab, kv_dtype=dt, state_layers=state[0], conv_values=state[1], ssm_values=state[2])
    off, rows = PAYLOAD_HEAD_SIZE + (STATE_HEAD_SIZE if ver == PAYLOAD_V3 else 0), None
    if ver == PAYLOAD_V2:
        if off + 4 * layers + FINGERPRINT_SIZE + CHECKSUM_SIZE > h.payload_bytes:
            raise KVFileError("payload size mismatch", f"header {h.payload_bytes}, {layers} layers")
        rows = struct.unpack_from(f"<{layers}I", read(off, 4 * layers), 0)
        off += 4 * layers
        # a layer holds all n rows, or (windowed) its last min(n, W) with 0 < W <= field 5
        bad = [r for r in rows if r > n or (r < n and not 0 < r <= sw)]
        if not sw or bad:
            raise KVFileError("bad layer rows", f"{n} tokens, sliding window {sw}, rows {bad or rows}")
    if payload_size(n, g, rows) != h.payload_bytes:
        raise KVFileError("payload size mismatch",
                          f"header {h.payload_bytes}, fields imply {payload_size(n, g, rows)}")
    fp = bytes(read(off, FINGERPRINT_SIZE))
    return g, rows, fp, off + FINGERPRINT_SIZE


def _ktm(buf, max_ids: int | None):
    """(entries, declared count, entries parsed, bytes consumed) of a KTM section."""
    if len(buf) < 8 or bytes(buf[:3]) != KTM_MAGIC or buf[3] != KTM_VERSION:
        return {}, 0, 0, 0
    (count,) = struct.unpack_from("<I", buf, 4)
    if max_ids is not None and count > 4 * max_ids:
        return {}, count, 0, 8
    out, off, done = {}, 8, 0
    while done < count and off + 8 <= len(buf):
        il, bl = struct.unpack_from("<II", buf, off)
        if not (0 < il <= KTM_MAX_ID and 0 < bl <= KTM_MAX_BLOCK) or off + 8 + il + bl > len(buf):
            break
        tid = bytes(buf[off + 8:off + 8 + il]).decode("utf-8", "replace")
        out[tid] = bytes(buf[off + 8 + il:off + 8 + il + bl])
        off, done = off + 8 + il + bl, done + 1
    return out, count, done, off


def parse_ktm(buf, max_ids: int | None = None) -> dict[str, bytes]:
    """Entries of a KTM section at the start of buf. Stops at the first malformed entry
    (id length 0 or > 256, block length 0 or > 16 MiB, truncation) keeping those before it;
    {} for a wrong magic/version or a count above 4 * max_ids."""
    return _ktm(buf, max_ids)[0]


def read(path_or_bytes, *, expect_geometry: Geometry | None = None,
         expect_fingerprint: bytes | None = None, full: bool = True,
         ktm_max_ids: int | None = None) -> Entry:
    """Read and check a whole file (a path is mmapped; arrays are zero-copy views of it).
    full=False skips only the checksum. Raises KVFileError with the first problem found."""
    buf = _buffer(path_or_bytes)
    h, _, p0 = _frame(buf[:TEXT_OFFSET], len(buf))
    end = p0 + h.payload_bytes
    g, rows, fp, off = _payload_head(h, lambda o, size: buf[p0 + o:p0 + o + size])
    (stored,) = struct.unpack_from("<Q", buf, end - CHECKSUM_SIZE)

    def checksum():
        if full:
            got = xxhash.xxh3_64_intdigest(buf[p0:end - CHECKSUM_SIZE])
            if got != stored:
                raise KVFileError("checksum mismatch", f"stored {stored:016x}, computed {got:016x}")

    # A geometry or fingerprint mismatch is a foreign model's file (kept) only if the payload
    # is sound: a flipped byte in those fields must read as corruption (deleted), or the same
    # broken file would be tried again on every request.
    problem = geometry_problem(g, h.n_tokens, expect_geometry, rows) if expect_geometry is not None else None
    if problem is None and expect_fingerprint is not None and bytes(expect_fingerprint) != fp:
        problem = ("fingerprint mismatch", f"{fp.hex()} != {bytes(expect_fingerprint).hex()}")
    if problem:
        checksum()
        raise KVFileError(*problem)
    if not h.flags & FLAG_KTM and len(buf) != end:
        raise KVFileError("trailing bytes", f"{len(buf) - end} bytes after the payload")
    checksum()
    n = h.n_tokens
    off += p0
    tokens = np.frombuffer(buf, dtype="<u4", count=n, offset=off)
    off += 4 * n
    logits = np.frombuffer(buf, dtype="<f4", count=g.vocab_size, offset=off)
    off += 4 * g.vocab_size
    dtype, row = KV_NUMPY[g.kv_dtype], g.kv_heads * g.head_dim
    if rows is not None:   # version 2: each layer its own row count
        k, v = [], []
        for r in rows:
            for out in (k, v):
                out.append(np.frombuffer(buf, dtype=dtype, count=r * row, offset=off)
                           .reshape(r, g.kv_heads, g.head_dim))
                off += r * row * np.dtype(dtype).itemsize
    else:
        kv = np.frombuffer(buf, dtype=dtype, count=g.n_layers * 2 * n * row, offset=off)
        kv = kv.reshape(g.n_layers, 2, n, g.kv_heads, g.head_dim)
        k, v = kv[:, 0], kv[:, 1]
        off += kv.nbytes
    conv = ssm = None
    if g.state_layers:
        conv = np.frombuffer(buf, dtype=dtype, count=g.state_layers * g.conv_values, offset=off)
        off += conv.nbytes
        ssm = np.frombuffer(buf, dtype="<f4", count=g.state_layers * g.ssm_values, offset=off)
        conv, ssm = conv.reshape(g.state_layers, -1), ssm.reshape(g.state_layers, -1)
    ktm = parse_ktm(buf[end:], ktm_max_ids) if h.flags & FLAG_KTM else {}
    text = bytes(buf[TEXT_OFFSET:p0])
    return Entry(h, g, fp, text, tokens, logits, k, v, stored, ktm, rows or (n,) * g.n_layers, conv, ssm)


@dataclass
class Meta:
    header: Header
    text_len: int
    sha1: str                   # of the text (equals the file name for a sound entry)
    size: int                   # file size in bytes
    geometry: Geometry
    fingerprint: bytes
    rows: tuple[int, ...]       # rows held per layer (version 1: the token count for each)


def _read_head(path, with_text: bool):
    """Header, text and payload head via two or three small preads; nothing else is read."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        h, tl, p0 = _frame(os.pread(fd, TEXT_OFFSET, 0), size)
        text = os.pread(fd, tl, TEXT_OFFSET) if with_text else b""
        g, rows, fp, _ = _payload_head(h, lambda o, n: os.pread(fd, n, p0 + o))
    finally:
        os.close(fd)
    return h, tl, text, size, g, fp, rows or (h.n_tokens,) * g.n_layers


def read_meta(path) -> Meta:
    """Header, text length, SHA1 of the text, file size, geometry and fingerprint, reading only
    the first bytes of the file (for the startup index). Does not verify the checksum."""
    h, tl, text, size, g, fp, rows = _read_head(path, True)
    return Meta(h, tl, hashlib.sha1(text).hexdigest(), size, g, fp, rows)


def read_text(path) -> bytes:
    return _read_head(path, True)[2]


def read_ktm(path, max_ids: int | None = None) -> dict[str, bytes]:
    """Only the KTM section ({} when the flag is clear). Raises KVFileError for a file whose
    header, text length or payload head is unsound."""
    h, tl, _, size, *_ = _read_head(path, False)
    if not h.flags & FLAG_KTM:
        return {}
    end = TEXT_OFFSET + tl + h.payload_bytes
    with open(path, "rb") as f:
        f.seek(end)
        return parse_ktm(f.read(size - end), max_ids)


def bump_hits(path, now: int | None = None) -> int:
    """A restore: hit count +1 (offset 12, saturating) and last-used = now (offset 32), written
    in place with pwrite after checking the header; nothing else is touched. Returns the hits."""
    now = int(time.time()) if now is None else int(now)
    fd = os.open(path, os.O_RDWR)
    try:
        h = parse_header(os.pread(fd, HEADER_SIZE, 0))
        hits = min(h.hits + 1, 0xFFFFFFFF)
        os.pwrite(fd, struct.pack("<I", hits), OFF_HITS)
        os.pwrite(fd, struct.pack("<Q", now), OFF_LAST_USED)
    finally:
        os.close(fd)
    return hits


def verify(path) -> list[str]:
    """Every problem found in one file ([] = sound): the name, everything read() checks
    including the checksum, reserved bytes and flags, timestamps, and a strict KTM check."""
    problems = []
    name = os.path.basename(os.fspath(path))
    if not is_entry_name(name):
        problems.append("not an entry name")
    try:
        buf = _buffer(path)
        e = read(buf, full=True)
    except KVFileError as x:
        return problems + [str(x)]
    except OSError as x:
        return problems + [f"unreadable: {x}"]
    raw, tail = bytes(buf[:HEADER_SIZE]), buf[TEXT_OFFSET + len(e.text) + e.header.payload_bytes:]
    h, text = e.header, e.text
    checks = [(is_entry_name(name) and e.sha1 + ".kv" != name, f"name mismatch: text is {e.sha1}"),
              (raw[7] or raw[20:24] != bytes(4), "reserved bytes set"),
              (h.flags & ~FLAG_KTM, f"unknown flags {h.flags:#x}"),
              (h.reason not in REASON_NAMES, f"unknown reason {h.reason}"),
              (h.last_used < h.created, "last-used before creation"),
              (e.geometry.compressed_capacity, "compressed capacity set in a dense payload")]
    if h.flags & FLAG_KTM:
        entries, count, done, used = _ktm(tail, None)
        checks += [(used == 0, "KTM flag set but no KTM section"),
                   (used and done != count, f"KTM malformed at entry {done} of {count}"),
                   (done == count and 0 < used != len(tail), "bytes after the KTM section"),
                   (any(b not in text for b in entries.values()), "KTM block not in the text")]
    return problems + [message for bad, message in checks if bad]
