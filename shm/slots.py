"""Shared-memory slots that carry a checkpoint from inference to the persister.

    slot file  /dev/shm/ricordo-<run-dir tag>-<i>, capacity = body_bytes(n_ctx) + SEQ_BYTES
    +--------------+------------------+---------------------------------+------------------
    | tokens u32[n]| logits f32[vocab]| layer 0: K[r0,KV,D] V[r0,KV,D]  | layer 1: K V | ...
    +--------------+------------------+---------------------------------+------------------
    bytes [0, body_bytes(n)) are exactly the .kv payload between the fingerprint and the
    checksum (docs/kv-format.md section 4), so the persister writes them out as they are.
    Layer l holds its last r_l = rows[l] positions (n - r_l .. n - 1): r_l = n for every
    layer of a dense model, min(n, W) for a sliding-window layer (common.geometry.rows). A
    model with linear-attention layers appends their states after the last layer's rows:
    convolution inputs in the KV dtype, then recurrent states in f32 (Geometry.state_bytes).

    FREE --inference copies rows, sends SaveCheckpoint--> BUSY --persister writes the file,
    sends SlotFreed--> FREE

    The last 8 bytes of a slot hold the sequence number of the save it carries: inference
    sets them to 0 before copying rows and to the save's seq after, and the persister
    checks them against the message before and after writing a file (before its rename),
    so a stale message (queued while the persister was down) never yields a torn file.

Who: inference creates the files at start (removing stale ones of its tag first), writes
only FREE slots, and unlinks them at exit. The persister maps a BUSY slot read-only and
never writes it. A persister that (re)starts says so, and inference frees every slot.
"""
from __future__ import annotations

import glob
import hashlib
import mmap
import os

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


def prefix(run_dir: str) -> str:
    return "ricordo-" + hashlib.sha1(os.path.realpath(run_dir).encode()).hexdigest()[:12]


def slot_path(run_dir: str, i: int) -> str:
    return os.path.join(SHM_DIR, f"{prefix(run_dir)}-{i}")


SEQ_BYTES = 8


def body_bytes(n: int, vocab: int, layers: int, kv_heads: int, head_dim: int, esize: int,
               rows: tuple[int, ...] | None = None, state: int = 0) -> int:
    """Bytes of a body of n tokens; rows: per layer (None: n for each of the layers); state:
    the recurrent states' bytes."""
    held = layers * n if rows is None else sum(rows)
    return 4 * n + 4 * vocab + 2 * held * kv_heads * head_dim * esize + state


def read_body(body, n: int, vocab: int, layers: int, kv_heads: int, head_dim: int, kv_numpy_dtype,
              rows: tuple[int, ...] | None = None, state: int = 0):
    """The reader's side of SlotPool.write: (logits f32[vocab], K, V) as numpy views of a body
    of exactly body_bytes(n, ..., rows, state) bytes (ValueError otherwise). K and V: one array
    [layers, n, KV, D] when rows is None, else lists of per-layer arrays [rows[l], KV, D]. The
    last `state` bytes (the recurrent states) are the caller's: body[len(body) - state:]."""
    import numpy as np
    esize = np.dtype(kv_numpy_dtype).itemsize
    want = body_bytes(n, vocab, layers, kv_heads, head_dim, esize, rows, state)
    if rows is not None and len(rows) != layers:
        raise ValueError(f"{len(rows)} row counts for {layers} layers")
    if len(body) != want:
        raise ValueError(f"slot holds {len(body)} bytes, expected {want}")
    logits = np.frombuffer(body[4 * n:4 * n + 4 * vocab], dtype="<f4")
    kv = np.frombuffer(body[4 * n + 4 * vocab:len(body) - state], dtype=kv_numpy_dtype)
    if rows is None:
        kv = kv.reshape(layers, 2, n, kv_heads, head_dim)
        return logits, kv[:, 0], kv[:, 1]
    k, v, off = [], [], 0
    for r in rows:
        for out in (k, v):
            out.append(kv[off:off + r * kv_heads * head_dim].reshape(r, kv_heads, head_dim))
            off += r * kv_heads * head_dim
    return logits, k, v


class SlotPool:
    """Inference side: the slots, which are busy, and copying a session's rows in."""

    def __init__(self, run_dir: str, count: int, capacity: int):
        for stale in glob.glob(os.path.join(SHM_DIR, prefix(run_dir) + "-*")):
            os.unlink(stale)
        self.paths, self.maps = [], []
        for i in range(count):
            path = slot_path(run_dir, i)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, capacity)   # tmpfs pages are only taken when written
                self.maps.append(mmap.mmap(fd, capacity))
            finally:
                os.close(fd)
            self.paths.append(path)
        self.busy: dict[int, int] = {}   # slot -> seq of the save it carries

    def free_slot(self) -> int | None:
        return next((i for i in range(len(self.paths)) if i not in self.busy), None)

    def write(self, i: int, tokens: list[int], logits, k, v,
              n: int, seq: int, rows: tuple[int, ...] | None = None, state=None) -> int:
        """Copy the rows a checkpoint of n tokens holds from K/V caches [layers, KV, ctx, D]
        into slot i, marked with seq (> 0); returns the body bytes. rows: per layer, how many
        of the positions before n (None: all n); layer l copies n - rows[l] .. n - 1. state:
        (convolution inputs, recurrent states) after token n (gdn.Recurrent's tensors), or None."""
        import torch   # here, not at import: the persister maps slots without torch
        assert i not in self.busy and seq > 0
        set_seq(self.maps[i], 0)
        L, KV, _, D = k.shape
        es = k.element_size()
        # the body must end before the sequence mark, or the mark would overwrite its last rows
        extra = 0 if state is None else sum(t.numel() * t.element_size() for t in state)
        need = body_bytes(n, logits.numel(), L, KV, D, es, rows, extra)
        if need > len(self.maps[i]) - SEQ_BYTES:
            raise ValueError(f"{need} body bytes do not fit a slot of {len(self.maps[i])} bytes")
        buf = torch.frombuffer(self.maps[i], dtype=torch.uint8)
        off = 0

        def view(nbytes: int, dtype, shape):
            nonlocal off
            t = buf[off:off + nbytes].view(dtype).view(shape)
            off += nbytes
            return t
        view(4 * n, torch.int32, (n,)).copy_(torch.tensor(tokens[:n], dtype=torch.int32))
        view(4 * logits.numel(), torch.float32, (logits.numel(),)).copy_(logits.float())
        for layer, r in enumerate((n,) * L if rows is None else rows):
            assert 0 <= r <= n
            view(r * KV * D * es, k.dtype, (r, KV, D)).copy_(k[layer, :, n - r:n].transpose(0, 1))
            view(r * KV * D * es, v.dtype, (r, KV, D)).copy_(v[layer, :, n - r:n].transpose(0, 1))
        for t in state or ():    # as bytes: the f32 states may follow 2-byte values unaligned
            nb = t.numel() * t.element_size()
            view(nb, torch.uint8, (nb,)).copy_(t.contiguous().view(torch.uint8).reshape(-1))
        set_seq(self.maps[i], seq)
        self.busy[i] = seq
        return off

    def release(self, i: int, seq: int) -> None:
        if self.busy.get(i) == seq:
            del self.busy[i]

    def close(self) -> None:
        for mm in self.maps:
            try:
                mm.close()
            except BufferError:
                pass
        for p in self.paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass


def set_seq(mm: mmap.mmap, seq: int) -> None:
    mm[len(mm) - SEQ_BYTES:] = seq.to_bytes(SEQ_BYTES, "little")


def get_seq(mm: mmap.mmap) -> int:
    return int.from_bytes(mm[len(mm) - SEQ_BYTES:], "little")


def read_slot(path: str, nbytes: int) -> tuple[mmap.mmap, memoryview]:
    """Persister side: map a busy slot read-only; the caller closes the map when done."""
    fd = os.open(path, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return mm, memoryview(mm)[:nbytes]
