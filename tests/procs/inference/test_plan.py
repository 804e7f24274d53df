"""Inference's decisions about a job, without a model: how much of the live session a plan
may keep, and which prompt checkpoints are taken."""
from __future__ import annotations

from common import kvfile
from common import messages as m
from common.config import Settings
from procs.inference.plan import live_reuse, prompt_saves

S = Settings(kv_cache_min_tokens=8, kv_cache_cold_max_tokens=30000, kv_cache_boundary_align_tokens=32,
             kv_cache_boundary_trim_tokens=4, kv_cache_continued_interval_tokens=64)


def test_live_reuse():
    ids = list(range(100))
    assert live_reuse(ids, 40, ids[:60], True, 16) == (40, False)
    assert live_reuse(ids, 40, ids[:30], True, 16) == (0, True)            # the live session is shorter
    assert live_reuse(ids, 40, [1] + ids[1:60], True, 16) == (0, True)     # or differs
    # the whole prompt cached: kept when its logits are there, else re-run from its last chunk
    assert live_reuse(ids, 100, ids, True, 16) == (100, False)
    assert live_reuse(ids, 100, ids, False, 16) == (96, False)
    assert live_reuse(ids, 100, ids + [5], True, 16) == (96, False)


def test_prompt_saves():
    planned = (m.SavePoint(pos=28, reason=kvfile.COLD), m.SavePoint(pos=200, reason=kvfile.CONTINUED))
    saves, frontiers = prompt_saves(S, planned, 10, 150, False, 0)
    assert saves == [planned[0]]                       # the one inside (10, 150]
    assert frontiers and all(10 < f <= 150 for f in frontiers)
    saves, _ = prompt_saves(S, planned, 0, 150, True, 0)   # the restore failed: a cold save instead
    assert [p.reason for p in saves] == [kvfile.COLD] and saves[0].pos == 124
    assert prompt_saves(S, planned, 0, 6, True, 0)[0] == []   # too short for one
