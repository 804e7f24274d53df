"""Prompt lookup decoding: where its drafts come from (procs/inference/lookup.py), and that
checking a draft in one step changes nothing a lone decode would compute: the native
decoder's rows for consecutive positions of one session, in one batched step, are the rows
and logits of decoding them one by one, bit for bit, in both compute dtypes."""
from __future__ import annotations

import pytest
import torch

from procs.inference.kvsession import KVSession
from procs.inference.lookup import Lookup


@pytest.fixture(scope="module")
def long_ids(vectors):
    """The reference texts' ids (llama.cpp's vectors), repeated to 320."""
    ids = [t for case in vectors["cases"] for t in case["token_ids"]]
    return (ids * (320 // len(ids) + 1))[:320]


def test_a_draft_is_what_followed_the_last_ids_where_they_occurred_last():
    ids = [1, 2, 3, 4, 5, 9, 1, 2, 3, 6, 7, 0, 1]
    lk = Lookup()
    assert lk.draft(ids, 2, 4) == []                         # (0, 1, 2) never occurred before
    ids.append(2)                                            # ... 1 2 3: last seen before 6 7
    assert lk.draft(ids, 3, 4) == [6, 7, 0, 1] and lk.draft(ids, 3, 1) == [6]
    ids.append(3)
    assert lk.draft(ids, 6, 8) == [7, 0, 1, 2, 3, 6]         # up to the tail, never past it
    assert lk.draft(ids, 6, 0) == []
    short, ids = Lookup(), [5]
    assert short.draft(ids, 5, 3) == []
    ids.append(5)                                            # (5, 5, 5): the tail itself is no occurrence
    assert short.draft(ids, 5, 3) == []
    ids.append(5)
    assert short.draft(ids, 5, 3) == [5]
    assert Lookup().draft([1, 2, 3, 1, 2], 3, 2) == [1, 2]   # a fresh index sees the whole list


def test_one_step_over_consecutive_positions_equals_lone_decodes(model, long_ids):
    assert model.decoder is not None
    ids, new = long_ids[:300], long_ids[300:309]
    lone = KVSession(model, 512, 512)
    lone.prefill(ids)
    want = [lone.decode(t).clone() for t in new]
    one = KVSession(model, 512, 512)
    one.prefill(ids)
    n = len(ids)
    one.reserve(n + len(new))
    rows = model.decode_batch(new, list(range(n, n + len(new))), [(one.k, one.v)] * len(new))
    for a, b in zip(rows, want):
        assert torch.equal(a, b)
    m = n + len(new)
    assert torch.equal(one.k[:, :, :m], lone.k[:, :, :m]) and torch.equal(one.v[:, :, :m], lone.v[:, :, :m])
