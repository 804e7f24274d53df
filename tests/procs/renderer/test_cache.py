"""The renderer's side of the disk cache without processes: the index lookup (longest byte
prefix, the filters, the miss reasons), the save plan and the eviction-save test."""
from __future__ import annotations

import numpy as np

from common import kvfile as kf
from common import messages as m
from common.config import Settings
from common.trace import Trace
from tests.helpers import sha1


# ------------------------------------------------------------------ renderer: DiskIndex.lookup

PROMPT = (b"<|im_start|>system\nYou answer questions about a bakery.<|im_end|>\n"
          b"<|im_start|>user\nWhat bread do you bake on Sundays?<|im_end|>\n<|im_start|>assistant\n")


def entry(text: bytes, n_tokens: int, *, quant_bits=4, ctx_size=8192, size=1000, last_used=0):
    return m.IndexEntry(sha1=sha1(text), text_len=len(text), n_tokens=n_tokens, quant_bits=quant_bits,
                        ctx_size=ctx_size, size=size, last_used=last_used)


def index(*entries, **settings):
    from procs.renderer.cache import DiskIndex
    s = Settings(kv_disk_dir="/nonexistent", kv_cache_min_tokens=8, **settings)
    ix = DiskIndex(s, Trace("", "renderer"))
    ix.update(m.IndexSnapshot(entries=tuple(entries), version=3))
    return ix


def test_lookup_longest_byte_prefix_wins():
    short, mid, longest = PROMPT[:20], PROMPT[:70], PROMPT[:len(PROMPT) - 5]
    other = b"X" + PROMPT[1:90]                       # same length class, different bytes
    beyond = PROMPT + b"Fresh rye."                   # longer than the prompt
    ix = index(entry(short, 10), entry(mid, 30), entry(other, 40), entry(longest, 50), entry(beyond, 60))
    assert ix.version == 3
    hit, why = ix.lookup(PROMPT, 8192, 4)
    assert hit is not None and hit.sha1 == sha1(longest) and why == ""
    # without the longest, the next longer prefix; the non-prefix never
    ix = index(entry(short, 10), entry(mid, 30), entry(other, 40))
    assert ix.lookup(PROMPT, 8192, 4)[0].sha1 == sha1(mid)
    # the whole prompt is a prefix of itself
    ix = index(entry(mid, 30), entry(PROMPT, 70))
    assert ix.lookup(PROMPT, 8192, 4)[0].sha1 == sha1(PROMPT)
    # an entry that is not a byte prefix is a miss (no trace: a short reason)
    ix = index(entry(other, 40), entry(beyond, 60))
    hit, why = ix.lookup(PROMPT, 8192, 4)
    assert hit is None and why.startswith("prefix mismatch")
    assert index().lookup(PROMPT, 8192, 4) == (None, "no checkpoints")


def test_lookup_bytes_not_characters():
    text = "Caffè latte e cornetto, per favore.".encode()
    cut = text.index("è".encode()) + 1               # in the middle of a UTF-8 character
    ix = index(entry(text[:cut], 9))
    assert ix.lookup(text, 8192, 4)[0].sha1 == sha1(text[:cut])


def test_lookup_ignores_small_larger_ctx_and_other_quant_with_flag():
    small, big_ctx, q8, good = PROMPT[:80], PROMPT[:90], PROMPT[:100], PROMPT[:40]
    entries = (entry(small, 7),                          # below min tokens (8)
               entry(big_ctx, 40, ctx_size=16384),       # written with a larger context
               entry(q8, 45, quant_bits=8),              # another quantization
               entry(good, 8))                           # exactly min tokens: a candidate
    ix = index(*entries)
    # by default another quantization of the same geometry is reusable
    assert ix.lookup(PROMPT, 8192, 4)[0].sha1 == sha1(q8)
    assert {e.sha1 for e in ix.candidates(8192, 4)} == {sha1(q8), sha1(good)}
    # a larger current context accepts the larger-context entry
    assert ix.lookup(PROMPT, 16384, 4)[0].sha1 == sha1(q8)
    ix = index(*entries, kv_cache_reject_different_quant=True)
    assert ix.lookup(PROMPT, 8192, 4)[0].sha1 == sha1(good)
    assert ix.lookup(PROMPT, 8192, 8)[0].sha1 == sha1(q8)
    ix = index(entry(small, 7), entry(big_ctx, 40, ctx_size=16384))
    assert ix.lookup(PROMPT, 8192, 4) == (None, "no usable checkpoints")


def test_lookup_miss_reason_with_trace(tmp_path):
    """With --trace the miss names the byte where the best candidate stopped matching."""
    from procs.renderer.cache import DiskIndex
    text = PROMPT[:30] + b"Z" * 20
    g = kf.Geometry(ctx_size=64, chunk_size=16, kv_capacity=64, n_layers=1, kv_heads=1, head_dim=2,
                    vocab_size=4, kv_dtype=kf.KV_F32)
    z = np.zeros((1, 3, 1, 2), np.float32)
    (tmp_path / kf.entry_name(text)).write_bytes(
        kf.pack(text, [1, 2, 3], np.zeros(4, np.float32), z, z, g, bytes(16), 4, kf.COLD))
    s = Settings(kv_disk_dir=str(tmp_path), kv_cache_min_tokens=1)
    ix = DiskIndex(s, Trace(str(tmp_path / "trace"), "renderer"))
    ix.update(m.IndexSnapshot(entries=(entry(text, 3, ctx_size=64),), version=1))
    assert ix.lookup(PROMPT, 8192, 4) == (None, "prefix mismatch at byte 30")


# ------------------------------------------------------------------ renderer: save plan, evict

def settings(**kw):
    d = dict(kv_disk_dir="/x", kv_cache_min_tokens=64, kv_cache_cold_max_tokens=30000,
             kv_cache_boundary_align_tokens=64, kv_cache_boundary_trim_tokens=8,
             kv_cache_continued_interval_tokens=256)
    d.update(kw)
    return Settings(**d)


def test_save_plan():
    from procs.renderer.cache import save_plan
    s = settings()
    cold = lambda *pos: tuple(m.SavePoint(pos=p, reason=kf.COLD) for p in pos)
    assert save_plan(s, 400, 0, 150) == cold(150, 376)            # prefix end + aligned cold
    assert save_plan(s, 400, 0, 0) == cold(376)
    assert save_plan(s, 400, 200, 150) == cold(376)                # the prefix was reused
    assert save_plan(s, 400, 376, 150) == ()                       # nothing beyond reused
    assert save_plan(s, 400, 0, 40) == cold(376)                   # system part below min
    assert save_plan(s, 63, 0, 0) == ()                            # prompt below min
    assert save_plan(s, 100, 0, 0) == cold(92)                     # 64 - 8 < 64: n - trim
    assert save_plan(s, 70, 0, 0) == ()                            # 70 - 8 < 64
    assert save_plan(settings(kv_cache_cold_max_tokens=300), 400, 0, 150) == ()
    assert save_plan(s, 376, 0, 376) == cold(312, 376)


class FakeText:
    """piece_bytes of ids: one byte each."""

    @staticmethod
    def piece_bytes(ids) -> bytes:
        return bytes(i % 256 for i in ids)


def test_evict_needed():
    from procs.renderer.cache import evict_needed
    s = settings()
    live = list(range(100))
    assert evict_needed(s, index(), FakeText, live, 0)
    assert evict_needed(s, index(), FakeText, live, 36)            # loses exactly min (64)
    assert not evict_needed(s, index(), FakeText, live, 37)        # loses 63 < 64
    assert not evict_needed(s, index(), FakeText, [], 0)
    assert not evict_needed(settings(kv_disk_dir=""), index(), FakeText, live, 0)
    text = FakeText.piece_bytes(live)
    assert not evict_needed(s, index(entry(text, 100)), FakeText, live, 0)   # already on disk
    assert evict_needed(s, index(entry(text, 99)), FakeText, live, 0)        # not that state
    assert evict_needed(s, index(entry(text[:50], 50)), FakeText, live, 0)


def test_prefix_end_tokens_finds_the_token_that_ends_at_the_prefix(text_model):
    """Against counting piece by piece, at every byte of a prompt with multi-byte
    characters: the tokens that cover exactly that many bytes, or 0 where none ends there."""
    from procs.renderer.cache import prefix_end_tokens
    ids = text_model.encode("Système: réponds brièvement. <|im_start|>user\nQuel temps fait-il à Zürich ?")
    ends, total = {}, 0
    for i, t in enumerate(ids):
        total += len(text_model.pieces[t])
        ends.setdefault(total, i + 1)
    for n in range(total + 2):
        assert prefix_end_tokens(text_model, ids, n) == ends.get(n, 0), n
    assert prefix_end_tokens(text_model, [], 0) == 0
