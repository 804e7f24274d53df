"""The renderer's view of the disk cache: the persister's index, the longest-prefix lookup,
and the save plan of a request (docs/kv-format.md sections 6 and 7).

Lookup costs one SHA1 pass over the prompt bytes: the running hash is copied at each text
length that some entry has, and the copy's digest is looked up by name.
"""
from __future__ import annotations

import hashlib

from common import kvfile
from common import messages as m
from common.policy import cold_position, prefix_position, should_evict_save


class DiskIndex:
    def __init__(self, s, trace):
        self.s, self.trace = s, trace
        self.entries: dict[str, m.IndexEntry] = {}
        self.version = -1

    def update(self, snap: m.IndexSnapshot) -> None:
        self.entries = {e.sha1: e for e in snap.entries}
        self.version = snap.version

    def candidates(self, n_ctx: int, quant_bits: int) -> list[m.IndexEntry]:
        s = self.s
        return [e for e in self.entries.values()
                if e.n_tokens >= s.kv_cache_min_tokens and e.ctx_size <= n_ctx
                and not (s.kv_cache_reject_different_quant and quant_bits and e.quant_bits != quant_bits)]

    def on_disk(self, text: bytes, n_tokens: int) -> bool:
        e = self.entries.get(hashlib.sha1(text).hexdigest())
        return e is not None and e.n_tokens == n_tokens

    def lookup(self, prompt: bytes, n_ctx: int, quant_bits: int, why: bool = True) -> tuple[m.IndexEntry | None, str]:
        """The entry with the longest text that is a byte prefix of prompt (ties: more tokens).
        why=False: no miss reason (with --trace that reason reads candidate files)."""
        cands = self.candidates(n_ctx, quant_bits)
        if not cands:
            return None, "no checkpoints" if not self.entries else "no usable checkpoints"
        by_len: dict[int, dict[str, m.IndexEntry]] = {}
        for e in cands:
            if e.text_len <= len(prompt):
                by_len.setdefault(e.text_len, {})[e.sha1] = e
        h, pos, best = hashlib.sha1(), 0, None
        for length in sorted(by_len):
            h.update(prompt[pos:length])
            pos = length
            hit = by_len[length].get(h.copy().hexdigest())
            if hit is not None and (best is None or hit.n_tokens > best.n_tokens or hit.text_len > best.text_len):
                best = hit
        if best is not None:
            return best, ""
        return None, self._miss_reason(prompt, cands) if self.trace and why else "prefix mismatch"

    def _miss_reason(self, prompt: bytes, cands) -> str:
        """Only with --trace: read candidate texts to say where the best one stopped matching."""
        best = -1
        for e in cands:
            try:
                text = kvfile.read_text(kvfile.entry_path(self.s.kv_disk_dir, e.sha1))
            except (OSError, kvfile.KVFileError):
                continue
            k = 0
            n = min(len(text), len(prompt))
            while k < n and text[k] == prompt[k]:
                k += 1
            best = max(best, k)
        return f"prefix mismatch at byte {best}" if best >= 0 else "no readable checkpoints"


def prefix_end_tokens(text_model, ids: list[int], prefix_bytes: int) -> int:
    """How many of ids cover exactly prefix_bytes of the prompt (0 if no token ends there)."""
    if not ids:
        return 0
    ends = text_model.byte_ends(ids)
    i = int(ends.searchsorted(prefix_bytes))        # the first token ending at or past it
    return i + 1 if i < len(ends) and ends[i] == prefix_bytes else 0


def save_plan(s, n_prompt: int, reused: int, prefix_end: int) -> tuple[m.SavePoint, ...]:
    pts = set()
    pos = cold_position(n_prompt, reused, s.kv_cache_min_tokens, s.kv_cache_cold_max_tokens,
                        s.kv_cache_boundary_align_tokens, s.kv_cache_boundary_trim_tokens)
    if pos:
        pts.add(pos)
    if prefix_end:
        pos = prefix_position(prefix_end, n_prompt, reused, s.kv_cache_min_tokens, s.kv_cache_cold_max_tokens)
        if pos:
            pts.add(pos)
    return tuple(m.SavePoint(pos=p, reason=kvfile.COLD) for p in sorted(pts))


def evict_needed(s, index: DiskIndex, text_model, live: list[int], keep: int) -> bool:
    if not s.kv_disk_dir or not live:
        return False
    lost_enough = len(live) - keep >= max(s.kv_cache_min_tokens, 1)
    if not lost_enough:
        return False
    return should_evict_save(len(live), keep, s.kv_cache_min_tokens,
                             index.on_disk(text_model.piece_bytes(live), len(live)))
