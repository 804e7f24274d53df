"""The K/V pools the CUDA graphs run over (graphs.py): slots [layers, slots, KV heads,
capacity, D], and which session's rows each slot holds.

Invariants (graphs.py states them for the steps too):
- A session's own tensors stay the truth: a slot holds a copy of its rows, made only when
  the slot does not already hold them as they are now (same session, version, cuts and
  length), and after a step the rows it wrote are copied back (copy_back).
- Every row of a slot is finite: a copy-in zeroes the rows past the session's length and
  those below a restored windowed layer's floor (never written in the session's own tensor).
"""
from __future__ import annotations

import logging
import weakref

import torch

from common import metrics

log = logging.getLogger("inference")


class _Held:
    """What a slot holds: a session's rows as of (version, cuts, length)."""

    def __init__(self, sess, length: int):
        self.ref, self.version, self.cuts, self.length = weakref.ref(sess), sess.version, len(sess.cuts), length

    def holds(self, sess) -> bool:
        return (self.ref() is sess and self.version == sess.version and self.cuts == len(sess.cuts)
                and self.length == len(sess))


class Pool:
    """K/V slots [L, S, KV, C, D] and the session rows each holds."""

    def __init__(self, name: str):
        self.name = name
        self.k = self.v = None
        self.held: list[_Held | None] = []
        self.copies = 0                      # sessions copied into a slot

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None else 2 * self.k.numel() * self.k.element_size()

    def fits(self, S: int, C: int) -> bool:
        return self.k is not None and self.k.shape[1] >= S and self.k.shape[3] >= C

    def grow(self, model, S: int, C: int) -> None:
        """At least S slots of C rows (the caller drops the graphs on the old ones)."""
        c = model.cfg
        S = max(S, 0 if self.k is None else self.k.shape[1])
        C = max(C, 0 if self.k is None else self.k.shape[3])
        self.drop()
        shape = (c.n_layers, S, c.n_kv_heads, C, c.head_dim)
        self.k = torch.zeros(shape, dtype=model.dtype, device=model.device)
        self.v = torch.zeros(shape, dtype=model.dtype, device=model.device)
        self.held = [None] * S
        log.info("%s K/V pool: %d slots x %d rows, %.0f MiB", self.name, S, C, self.nbytes / 2**20)
        metrics.M.graph_pool_bytes.labels(self.name).set(self.nbytes)

    def drop(self) -> None:
        self.k = self.v = None
        self.held = []
        metrics.M.graph_pool_bytes.labels(self.name).set(0)

    def copy_back(self, sessions: list, order: list[int], spans: list[tuple[int, int]]) -> None:
        """The rows a step wrote, spans[b] = (lo, hi) of sessions[b] (in slot order[i] = b), back
        into the sessions' own tensors in one foreach copy; each slot then holds its session
        as of hi tokens (the caller appends them)."""
        dst, src = [], []
        for i, b in enumerate(order):
            s, (lo, hi) = sessions[b], spans[b]
            dst += [s.k[:, :, lo:hi], s.v[:, :, lo:hi]]
            src += [self.k[:, i, :, lo:hi], self.v[:, i, :, lo:hi]]
            self.held[i] = _Held(s, hi)
        torch._foreach_copy_(dst, src)

    def place(self, sessions: list) -> list[int]:
        """A slot in 0..B-1 for each session: the one that holds it already where there is
        one, else a free one, its rows copied in (and the rows past them zeroed)."""
        B = len(sessions)
        slot = [-1] * B
        free = set(range(B))
        for b, s in enumerate(sessions):
            for i in free:
                if self.held[i] is not None and self.held[i].holds(s):
                    slot[b] = i
                    free.discard(i)
                    break
        for b, s in enumerate(sessions):
            if slot[b] < 0:
                i = slot[b] = min(free)
                free.discard(i)
                n = len(s)
                for pool, own in ((self.k, s.k), (self.v, s.v)):
                    pool[:, i, :, :n] = own[:, :, :n]
                    pool[:, i, :, n:].zero_()
                    for li, floor in enumerate(s.floors):   # a restored windowed layer's
                        if floor:                            # rows below it are nobody's
                            pool[li, i, :, :floor].zero_()
                self.held[i] = _Held(s, n)
                self.copies += 1
                metrics.M.graph_pool_copies.labels(self.name).inc()
        return slot
