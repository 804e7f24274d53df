"""The conversations inference keeps resident: several KV sessions under a byte budget and a
count, least recently used first. Which one a job runs in is the renderer's plan (Job.session,
Job.source); which ones leave memory to make room is decided here, in LRU order, and a session
leaving memory is checkpointed first (evict) when no checkpoint holds it whole (Job.unsaved).

Invariants: the session a job runs in is never dropped while the job runs; a session's bytes
are its K/V capacity (KVSession.nbytes), so the budget bounds real memory; the one running
session may grow past the budget (a single conversation always gets the whole context), and
others leave memory once it has.
"""
from __future__ import annotations

import collections
from typing import Callable

import psutil
import torch

from common import messages as m
from procs.inference.kvsession import KVSession

# Without --kv-ram-space-mb: this share of the memory available when inference starts, the
# device's own on CUDA (that is where the sessions' K/V live; host RAM does not bound it).
RAM_SHARE = 0.25


def budget_bytes(mb: int, device: torch.device | str = "cpu") -> int:
    if mb > 0:
        return mb << 20
    if torch.device(device).type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0] * RAM_SHARE)
    return int(psutil.virtual_memory().available * RAM_SHARE)


class Sessions:
    def __init__(self, make: Callable[[], KVSession], budget: int, max_sessions: int):
        self.make, self.budget, self.max_sessions = make, budget, max(1, max_sessions)
        self.by_id: collections.OrderedDict[int, KVSession] = collections.OrderedDict()
        self.next_id = 1

    def __len__(self) -> int:
        return len(self.by_id)

    def get(self, sid: int) -> KVSession | None:
        return self.by_id.get(sid)

    def touch(self, sid: int) -> None:
        self.by_id.move_to_end(sid)

    def add(self) -> tuple[int, KVSession]:
        sid, self.next_id = self.next_id, self.next_id + 1
        sess = self.by_id[sid] = self.make()
        return sid, sess

    def drop(self, sid: int) -> None:
        self.by_id.pop(sid, None)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.by_id.values())

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.by_id.values())

    def victims(self, need: int, keep: set[int], new: bool) -> list[int]:
        """Sessions to drop, least recently used first, so that `need` more bytes fit the
        budget and (new: one more session fits the count); never one in keep."""
        out, total, count = [], self.nbytes + need, len(self.by_id) + int(new)
        for sid, sess in self.by_id.items():
            if total <= self.budget and count <= self.max_sessions:
                break
            if sid in keep:
                continue
            out.append(sid)
            total -= sess.nbytes
            count -= 1
        return out

    def room(self, need: int, keep: set[int], new: bool) -> tuple[list[int], bool]:
        """(victims, whether need more bytes and, if new, one more session then fit). With
        nothing kept the budget always counts as met: one conversation may fill the context."""
        victims = self.victims(need, keep, new)
        total = self.nbytes + need - sum(self.by_id[v].nbytes for v in victims)
        count_ok = len(self.by_id) + int(new) - len(victims) <= self.max_sessions
        return victims, count_ok and (total <= self.budget or not keep)

    def drop_empty(self, but=frozenset()) -> None:
        """Forget sessions holding no token (the first one, a failed job's), except those in
        `but` (the running jobs' sessions: a cold one is empty until its first chunk)."""
        for sid in [i for i, s in self.by_id.items() if not len(s) and i not in but]:
            del self.by_id[sid]

    def state(self) -> tuple[m.LiveSession, ...]:
        return tuple(m.LiveSession(sid=sid, tokens=tuple(s.tokens), keep_from=s.keep_from, answer_from=s.answer_from,
                                   marks=s.kept_marks)
                     for sid, s in self.by_id.items())
