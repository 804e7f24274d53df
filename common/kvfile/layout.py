"""The `.kv` layout: header, offsets, payload head, names, and the geometry check; what
both the writer and the readers take (docs/kv-format.md)."""
from __future__ import annotations

import hashlib
import os
import re
import struct
from dataclasses import astuple, dataclass

import numpy as np

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

PAYLOAD_MAGIC = b"DENS"
# version 1: every layer holds every row; version 2 (models with sliding-window layers): a
# u32 per layer after the 13 fields says how many rows that layer holds (section 4)
# version 3 (models with linear-attention layers): 3 u32 after the 13 fields (state layers,
# convolution values and recurrent-state values per layer), and those states after the K/V rows
PAYLOAD_V1, PAYLOAD_V2, PAYLOAD_V3 = 1, 2, 3
PAYLOAD_HEAD_FMT = "<4s12I"                 # 13 u32, the first read as 4 ASCII bytes
PAYLOAD_HEAD_SIZE = 52
STATE_HEAD_FMT, STATE_HEAD_SIZE = "<3I", 12
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


def payload_version(g: Geometry) -> int:
    """The payload version a checkpoint of geometry g is written in: 2 only with windowed
    layers, 3 only with linear-attention layers, so dense models keep writing version 1 byte
    for byte."""
    return PAYLOAD_V3 if g.state_layers else PAYLOAD_V2 if g.windowed else PAYLOAD_V1


def payload_size(n_tokens: int, g: Geometry, rows: tuple[int, ...] | None = None) -> int:
    """Exact payload byte count of a checkpoint of n_tokens with geometry g. rows: the rows
    per layer of a version 2 payload (default: g.rows(n_tokens) when g is windowed, else a
    version 1 payload)."""
    if rows is None and g.windowed:
        rows = g.rows(n_tokens)
    table = 0 if rows is None else 4 * len(rows)
    held = g.n_layers * n_tokens if rows is None else sum(rows)
    kv = 2 * held * g.kv_heads * g.head_dim * KV_ITEMSIZE[g.kv_dtype]
    state = STATE_HEAD_SIZE + g.state_bytes if g.state_layers else 0
    return (PAYLOAD_HEAD_SIZE + table + state + FINGERPRINT_SIZE + 4 * n_tokens + 4 * g.vocab_size + kv
            + CHECKSUM_SIZE)


def entry_name(text: bytes) -> str:
    return hashlib.sha1(text).hexdigest() + SUFFIX


def entry_path(directory: str, sha1: str) -> str:
    """Where the checkpoint whose cache text has this SHA1 lives: the one spelling of it."""
    return os.path.join(directory, sha1 + SUFFIX)


def is_entry_name(name: str) -> bool:
    """Exactly 40 lower-case hex digits + ".kv" (a bare name, not a path)."""
    return _ENTRY_RE.fullmatch(name) is not None


def geometry_problem(stored: Geometry, n_tokens: int, expected: Geometry,
                     rows: tuple[int, ...] | None = None) -> tuple[str, str] | None:
    """Why a checkpoint cannot be restored into a session of `expected` geometry, or None.
    Layers, heads, head dim, vocab, KV dtype, sliding window and compressed capacity must be
    equal, and the windows too where stored has them (a file stores rows, not windows); the
    rows each layer holds (rows, else stored.rows(n_tokens)) must be what expected implies for
    n_tokens; the writer's context must not exceed ours (section 7) and the rows must fit our
    capacity. Prefill chunk size and the writer's own capacity do not matter."""
    for f in ("n_layers", "kv_heads", "head_dim", "vocab_size", "kv_dtype", "sliding_window",
              "compressed_capacity", "state_layers", "conv_values", "ssm_values"):
        a, b = getattr(stored, f), getattr(expected, f)
        if a != b:
            return "geometry mismatch", f"{f} {a} != {b}"
    if stored.windows and stored.windows != expected.windows:
        return "geometry mismatch", f"windows {stored.windows} != {expected.windows}"
    held, want = tuple(stored.rows(n_tokens) if rows is None else rows), expected.rows(n_tokens)
    if held != want:
        i = next(i for i, (a, b) in enumerate(zip(held, want)) if a != b)
        return "layer rows mismatch", f"layer {i} holds {held[i]} rows, {n_tokens} tokens need {want[i]}"
    if stored.ctx_size > expected.ctx_size or n_tokens > expected.kv_capacity:
        return "context too large", (f"written with context {stored.ctx_size}, {n_tokens} tokens;"
                                     f" ours {expected.ctx_size}, capacity {expected.kv_capacity}")
    return None
