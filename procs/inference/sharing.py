"""Which sessions of a batch hold the same first rows, for the native decoder's batched step
(steps.decode_many): such rows are read once a step for every sequence that holds them."""
from __future__ import annotations

import collections
from typing import TYPE_CHECKING

import torch

from common.policy import common_prefix
from procs.inference.native import ATT_CHUNK

if TYPE_CHECKING:
    from procs.inference.kvsession import KVSession


def _equal_rows(a: KVSession, b: KVSession, n: int) -> int:
    """How many of the first n rows (whole ATT_CHUNKs) a and b hold bit for bit alike, K and
    V, every layer and head."""
    n = n // ATT_CHUNK * ATT_CHUNK
    if n == 0:
        return 0
    bits = torch.int16 if a.k.element_size() == 2 else torch.int32
    pairs = [(x[:, :, :n].view(bits), y[:, :, :n].view(bits)) for x, y in ((a.k, b.k), (a.v, b.v))]
    if all(torch.equal(x, y) for x, y in pairs):      # the usual case (copies): one pass
        return n
    differ = torch.zeros(n, dtype=torch.bool, device=a.k.device)
    for x, y in pairs:
        differ |= x.ne(y).any(-1).any(1).any(0)
    return int(differ.to(torch.int8).argmax()) // ATT_CHUNK * ATT_CHUNK


class Sharing:
    """Which sessions of a batch hold the same first rows (compared bit for bit once per pair
    of session versions, and again only after a cut below what was found), for
    Decoder.batch's share: such rows are read once a step for every sequence that holds
    them. Why it is exact: a shared chunk's attention partial is computed from the same bits
    as each sequence's own copy would give."""

    KEEP = 256                 # pairs remembered (most recently used): runs leave and rejoin the batch

    def __init__(self):
        # (version, version) -> (equal rows, how many cuts each session had then)
        self.equal: collections.OrderedDict[tuple[int, int], tuple[int, dict[int, int]]] = collections.OrderedDict()
        self.rows = 0          # rows read once for several sequences, every step so far

    def _rows(self, a: KVSession, b: KVSession) -> int:
        key = (min(a.version, b.version), max(a.version, b.version))
        got = self.equal.get(key)
        if got is not None and all(c >= got[0] for s in (a, b) for c in s.cuts[got[1][s.version]:]):
            self.equal.move_to_end(key)
            return got[0]
        common = common_prefix(a.tokens, b.tokens)
        n = _equal_rows(a, b, common) if common >= ATT_CHUNK else 0
        self.equal[key] = (n, {a.version: len(a.cuts), b.version: len(b.cuts)})
        if len(self.equal) > self.KEEP:
            self.equal.popitem(last=False)
        return n

    def plan(self, sessions: list[KVSession]) -> list[tuple[int, int]]:
        out = []
        for b, s in enumerate(sessions):
            best = (b, 0)
            for a, (lead, _) in enumerate(out):
                if lead == a:                         # leaders only: one level
                    n = self._rows(sessions[a], s)
                    if n > best[1]:
                        best = (a, n)
            out.append(best)
        self.rows += sum(n for _, n in out)
        return out
