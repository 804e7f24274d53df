"""The reuse plan of one request, decided without sending anything: which live tokens to
keep or which checkpoint to restore, the suffix to prefill, the save points, whether the
live session must be evict-saved first, and what the trace should say about it. The
renderer carries the plan out (server.dispatch); unit tests call plan_job directly."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from common import messages as m
from common.tokenizer import TextModel
from procs.renderer.cache import DiskIndex, evict_needed, prefix_end_tokens, save_plan
from procs.renderer.prompt import plan_reuse, prefix_bytes


@dataclass
class Plan:
    ids: list[int]                  # the effective prompt ids (the cold fallback too)
    reuse: int                      # live-session tokens to keep (inference ignores it on a restore)
    restore: m.IndexEntry | None    # the checkpoint to restore instead, if any
    suffix: tuple[int, ...]         # prompt tokens after the restored checkpoint's text
    saves: tuple[m.SavePoint, ...]
    evict: bool                     # save the whole live session before replacing it
    n_prompt: int                   # prompt tokens the session will hold
    cached: int                     # tokens reused, live or restored
    miss: str                       # why the disk cache had nothing (metrics), "" on a hit
    notes: list[str] = field(default_factory=list)   # trace lines


def plan_job(s, text: TextModel, n_ctx: int, index: DiskIndex, live: list[int], quant_bits: int,
             req: m.GenerateRequest, prompt: bytes, full: list[int], keep_from: int = 0) -> Plan:
    """keep_from: the shortest live prefix the session can be cut to (a session restored from
    a windowed checkpoint lacks the rows below it); a shorter reuse is no reuse."""
    ids, reuse = plan_reuse(text, prompt, full, live, s.kv_cache_min_tokens)
    if len(ids) >= n_ctx or 0 < reuse < keep_from:   # the live-text split can tokenize longer
        ids, reuse = full, 0
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
    if restore is None and reuse:
        notes.append(f"KV cache: live session reused for sha1={sha} ({reuse} tokens)")
    n_prompt = restore.n_tokens + len(suffix) if restore else len(ids)
    cached = restore.n_tokens if restore else reuse
    pfx = prefix_bytes(text, req, prompt)
    pfx_tokens = prefix_end_tokens(text, ids, pfx) if pfx else 0
    saves = save_plan(s, n_prompt, cached, pfx_tokens if not restore else 0) if s.kv_disk_dir else ()
    evict = evict_needed(s, index, text, live, 0 if restore else reuse)
    return Plan(ids=ids, reuse=reuse, restore=restore, suffix=suffix if restore else (),
                saves=saves, evict=evict, n_prompt=n_prompt, cached=cached, miss=miss, notes=notes)
