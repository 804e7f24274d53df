"""Writing a `.kv` file: the parts in order, the checksum, the KTM section."""
from __future__ import annotations

import struct
import time

import numpy as np
import xxhash

from common.kvfile.layout import (FINGERPRINT_SIZE, FLAG_KTM, Geometry, Header, KTM_MAGIC, KTM_MAX_BLOCK, KTM_MAX_ID, KTM_VERSION, KV_BF16, KV_F32, KV_ITEMSIZE, PAYLOAD_HEAD_FMT, PAYLOAD_MAGIC, PAYLOAD_V2, PAYLOAD_V3, REASON_NAMES, STATE_HEAD_FMT, payload_size, payload_version)


def _require(ok, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _bytes_view(a: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def _kv_layers(x, g: Geometry, n: int, rows: tuple[int, ...], what: str):
    """Per-layer byte views of the rows a payload holds: layer l's last rows[l] positions.
    x is one array [layers, n, kv_heads, head_dim] (each layer's last rows taken from it), a
    sequence of per-layer arrays [rows[l], kv_heads, head_dim], or raw bytes of exactly
    those rows in payload order."""
    row = g.kv_heads * g.head_dim * KV_ITEMSIZE[g.kv_dtype]

    def check_dtype(a):
        ok = a.dtype == np.float32 if g.kv_dtype == KV_F32 else (
            a.dtype.itemsize == 2 and not (g.kv_dtype == KV_BF16 and a.dtype == np.float16))
        _require(ok, f"{what} dtype {a.dtype} does not match KV dtype {g.kv_dtype}")
    if isinstance(x, np.ndarray):
        want = (g.n_layers, n, g.kv_heads, g.head_dim)
        _require(x.shape == want, f"{what} shape {x.shape}, expected {want}")
        check_dtype(x)
        return [_bytes_view(x[i, n - r:]) for i, r in enumerate(rows)]
    if isinstance(x, (list, tuple)):
        _require(len(x) == g.n_layers, f"{what} has {len(x)} layers, not {g.n_layers}")
        for i, (a, r) in enumerate(zip(x, rows)):
            want = (r, g.kv_heads, g.head_dim)
            _require(isinstance(a, np.ndarray) and a.shape == want,
                     f"{what} layer {i} shape {getattr(a, 'shape', None)}, expected {want}")
            check_dtype(a)
        return [_bytes_view(a) for a in x]
    m = memoryview(x).cast("B")
    _require(len(m) == row * sum(rows), f"{what} has {len(m)} bytes, not {row * sum(rows)}")
    out, off = [], 0
    for r in rows:
        out.append(m[off:off + r * row])
        off += r * row
    return out


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
                ctx_size: int | None = None, now: int | None = None, state=None):
    """Validate everything now, then return an iterator over the file's bytes in order
    (header, text length + text, payload pieces, checksum, KTM) for streaming to a file.
    tokens: ints; logits: float32 [vocab]; k, v in the KV dtype (bf16 as uint16): arrays
    [layers, n, kv_heads, head_dim], per-layer arrays [geometry.rows(n)[l], kv_heads,
    head_dim], or raw bytes of the rows the payload holds. A geometry with windowed layers
    gives a version 2 payload (per layer its last rows only), one with linear-attention
    layers version 3, whose `state` (bytes: the layers' convolution inputs in the KV dtype,
    then their recurrent states in f32, geometry.state_bytes in all) follows the K/V rows;
    else version 1. ctx_size, when given, must equal geometry.ctx_size (the header and
    payload carry the same value)."""
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
    version, rows = payload_version(g), g.rows(n)
    _require(len(rows) == g.n_layers, f"{len(g.windows)} windows for {g.n_layers} layers")
    kl, vl = _kv_layers(k, g, n, rows, "k"), _kv_layers(v, g, n, rows, "v")
    _require(not (g.state_layers and g.windowed), "linear-attention and sliding-window layers together")
    st = memoryview(state if state is not None else b"").cast("B")
    _require(len(st) == g.state_bytes, f"state of {len(st)} bytes, the geometry says {g.state_bytes}")
    ktm_bytes = pack_ktm(ktm or {}, text)
    now = int(time.time()) if now is None else int(now)
    header = Header(n_tokens=n, payload_bytes=payload_size(n, g), ctx_size=g.ctx_size,
                    created=now, last_used=now, quant_bits=quant_bits, reason=reason,
                    flags=FLAG_KTM if ktm_bytes else 0)
    if g.windowed:   # field 5 is the largest window: readers bound the rows by it
        _require(g.sliding_window == max(g.windows),
                 f"sliding window {g.sliding_window}, the largest of the windows is {max(g.windows)}")
    head = struct.pack(PAYLOAD_HEAD_FMT, PAYLOAD_MAGIC, version, g.ctx_size, g.chunk_size,
                       g.kv_capacity, g.sliding_window, g.compressed_capacity, n, g.n_layers,
                       g.kv_heads, g.head_dim, g.vocab_size, g.kv_dtype)
    if version == PAYLOAD_V2:
        head += struct.pack(f"<{g.n_layers}I", *rows)
    if version == PAYLOAD_V3:
        head += struct.pack(STATE_HEAD_FMT, g.state_layers, g.conv_values, g.ssm_values)

    def gen():
        yield header.pack() + struct.pack("<I", len(text)) + text
        h = xxhash.xxh3_64()
        pieces = [head + bytes(fingerprint), _bytes_view(toks), _bytes_view(lg)]
        for a, b in zip(kl, vl):
            pieces += [a, b]
        if len(st):
            pieces.append(st)
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
