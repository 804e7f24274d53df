"""The `.kv` checkpoint file (docs/kv-format.md): 48-byte header, u32 text length + cache text,
the DENS payload (13 u32, fingerprint, token ids, logits, per layer K rows then V rows, xxh3-64
of the preceding payload bytes), then an optional KTM section. All integers little-endian.
The header's payload byte count is exact; only hits (offset 12) and last-used (offset 32) ever
change after the rename. Readers never trust a size without checking it against the file size;
every rejection is a KVFileError whose `reason` is a short fixed string."""
from __future__ import annotations

import hashlib
import mmap
import os
import re
import struct
import time
from dataclasses import astuple, dataclass, field

import numpy as np
import xxhash

from common import geometry

MAGIC, VERSION = b"KVC", 1
HEADER_SIZE = 48
HEADER_FMT = "<3sBBBBxIII4xQQQ"            # 4x = reserved bytes 20..23, x = reserved byte 7
OFF_VERSION, OFF_QUANT, OFF_REASON, OFF_FLAGS = 3, 4, 5, 6
OFF_TOKENS, OFF_HITS, OFF_CTX = 8, 12, 16
OFF_CREATED, OFF_LAST_USED, OFF_PAYLOAD_BYTES = 24, 32, 40
TEXT_OFFSET = HEADER_SIZE + 4               # the text bytes start at 52
FLAG_KTM = 1

REASON_UNKNOWN, COLD, CONTINUED, EVICT, SHUTDOWN = 0, 1, 2, 3, 4
REASON_NAMES = {0: "unknown", 1: "cold", 2: "continued", 3: "evict", 4: "shutdown"}

PAYLOAD_MAGIC, PAYLOAD_VERSION = b"DENS", 1
PAYLOAD_HEAD_FMT = "<4s12I"                 # 13 u32, the first read as 4 ASCII bytes
PAYLOAD_HEAD_SIZE = 52
FINGERPRINT_SIZE = 16
CHECKSUM_SIZE = 8

KV_F32, KV_BF16, KV_F16 = 0, 1, 2
KV_ITEMSIZE = {KV_F32: 4, KV_BF16: 2, KV_F16: 2}
KV_NUMPY = {KV_F32: np.float32, KV_BF16: np.uint16, KV_F16: np.float16}   # what read() returns

KTM_MAGIC, KTM_VERSION = b"KTM", 1
KTM_MAX_ID, KTM_MAX_BLOCK = 256, 16 << 20

SUFFIX = ".kv"
_ENTRY_RE = re.compile(r"[0-9a-f]{40}\.kv")


class KVFileError(ValueError):
    """A file that must not be used. `reason` is one of a few fixed strings ("bad magic",
    "wrong version", "truncated", "checksum mismatch", ...); `detail` is for people."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


Geometry = geometry.Geometry   # re-exported: the format's readers and writers take it from here


@dataclass
class Header:
    """The 48 bytes of section 2, in file order (reserved bytes are written as 0, not kept)."""
    magic: bytes = MAGIC
    version: int = VERSION
    quant_bits: int = 0
    reason: int = REASON_UNKNOWN
    flags: int = 0
    n_tokens: int = 0
    hits: int = 0
    ctx_size: int = 0
    created: int = 0
    last_used: int = 0
    payload_bytes: int = 0

    def pack(self) -> bytes:
        return struct.pack(HEADER_FMT, *astuple(self))

    @classmethod
    def unpack(cls, buf) -> "Header":
        """Decode 48 bytes without judging them (see parse_header)."""
        return cls(*struct.unpack_from(HEADER_FMT, buf, 0))


def parse_header(buf) -> Header:
    """The header at the start of buf; raises "bad magic", "truncated" or "wrong version"."""
    if len(buf) >= 3 and bytes(buf[:3]) != MAGIC:
        raise KVFileError("bad magic", repr(bytes(buf[:3])))
    if len(buf) < HEADER_SIZE:
        raise KVFileError("truncated", f"{len(buf)} bytes, no full header")
    h = Header.unpack(buf)
    if h.version != VERSION:
        raise KVFileError("wrong version", f"format version {h.version}")
    return h


def payload_size(n_tokens: int, g: Geometry) -> int:
    """Exact payload byte count of a checkpoint of n_tokens with geometry g."""
    kv = 2 * g.n_layers * n_tokens * g.kv_heads * g.head_dim * KV_ITEMSIZE[g.kv_dtype]
    return PAYLOAD_HEAD_SIZE + FINGERPRINT_SIZE + 4 * n_tokens + 4 * g.vocab_size + kv + CHECKSUM_SIZE


def entry_name(text: bytes) -> str:
    return hashlib.sha1(text).hexdigest() + SUFFIX


def entry_path(directory: str, sha1: str) -> str:
    """Where the checkpoint whose cache text has this SHA1 lives: the one spelling of it."""
    return os.path.join(directory, sha1 + SUFFIX)


def is_entry_name(name: str) -> bool:
    """Exactly 40 lower-case hex digits + ".kv" (a bare name, not a path)."""
    return _ENTRY_RE.fullmatch(name) is not None


def geometry_problem(stored: Geometry, n_tokens: int, expected: Geometry) -> tuple[str, str] | None:
    """Why a checkpoint cannot be restored into a session of `expected` geometry, or None.
    Layers, heads, head dim, vocab, KV dtype, sliding window and compressed capacity must be
    equal; the writer's context must not exceed ours (section 7) and the rows must fit our
    capacity. Prefill chunk size and the writer's own capacity do not matter."""
    for f in ("n_layers", "kv_heads", "head_dim", "vocab_size", "kv_dtype", "sliding_window",
              "compressed_capacity"):
        a, b = getattr(stored, f), getattr(expected, f)
        if a != b:
            return "geometry mismatch", f"{f} {a} != {b}"
    if stored.ctx_size > expected.ctx_size or n_tokens > expected.kv_capacity:
        return "context too large", (f"written with context {stored.ctx_size}, {n_tokens} tokens;"
                                     f" ours {expected.ctx_size}, capacity {expected.kv_capacity}")
    return None


# ---------------------------------------------------------------- writing

def _require(ok, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _bytes_view(a: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def _kv_layers(x, g: Geometry, n: int, what: str):
    """Per-layer byte views of x ([layers, n, kv_heads, head_dim], array or raw bytes)."""
    per = n * g.kv_heads * g.head_dim * KV_ITEMSIZE[g.kv_dtype]
    if isinstance(x, np.ndarray):
        want = (g.n_layers, n, g.kv_heads, g.head_dim)
        _require(x.shape == want, f"{what} shape {x.shape}, expected {want}")
        ok = x.dtype == np.float32 if g.kv_dtype == KV_F32 else (
            x.dtype.itemsize == 2 and not (g.kv_dtype == KV_BF16 and x.dtype == np.float16))
        _require(ok, f"{what} dtype {x.dtype} does not match KV dtype {g.kv_dtype}")
        return [_bytes_view(x[i]) for i in range(g.n_layers)]
    m = memoryview(x).cast("B")
    _require(len(m) == per * g.n_layers, f"{what} has {len(m)} bytes, not {per * g.n_layers}")
    return [m[i * per:(i + 1) * per] for i in range(g.n_layers)]


def pack_ktm(ktm: dict[str, bytes], text: bytes) -> bytes:
    """The KTM section for the entries whose block occurs verbatim in text (b"" when none).
    Entries a reader would reject (empty or oversized id or block) are left out too."""
    items = []
    for tid, block in ktm.items():
        i = tid.encode() if isinstance(tid, str) else bytes(tid)
        b = block.encode() if isinstance(block, str) else bytes(block)
        if 0 < len(i) <= KTM_MAX_ID and 0 < len(b) <= KTM_MAX_BLOCK and b in text:
            items.append(struct.pack("<II", len(i), len(b)) + i + b)
    if not items:
        return b""
    return KTM_MAGIC + bytes([KTM_VERSION]) + struct.pack("<I", len(items)) + b"".join(items)


def write_parts(text: bytes, tokens, logits, k, v, geometry: Geometry, fingerprint: bytes,
                quant_bits: int, reason: int, ktm: dict[str, bytes] | None = None,
                ctx_size: int | None = None, now: int | None = None):
    """Validate everything now, then return an iterator over the file's bytes in order
    (header, text length + text, payload pieces, checksum, KTM) for streaming to a file.
    tokens: ints; logits: float32 [vocab]; k, v: arrays or raw bytes [layers, n, kv_heads,
    head_dim] in the KV dtype (bf16 as uint16). ctx_size, when given, must equal
    geometry.ctx_size (the header and payload carry the same value)."""
    g, text = geometry, bytes(text)
    _require(g.kv_dtype in KV_ITEMSIZE, f"unknown KV dtype {g.kv_dtype}")
    _require(ctx_size in (None, g.ctx_size), f"ctx_size {ctx_size} != geometry {g.ctx_size}")
    _require(reason in REASON_NAMES, f"unknown reason {reason}")
    _require(0 <= quant_bits <= 255, f"quant bits {quant_bits}")
    _require(len(fingerprint) == FINGERPRINT_SIZE, "fingerprint must be 16 bytes")
    toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
    _require(not toks.size or 0 <= toks.min() <= toks.max() <= 0xFFFFFFFF, "token id not u32")
    toks, n = toks.astype("<u4"), int(toks.size)
    _require(n <= min(g.ctx_size, g.kv_capacity), f"{n} tokens exceed context or capacity")
    lg = np.ascontiguousarray(np.asarray(logits).astype("<f4", copy=False).reshape(-1))
    _require(lg.size == g.vocab_size, f"logits have {lg.size} values, vocab is {g.vocab_size}")
    kl, vl = _kv_layers(k, g, n, "k"), _kv_layers(v, g, n, "v")
    ktm_bytes = pack_ktm(ktm or {}, text)
    now = int(time.time()) if now is None else int(now)
    header = Header(n_tokens=n, payload_bytes=payload_size(n, g), ctx_size=g.ctx_size,
                    created=now, last_used=now, quant_bits=quant_bits, reason=reason,
                    flags=FLAG_KTM if ktm_bytes else 0)
    head = struct.pack(PAYLOAD_HEAD_FMT, PAYLOAD_MAGIC, PAYLOAD_VERSION, g.ctx_size, g.chunk_size,
                       g.kv_capacity, g.sliding_window, g.compressed_capacity, n, g.n_layers,
                       g.kv_heads, g.head_dim, g.vocab_size, g.kv_dtype)

    def gen():
        yield header.pack() + struct.pack("<I", len(text)) + text
        h = xxhash.xxh3_64()
        pieces = [head + bytes(fingerprint), _bytes_view(toks), _bytes_view(lg)]
        for a, b in zip(kl, vl):
            pieces += [a, b]
        for p in pieces:
            h.update(p)
            yield p
        yield struct.pack("<Q", h.intdigest())
        if ktm_bytes:
            yield ktm_bytes
    return gen()


def pack(*args, **kw) -> bytes:
    """The whole file as one bytes object (tests, small files); same arguments as write_parts."""
    return b"".join(write_parts(*args, **kw))


# ---------------------------------------------------------------- reading

@dataclass
class Entry:
    header: Header
    geometry: Geometry
    fingerprint: bytes
    text: bytes
    tokens: np.ndarray          # uint32 [n]
    logits: np.ndarray          # float32 [vocab]
    k: np.ndarray               # [layers, n, kv_heads, head_dim]; bf16 as uint16; may be read-only
    v: np.ndarray               # views of the file's mmap (not contiguous, maybe unaligned)
    checksum: int
    ktm: dict[str, bytes] = field(default_factory=dict)

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


def _payload_head(h: Header, ph) -> tuple[Geometry, bytes]:
    """Geometry and fingerprint from the payload's first 68 bytes, checked against h."""
    magic, ver, *f = struct.unpack_from(PAYLOAD_HEAD_FMT, ph, 0)
    if magic != PAYLOAD_MAGIC:
        raise KVFileError("bad payload magic", repr(magic))
    if ver != PAYLOAD_VERSION:
        raise KVFileError("wrong payload version", f"payload version {ver}")
    ctx, chunk, cap, sw, comp, n, layers, heads, hd, vocab, dt = f
    if n != h.n_tokens:
        raise KVFileError("token count mismatch", f"header {h.n_tokens}, payload {n}")
    if ctx != h.ctx_size:
        raise KVFileError("context mismatch", f"header {h.ctx_size}, payload {ctx}")
    if dt not in KV_ITEMSIZE or n > ctx or n > cap:
        raise KVFileError("bad payload header", f"dtype {dt}, {n} tokens, ctx {ctx}, cap {cap}")
    g = Geometry(ctx_size=ctx, chunk_size=chunk, kv_capacity=cap, sliding_window=sw,
                 compressed_capacity=comp, n_layers=layers, kv_heads=heads, head_dim=hd,
                 vocab_size=vocab, kv_dtype=dt)
    if payload_size(n, g) != h.payload_bytes:
        raise KVFileError("payload size mismatch",
                          f"header {h.payload_bytes}, fields imply {payload_size(n, g)}")
    return g, bytes(ph[PAYLOAD_HEAD_SIZE:PAYLOAD_HEAD_SIZE + FINGERPRINT_SIZE])


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
    g, fp = _payload_head(h, buf[p0:p0 + PAYLOAD_HEAD_SIZE + FINGERPRINT_SIZE])
    end = p0 + h.payload_bytes
    (stored,) = struct.unpack_from("<Q", buf, end - CHECKSUM_SIZE)

    def checksum():
        if full:
            got = xxhash.xxh3_64_intdigest(buf[p0:end - CHECKSUM_SIZE])
            if got != stored:
                raise KVFileError("checksum mismatch", f"stored {stored:016x}, computed {got:016x}")

    # A geometry or fingerprint mismatch is a foreign model's file (kept) only if the payload
    # is sound: a flipped byte in those fields must read as corruption (deleted), or the same
    # broken file would be tried again on every request.
    problem = geometry_problem(g, h.n_tokens, expect_geometry) if expect_geometry is not None else None
    if problem is None and expect_fingerprint is not None and bytes(expect_fingerprint) != fp:
        problem = ("fingerprint mismatch", f"{fp.hex()} != {bytes(expect_fingerprint).hex()}")
    if problem:
        checksum()
        raise KVFileError(*problem)
    if not h.flags & FLAG_KTM and len(buf) != end:
        raise KVFileError("trailing bytes", f"{len(buf) - end} bytes after the payload")
    checksum()
    n = h.n_tokens
    off = p0 + PAYLOAD_HEAD_SIZE + FINGERPRINT_SIZE
    tokens = np.frombuffer(buf, dtype="<u4", count=n, offset=off)
    off += 4 * n
    logits = np.frombuffer(buf, dtype="<f4", count=g.vocab_size, offset=off)
    off += 4 * g.vocab_size
    rows = g.n_layers * 2 * n * g.kv_heads * g.head_dim
    kv = np.frombuffer(buf, dtype=KV_NUMPY[g.kv_dtype], count=rows, offset=off)
    kv = kv.reshape(g.n_layers, 2, n, g.kv_heads, g.head_dim)
    ktm = parse_ktm(buf[end:], ktm_max_ids) if h.flags & FLAG_KTM else {}
    text = bytes(buf[TEXT_OFFSET:p0])
    return Entry(h, g, fp, text, tokens, logits, kv[:, 0], kv[:, 1], stored, ktm)


@dataclass
class Meta:
    header: Header
    text_len: int
    sha1: str                   # of the text (equals the file name for a sound entry)
    size: int                   # file size in bytes
    geometry: Geometry
    fingerprint: bytes


def _read_head(path, with_text: bool):
    """Header, text and payload head via two or three small preads; nothing else is read."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        h, tl, p0 = _frame(os.pread(fd, TEXT_OFFSET, 0), size)
        text = os.pread(fd, tl, TEXT_OFFSET) if with_text else b""
        g, fp = _payload_head(h, os.pread(fd, PAYLOAD_HEAD_SIZE + FINGERPRINT_SIZE, p0))
    finally:
        os.close(fd)
    return h, tl, text, size, g, fp


def read_meta(path) -> Meta:
    """Header, text length, SHA1 of the text, file size, geometry and fingerprint, reading only
    the first bytes of the file (for the startup index). Does not verify the checksum."""
    h, tl, text, size, g, fp = _read_head(path, True)
    return Meta(h, tl, hashlib.sha1(text).hexdigest(), size, g, fp)


def read_text(path) -> bytes:
    return _read_head(path, True)[2]


def read_ktm(path, max_ids: int | None = None) -> dict[str, bytes]:
    """Only the KTM section ({} when the flag is clear). Raises KVFileError for a file whose
    header, text length or payload head is unsound."""
    h, tl, _, size, _, _ = _read_head(path, False)
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
