"""The shared-memory slot layout without processes: what SlotPool.write puts in a slot is
what read_body and read_slot give back (tokens, logits, K and V rows in the .kv payload's
order), the sequence mark, slot reuse, and cleanup of stale and own files."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from shm import slots

L, KV, CTX, D, VOCAB = 3, 2, 16, 4, 10


@pytest.fixture
def pool(tmp_path):
    p = slots.SlotPool(str(tmp_path), count=2, capacity=slots.body_bytes(CTX, VOCAB, L, KV, D, 2) + slots.SEQ_BYTES)
    yield p
    p.close()


def test_write_then_read_gives_the_rows_back(pool, tmp_path):
    torch.manual_seed(0)
    k = torch.randn(L, KV, CTX, D).to(torch.bfloat16)
    v = torch.randn(L, KV, CTX, D).to(torch.bfloat16)
    logits = torch.randn(VOCAB)
    n = 7
    tokens = list(range(100, 100 + CTX))
    i = pool.free_slot()
    nbytes = pool.write(i, tokens, logits, k, v, n=n, seq=42)
    assert nbytes == slots.body_bytes(n, VOCAB, L, KV, D, 2)
    assert pool.free_slot() == 1 - i                 # the written one is busy until released

    mm, body = slots.read_slot(slots.slot_path(str(tmp_path), i), nbytes)
    try:
        assert slots.get_seq(mm) == 42
        assert list(np.frombuffer(body[:4 * n], dtype="<i4")) == tokens[:n]
        got_logits, got_k, got_v = slots.read_body(body, n, VOCAB, L, KV, D, np.uint16)
        assert np.array_equal(got_logits, logits.numpy())
        want_k = k[:, :, :n].transpose(1, 2).contiguous().view(torch.uint16).numpy()
        want_v = v[:, :, :n].transpose(1, 2).contiguous().view(torch.uint16).numpy()
        assert np.array_equal(got_k, want_k) and np.array_equal(got_v, want_v)
        with pytest.raises(ValueError):
            slots.read_body(body[:-1], n, VOCAB, L, KV, D, np.uint16)
        del body, got_logits, got_k, got_v
    finally:
        mm.close()
    pool.release(i, seq=41)                          # a stale hand-back frees nothing
    assert i in pool.busy
    pool.release(i, seq=42)
    assert i not in pool.busy


def test_stale_files_go_at_start_and_own_files_at_close(tmp_path):
    stale = slots.slot_path(str(tmp_path), 7)
    open(stale, "wb").close()
    p = slots.SlotPool(str(tmp_path), count=1, capacity=64)
    assert not os.path.exists(stale) and os.path.exists(p.paths[0])
    p.close()
    assert not os.path.exists(p.paths[0])


@pytest.mark.parametrize("n", [3, 7, CTX])          # below, above the window of 5, the whole context
def test_windowed_rows_round_trip(tmp_path, n):
    """A sliding-window layer carries only its last min(n, W) rows; the body is exactly what
    the .kv version 2 payload holds between fingerprint and checksum."""
    from common.kvfile import KV_BF16, Geometry, pack, read
    g = Geometry(ctx_size=CTX, chunk_size=4, kv_capacity=CTX, n_layers=L, kv_heads=KV, head_dim=D,
                 vocab_size=VOCAB, kv_dtype=KV_BF16, windows=(5, 0, 5), sliding_window=5)
    rows = g.rows(n)
    cap = slots.body_bytes(CTX, VOCAB, L, KV, D, 2, g.rows(CTX)) + slots.SEQ_BYTES
    assert cap < slots.body_bytes(CTX, VOCAB, L, KV, D, 2) + slots.SEQ_BYTES
    p = slots.SlotPool(str(tmp_path), count=1, capacity=cap)
    torch.manual_seed(1)
    k = torch.randn(L, KV, CTX, D).to(torch.bfloat16)
    v = torch.randn(L, KV, CTX, D).to(torch.bfloat16)
    logits = torch.randn(VOCAB)
    tokens = list(range(200, 200 + CTX))
    try:
        nbytes = p.write(0, tokens, logits, k, v, n=n, seq=5, rows=rows)
        assert nbytes == slots.body_bytes(n, VOCAB, L, KV, D, 2, rows)
        mm, body = slots.read_slot(p.paths[0], nbytes)
        try:
            assert slots.get_seq(mm) == 5
            got_logits, got_k, got_v = slots.read_body(body, n, VOCAB, L, KV, D, np.uint16, rows)
            for layer, r in enumerate(rows):
                want_k = k[layer, :, n - r:n].transpose(0, 1).contiguous().view(torch.uint16).numpy()
                want_v = v[layer, :, n - r:n].transpose(0, 1).contiguous().view(torch.uint16).numpy()
                assert np.array_equal(got_k[layer], want_k) and np.array_equal(got_v[layer], want_v)
            # the body is the payload between fingerprint and checksum, byte for byte
            blob = pack(b"t", tokens[:n], got_logits, got_k, got_v, g, bytes(16), 16, 1, now=1)
            e = read(blob, expect_geometry=g)
            assert e.rows == rows
            start = len(blob) - 8 - nbytes
            assert blob[start:-8] == bytes(body)
            with pytest.raises(ValueError):
                slots.read_body(body, n, VOCAB, L, KV, D, np.uint16, rows[:2])
            del body, got_logits, got_k, got_v, e
        finally:
            mm.close()
    finally:
        p.close()


def test_a_body_never_reaches_the_sequence_mark(tmp_path):
    """A slot sized without the mark's 8 bytes must refuse a full-context body rather than
    let the mark overwrite its last rows."""
    p = slots.SlotPool(str(tmp_path), count=1, capacity=slots.body_bytes(CTX, VOCAB, L, KV, D, 2))
    k = torch.zeros(L, KV, CTX, D, dtype=torch.bfloat16)
    try:
        with pytest.raises(ValueError):
            p.write(0, list(range(CTX)), torch.zeros(VOCAB), k, k, n=CTX, seq=1)
        assert p.write(0, list(range(CTX)), torch.zeros(VOCAB), k, k, n=CTX - 2, seq=1) > 0
    finally:
        p.close()
