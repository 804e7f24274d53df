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
