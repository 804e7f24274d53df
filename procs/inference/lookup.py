"""Prompt lookup decoding: an answer's drafts are the tokens that followed its last N ids the
last time those N ids occurred in the conversation (prompt and answer so far). An agent's
answer copies much of its prompt (a file it edits, a call it repeats); a run decoding alone
checks a draft in one batched step over consecutive positions of its session (speculate) and
keeps what the model would have written anyway.

Invariant: an index maps each N-gram of the session's tokens to the end of its latest
occurrence, never the trailing one that ends with the token being decoded, so a draft never
starts at the tail itself."""
from __future__ import annotations

from dataclasses import dataclass, field

from common import metrics

N = 3          # ids a draft's context must match: fewer drafts, more of each kept


class Lookup:
    """The N-grams of a session's tokens, indexed as they grow (the session's list is read,
    not copied)."""

    def __init__(self):
        self.last: dict[tuple[int, ...], int] = {}
        self.upto = N                  # the next gram end to index

    def draft(self, ids, tok: int, most: int) -> list[int]:
        """Up to `most` ids that followed (ids + [tok])'s trailing N-gram where it occurred
        last; [] when it did not occur before. ids: the session's tokens, only ever grown
        between calls past what an earlier call saw."""
        n = len(ids)
        for end in range(self.upto, n + 1):
            self.last[tuple(ids[end - N:end])] = end
        self.upto = max(self.upto, n + 1)
        if most <= 0 or n + 1 < N:
            return []
        end = self.last.get(tuple(ids[n - N + 1:]) + (tok,))
        if end is None:
            return []
        return list(ids[end:end + most]) + ([tok] if end + most > n else [])


@dataclass
class Drafts:
    """One answer's prompt lookup: its index, the next draft's most, and counts."""
    most: int
    index: Lookup = field(default_factory=Lookup)
    drafted: int = 0
    kept: int = 0


def speculate(w, run, tok: int) -> bool:
    """w: the Worker (runs.Runs); tok: run's sampled token, sent, not yet in its session. tok
    and a draft run in one batched step over consecutive positions of the session
    (Llama.decode_batch: with the native decoder each row is bit for bit the row a lone decode
    computes). Each row's token is sampled as a decode step would sample it (the grammar's
    mask following the tokens kept before it) and sent; the draft is kept while it equals
    what was sampled, and the first token that differs runs in the next round
    (Run.pending). False: no draft (decode as usual), always for a session with a recurrent
    state (a draft's rows past the first that differs cannot be taken back from it)."""
    sess, d = run.sess, run.drafts
    if w.threads.due or sess.state is not None:         # the thread count's probe times plain steps of one row
        return False
    room = min(d.most, run.budget - run.n, w.n_ctx - len(sess) - 1)
    draft = d.index.draft(sess.tokens, tok, room)
    if not draft:
        return False
    base, seq = len(sess), [tok] + draft
    sess.reserve(base + len(seq))
    rows = w.threads.untimed(lambda: sess.model.decode_batch(
        seq, list(range(base, base + len(seq))), [(sess.k, sess.v)] * len(seq), exact=sess.exact))
    sess.tokens.extend(seq)
    d.drafted += len(draft)
    metrics.M.batch_size.observe(1)
    kept = 0
    for i, logits in enumerate(rows):
        def settle(k=base + 1 + i, row=logits):     # the session where this row's logits came from
            sess.truncate(k)
            sess.logits = row
        t, lp, top = run.sampler(logits, run.guide.mask(logits) if run.guide else None)
        if w.emit(run, t, lp, top, settle):
            return True
        if i < len(draft) and t == draft[i]:
            kept += 1
            d.kept += 1
            continue
        settle()
        run.logits, run.pending = logits, t
        break
    # each row costs attention over the context and its share of the step: a draft the model
    # keeps whole doubles the next one's most, else the next is one past what it kept
    d.most = min(w.s.draft_lookup, 2 * len(draft)) if kept == len(draft) else kept + 1
    if w.disk.enabled and not sess.exact:
        w.save_frontiers(run, base, len(sess), {base + 1 + j: rows[j] for j in range(len(sess) - base)})
    return True
