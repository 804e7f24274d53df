"""Resident sessions: a KV session grows as it fills (and its rows survive the growth), a new
session started from a copy of another's prefix goes on exactly as the original would, and
the pool picks least recently used sessions to leave memory within its byte budget and count."""
from __future__ import annotations

import torch

from procs.inference.kvsession import KVSession
from procs.inference.sessions import Sessions

CTX, CHUNK = 2048, 128


def ids(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 20000, (n,), generator=g).tolist()


def test_a_session_grows_by_whole_chunks_and_keeps_its_rows(model_f32):
    s = KVSession(model_f32, CTX, CHUNK)
    assert s.nbytes == 0                               # nothing allocated before the first token
    s.prefill(ids(100))
    assert s.k.shape[2] == CHUNK                       # one chunk
    k100 = s.k[:, :, :100].clone()
    s.prefill(ids(300, 1))                             # 400: past double -> 512 (whole chunks)
    assert s.k.shape[2] == 512 and torch.equal(s.k[:, :, :100], k100)
    whole = KVSession(model_f32, CTX, CHUNK)
    whole.reserve(CTX)                                 # allocated at once, as before
    whole.prefill(ids(100))
    whole.prefill(ids(300, 1))
    assert torch.equal(whole.logits, s.logits)         # growth changes no value
    assert s.nbytes == 2 * s.k.numel() * 4


def test_a_copied_prefix_goes_on_as_the_original(model_f32):
    a = KVSession(model_f32, CTX, CHUNK)
    a.prefill(ids(300))
    b = KVSession(model_f32, CTX, CHUNK)
    b.copy_prefix(a, 256)
    assert b.tokens == a.tokens[:256] and b.logits is None
    tail = ids(40, 2)
    b.prefill(tail)
    ref = KVSession(model_f32, CTX, CHUNK)
    ref.prefill(a.tokens[:256] + tail)
    assert torch.equal(b.logits, ref.logits)           # same rows, same chunk boundaries
    a.prefill(ids(10, 3))                              # the source goes on alone
    assert a.tokens[:256] == b.tokens[:256] and len(a) == 310


class Fake:
    def __init__(self, nbytes: int, n: int = 0):
        self.nbytes, self.tokens, self.keep_from = nbytes, [1] * n, 0

    def __len__(self):
        return len(self.tokens)


def test_victims_least_recently_used_first_within_budget_and_count():
    sizes = iter([100, 200, 300, 400])
    pool = Sessions(lambda: Fake(next(sizes)), budget=1000, max_sessions=3)
    for _ in range(3):
        pool.add()                                     # 1, 2, 3: 600 bytes
    assert pool.victims(0, set(), new=False) == []
    assert pool.victims(0, set(), new=True) == [1]     # a fourth exceeds the count
    pool.touch(1)                                      # order 2, 3, 1
    assert pool.victims(0, set(), new=True) == [2]
    assert pool.victims(500, set(), new=False) == [2]  # 1100 -> 900
    assert pool.victims(900, {2}, new=False) == [3, 1]  # 2 is kept: 3 and 1 go
    assert pool.victims(5000, set(), new=False) == [2, 3, 1]   # never fits: all go
    pool.drop(2)
    assert list(pool.by_id) == [3, 1] and pool.nbytes == 400
    sid, _ = pool.add()
    assert sid == 4                                    # ids are never reused


def test_room_says_whether_a_kept_session_is_in_the_way():
    sizes = iter([600, 300, 0])
    pool = Sessions(lambda: Fake(next(sizes), 1), budget=1000, max_sessions=2)
    pool.add()                                         # 1: 600 bytes
    pool.add()                                         # 2: 300 bytes
    assert pool.room(500, {1}, new=True) == ([2], False)   # 1 is kept: 1100 > 1000
    assert pool.room(500, set(), new=True) == ([1], True)         # 300 + 500 fits
    assert pool.room(5000, set(), new=True)[1]         # nothing kept: one conversation may fill it
    sid, s = pool.add()                                # an empty third
    s.tokens = []
    pool.drop_empty(but={sid})                         # a running job's cold session: kept
    assert list(pool.by_id) == [1, 2, sid]
    pool.drop_empty(but={1})
    assert list(pool.by_id) == [1, 2]
