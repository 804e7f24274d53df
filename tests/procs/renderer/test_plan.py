"""The reuse plan without processes or sends: the real tokenizer, an index of entries made
here (no files are read), a live session given as ids."""
from __future__ import annotations

from common import messages as m
from common.config import Settings
from common.trace import Trace
from procs.renderer.cache import DiskIndex
from procs.renderer.plan import plan_job
from tests.helpers import sha1

CHAT = m.GenerateRequest(rid="r", kind="chat", sampling=m.SamplingParams(),
                         messages=(m.ChatMessage(role="user", content="hi"),))


def setup(text_model, n_words=200, **kw):
    prompt = (" ".join(f"w{i}" for i in range(n_words))).encode()
    s = Settings(kv_disk_dir="/nonexistent", kv_cache_min_tokens=8, kv_cache_boundary_align_tokens=32,
                 kv_cache_boundary_trim_tokens=4, **kw)
    ix = DiskIndex(s, Trace("", "renderer"))
    return s, ix, prompt, text_model.encode(prompt)


def one(live, keep_from=0) -> dict[int, m.LiveSession]:
    """The resident sessions as the renderer mirrors them: live as session 1 (none if empty)."""
    return {1: m.LiveSession(sid=1, tokens=tuple(live), keep_from=keep_from)} if live else {}


def entry(text_model, text: bytes) -> m.IndexEntry:
    return m.IndexEntry(sha1=sha1(text), text_len=len(text), n_tokens=len(text_model.encode(text)),
                        quant_bits=4, ctx_size=8192, size=1, last_used=0)


def test_live_session_prefix_is_kept(text_model):
    s, ix, prompt, full = setup(text_model)
    ix.update(m.IndexSnapshot(entries=(), version=1))
    live = full[:100]
    pl = plan_job(s, text_model, 8192, ix, one(live), 4, CHAT, prompt, full)
    assert (pl.reuse, pl.restore, pl.cached, pl.n_prompt) == (100, None, 100, len(full))
    assert pl.ids == full and not pl.evict and (pl.session, pl.source) == (1, 0)
    assert pl.miss == "no checkpoints" and any("live session reused" in n for n in pl.notes)


def test_live_prefix_shorter_than_keep_from_is_not_reused(text_model):
    """A live session restored from a windowed checkpoint cannot be cut below keep_from:
    a plan that would keep less prefills the prompt instead (or restores a checkpoint)."""
    s, ix, prompt, full = setup(text_model)
    ix.update(m.IndexSnapshot(entries=(), version=1))
    live = full[:100] + [7, 7, 7]
    assert plan_job(s, text_model, 8192, ix, one(live, 100), 4, CHAT, prompt, full).reuse == 100
    pl = plan_job(s, text_model, 8192, ix, one(live, 101), 4, CHAT, prompt, full)
    assert (pl.reuse, pl.cached, pl.ids) == (0, 0, full)


def test_a_recurrent_session_is_cut_only_to_its_marks(text_model):
    """A session with a recurrent state (linear attention) keeps a prefix only where it has a
    mark, or whole: a prompt that diverges at 100 reuses the mark at or below it, none
    without one; a prompt that extends the whole session keeps all of it."""
    s, ix, prompt, full = setup(text_model)
    ix.update(m.IndexSnapshot(entries=(), version=1))
    live = full[:100] + [7, 7, 7]

    def plan(marks, tokens=live):
        return plan_job(s, text_model, 8192, ix, {1: m.LiveSession(sid=1, tokens=tuple(tokens), marks=marks)},
                        4, CHAT, prompt, full)
    assert plan(None).reuse == 100                       # any prefix: not a recurrent session
    assert plan((40, 90, 101)).reuse == 90
    assert plan(()).reuse == 0 and plan((101,)).reuse == 0
    assert plan((), full[:120]).reuse == 120            # the whole session


def test_longer_checkpoint_beats_the_live_session(text_model):
    s, ix, prompt, full = setup(text_model)
    cut = prompt.index(b" w150")
    e = entry(text_model, prompt[:cut])
    ix.update(m.IndexSnapshot(entries=(e,), version=1))
    live = full[:50] + [7, 7, 7]          # diverges after 50 tokens: evict-saved if it leaves memory
    pl = plan_job(s, text_model, 8192, ix, one(live), 4, CHAT, prompt, full)
    assert pl.restore == e and pl.cached == e.n_tokens
    assert text_model.piece_bytes(pl.suffix) == prompt[cut:]
    assert pl.n_prompt == e.n_tokens + len(pl.suffix)
    assert pl.unsaved == (1,) and (pl.session, pl.source) == (0, 0)   # the restore gets a new session


def test_cold_and_disk_off(text_model):
    s, ix, prompt, full = setup(text_model)
    ix.update(m.IndexSnapshot(entries=(), version=1))
    pl = plan_job(s, text_model, 8192, ix, one([]), 4, CHAT, prompt, full)
    assert (pl.reuse, pl.cached, pl.restore) == (0, 0, None) and pl.miss == "no checkpoints"
    assert [p.pos for p in pl.saves] and all(p.pos <= len(full) for p in pl.saves)   # a cold save
    assert any("miss for sha1=" in n for n in pl.notes)
    off = Settings(kv_disk_dir="")
    pl = plan_job(off, text_model, 8192, DiskIndex(off, Trace("", "renderer")), one([]), 4, CHAT, prompt, full)
    assert pl.miss == "disk cache off" and pl.saves == () and not pl.evict and not pl.unsaved


def test_a_side_request_gets_a_copy_and_the_conversation_stays_whole(text_model):
    """A request that shares only a prefix of a resident session (a side request on the same
    system prompt) runs in a new session starting from a copy of that prefix; a request that
    continues a session runs in it; a session no checkpoint holds is named unsaved."""
    s, ix, prompt, full = setup(text_model)
    ix.update(m.IndexSnapshot(entries=(), version=1))
    long = full[:150] + [7] * 50                        # the conversation: 150 shared, then its own
    sessions = {1: m.LiveSession(sid=1, tokens=tuple(long)), 2: m.LiveSession(sid=2, tokens=tuple(full[:20]))}
    pl = plan_job(s, text_model, 8192, ix, sessions, 4, CHAT, prompt, full)
    assert (pl.session, pl.source, pl.reuse, pl.cached) == (0, 1, 150, 150)
    assert pl.unsaved == (1, 2) and not pl.evict
    grown = {**sessions, 3: m.LiveSession(sid=3, tokens=tuple(full[:190]))}
    pl = plan_job(s, text_model, 8192, ix, grown, 4, CHAT, prompt, full)
    assert (pl.session, pl.source, pl.reuse) == (3, 0, 190)    # a continuation: in place
    near = {1: m.LiveSession(sid=1, tokens=tuple(full[:190] + [7] * 4))}
    pl = plan_job(s, text_model, 8192, ix, near, 4, CHAT, prompt, full)
    assert (pl.session, pl.reuse) == (1, 190)           # a tail under min_tokens is cut in place


def test_ties_go_to_the_hinted_session_then_the_most_recent(text_model):
    s, ix, prompt, full = setup(text_model)
    ix.update(m.IndexSnapshot(entries=(), version=1))
    a, b = tuple(full[:100] + [7] * 30), tuple(full[:100] + [8] * 30)
    sessions = {4: m.LiveSession(sid=4, tokens=a), 9: m.LiveSession(sid=9, tokens=b)}   # 9 most recent
    assert plan_job(s, text_model, 8192, ix, sessions, 4, CHAT, prompt, full).source == 9
    assert plan_job(s, text_model, 8192, ix, sessions, 4, CHAT, prompt, full, hint=4).source == 4


def test_the_next_turn_of_a_short_conversation_keeps_its_session(text_model):
    """A prompt that keeps the whole prompt of a session's last answer (answer_from) is that
    conversation's next turn: kept in place however short, where the template renders
    another end of turn than the one sampled (the session's last token). Another
    conversation sharing less than that prompt, or a session whose last prompt is unknown,
    still needs --kv-cache-min-tokens."""
    import dataclasses
    s, ix, prompt, full = setup(text_model, n_words=100)
    s = dataclasses.replace(s, kv_cache_min_tokens=512)
    ix.update(m.IndexSnapshot(entries=(), version=1))
    assert len(full) < 512

    def plan(tokens, answer_from):
        sessions = {1: m.LiveSession(sid=1, tokens=tuple(tokens), answer_from=answer_from)}
        return plan_job(s, text_model, 8192, ix, sessions, 4, CHAT, prompt, full)
    pl = plan(full[:150] + [7], 140)              # prompt 140, the answer 10 tokens, its end other
    assert (pl.session, pl.reuse, pl.cached) == (1, 150, 150)
    pl = plan(full[:150] + [7] * 40, 140)         # an answer the client cut: a copy of its prefix
    assert (pl.session, pl.source, pl.reuse) == (0, 1, 150)
    assert plan(full[:150] + [7], 0).reuse == 0                # last prompt unknown
    assert plan(full[:30] + [7] * 20, 45).reuse == 0           # another conversation's session
