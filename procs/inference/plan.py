"""What inference decides about a job before touching the model, as pure functions: how
much of the live session the renderer's plan may keep, and where the prompt's checkpoints
go. Worker.execute carries the decisions out (prefill, saves); unit tests call these."""
from __future__ import annotations

from common import kvfile
from common import messages as m
from common.policy import cold_position, continued_frontiers


def live_reuse(ids, planned: int, live: list[int], has_logits: bool, chunk: int,
               can_keep=lambda k: True) -> tuple[int, bool]:
    """(tokens of the live session to keep, whether the plan no longer held). The plan holds
    when the live session still starts with the prompt's first `planned` ids. A prompt that
    is cached whole but without its logits is re-run from the chunk boundary at or below its
    last token, so the chunk is the one a cold prefill ran and the logits (and a greedy
    answer) are the same as the first time. can_keep(k) (KVSession.can_keep): whether the
    session can be truncated to k; a prefix it cannot keep (a restored windowed checkpoint
    holds no rows a query there would see) is no plan either: nothing is kept."""
    r, stale = planned, False
    if r > len(live) or list(ids[:r]) != live[:r]:
        r, stale = 0, True
    if r >= len(ids) and (len(live) != len(ids) or not has_logits):
        r = (len(ids) - 1) // chunk * chunk
    r = min(r, len(ids))
    if r and not can_keep(r):
        r, stale = 0, True
    return r, stale


def prompt_saves(s, planned: tuple[m.SavePoint, ...], start: int, end: int, fell_back_cold: bool,
                 last_frontier: int) -> tuple[list[m.SavePoint], list[int]]:
    """(checkpoints to take inside the prompt span (start, end], continued frontiers in it).
    The renderer's save points hold unless its planned restore failed: then the prompt is a
    cold one and gets the cold save a cold prompt would."""
    saves = [p for p in planned if start < p.pos <= end]
    if fell_back_cold:
        pos = cold_position(end, 0, s.kv_cache_min_tokens, s.kv_cache_cold_max_tokens,
                            s.kv_cache_boundary_align_tokens, s.kv_cache_boundary_trim_tokens)
        saves = [m.SavePoint(pos=pos, reason=kvfile.COLD)] if pos else []
    frontiers = continued_frontiers(start, end, s.kv_cache_continued_interval_tokens,
                                    s.kv_cache_boundary_align_tokens, last_frontier)
    return saves, frontiers
