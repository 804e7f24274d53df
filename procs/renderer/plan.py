"""The reuse plan of one request, decided without sending anything: which resident session
to run in (or to start a new one from), or which checkpoint to restore, the suffix to
prefill, the save points, which sessions must be evict-saved if they leave memory, and what
the trace should say about it. The renderer carries the plan out (server.dispatch); unit
tests call plan_job directly.

A session is continued in place when the request keeps all of it but a few tokens
(IN_PLACE_TAIL), or when the whole prompt lies inside it (a repeated or regenerated
request); when it keeps only a prefix (a side request on the same system prompt, a branch),
the request gets a new session starting from a copy of that prefix, so the conversation it
came from stays resident and whole (inference cuts it in place only when memory holds no
second session)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from common import messages as m
from common.tokenizer import TextModel
from procs.renderer.cache import DiskIndex, evict_needed, prefix_end_tokens, save_plan
from procs.renderer.prompt import plan_reuse, prefix_bytes

IN_PLACE_TAIL = 16   # session tokens a request may drop and still run in that session


@dataclass
class Plan:
    ids: list[int]                  # the effective prompt ids (the cold fallback too)
    reuse: int                      # session tokens to keep (inference ignores it on a restore)
    restore: m.IndexEntry | None    # the checkpoint to restore instead, if any
    suffix: tuple[int, ...]         # prompt tokens after the restored checkpoint's text
    saves: tuple[m.SavePoint, ...]
    evict: bool                     # save the whole session before cutting it in place
    n_prompt: int                   # prompt tokens the session will hold
    cached: int                     # tokens reused, live or restored
    miss: str                       # why the disk cache had nothing (metrics), "" on a hit
    notes: list[str] = field(default_factory=list)   # trace lines
    session: int = 0                # the resident session to run in; 0: a new one
    source: int = 0                 # with session 0: the session whose first `reuse` tokens it copies
    unsaved: tuple[int, ...] = ()   # resident sessions no checkpoint holds whole


def best_session(text: TextModel, n_ctx: int, sessions: dict[int, m.LiveSession], prompt: bytes,
                 full: list[int], min_tokens: int, hint: int = 0) -> tuple[int, list[int], int]:
    """(sid, effective ids, tokens kept) of the resident session with the longest usable
    prefix of the prompt; ties go to the hinted session, then the most recently used.
    (0, full, 0) when none has one. A session's keep_from is the shortest prefix it can be
    cut to (one restored from a windowed checkpoint lacks the rows below it); one with a
    recurrent state can be cut only to its marks (or kept whole)."""
    best = (0, full, 0)
    for sid, ls in reversed(sessions.items()):          # most recent first
        ids, reuse = plan_reuse(text, prompt, full, ls.tokens, min_tokens, ls.answer_from)
        if ls.marks is not None and reuse < len(ls.tokens):
            reuse = max((x for x in ls.marks if x <= reuse), default=0)
        if len(ids) >= n_ctx or 0 < reuse < ls.keep_from:   # the live-text split can tokenize longer
            continue
        if reuse > best[2] or (reuse and reuse == best[2] and sid == hint):
            best = (sid, ids, reuse)
    return best


def plan_job(s, text: TextModel, n_ctx: int, index: DiskIndex, sessions: dict[int, m.LiveSession],
             quant_bits: int, req: m.GenerateRequest, prompt: bytes, full: list[int], hint: int = 0,
             busy=frozenset()) -> Plan:
    """sessions: the resident ones, least recently used first; hint: the session the
    request's session_hint last ran in (0: none); busy: sessions a running job uses, which
    a new job may copy a prefix of but never continue in place."""
    sid, ids, reuse = best_session(text, n_ctx, sessions, prompt, full, s.kv_cache_min_tokens, hint)
    live = sessions[sid].tokens if sid else ()
    restore, suffix, notes = None, (), []
    sha = hashlib.sha1(prompt).hexdigest()
    if s.kv_disk_dir:
        entry, why = index.lookup(prompt, n_ctx, quant_bits)
        if entry is not None and entry.n_tokens > reuse:
            suffix = tuple(text.encode(prompt[entry.text_len:]))
            if entry.n_tokens + len(suffix) < n_ctx:
                restore = entry
        elif entry is None and not reuse:
            notes.append(f"KV cache: miss for sha1={sha} (reason: {why})")
        miss = why.split(" at byte")[0] if entry is None else "shorter than the live session"
    else:
        miss = "disk cache off"
    in_place = bool(sid) and sid not in busy and restore is None and \
        (len(live) - reuse <= IN_PLACE_TAIL or reuse >= len(ids))
    if restore is None and reuse:
        how = f"session {sid}" if in_place else f"a copy of session {sid}'s first tokens"
        notes.append(f"KV cache: live session reused for sha1={sha} ({reuse} tokens, {how})")
    n_prompt = restore.n_tokens + len(suffix) if restore else len(ids)
    cached = restore.n_tokens if restore else reuse
    pfx = prefix_bytes(text, req, prompt)
    pfx_tokens = prefix_end_tokens(text, ids, pfx) if pfx else 0
    saves = save_plan(s, n_prompt, cached, pfx_tokens if not restore else 0) if s.kv_disk_dir else ()
    evict = in_place and evict_needed(s, index, text, live, reuse)
    unsaved = tuple(i for i, ls in sessions.items() if evict_needed(s, index, text, ls.tokens, 0))
    return Plan(ids=ids, reuse=0 if restore else reuse, restore=restore, suffix=suffix if restore else (),
                saves=saves, evict=evict, n_prompt=n_prompt, cached=cached, miss=miss, notes=notes,
                session=sid if in_place else 0, source=sid if not in_place and not restore and reuse else 0,
                unsaved=unsaved)
