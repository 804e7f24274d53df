"""Steps over several sessions at once: one batched decode step (decode_many) and one
prefill step of chunks of several sessions (prefill_many), each session a KVSession of the
same model whose tokens, logits and rows the step extends."""
from __future__ import annotations

import torch

from procs.inference.kvsession import KVSession
from procs.inference.sharing import Sharing


def decode_many(sessions: list[KVSession], tokens: list[int], sharing: Sharing | None = None) -> list[torch.Tensor]:
    """Append tokens[b] to sessions[b] (distinct sessions of one model) in one batched decode
    step (Llama.decode_batch, or on CUDA a replayed graph of graph_step.static_step); returns and
    keeps each session's new logits. sharing: read the rows sessions hold alike
    once (the native decoder; a bit-identical result either way)."""
    for s in sessions:
        if len(s) + 1 > s.n_ctx:
            raise ValueError(f"{len(s) + 1} tokens exceed the context of {s.n_ctx}")
        s.reserve(len(s) + 1)
    model = sessions[0].model
    logits = None
    if model.graphs is not None and not sessions[0].exact:
        logits = model.graphs(sessions, tokens)       # None: this step eager
    if logits is None:
        share = sharing.plan(sessions) if sharing is not None and model.decoder is not None and len(sessions) > 1 \
            else None
        logits = model.decode_batch(tokens, [len(s) for s in sessions], [(s.k, s.v) for s in sessions],
                                    exact=sessions[0].exact, share=share, states=[s.state for s in sessions])
    rows = list(logits)
    for s, t, row in zip(sessions, tokens, rows):
        s.tokens.append(t)
        s.logits = row
    return rows


def prefill_many(sessions: list[KVSession], chunks: list[list[int]], logits_at: list) -> list[dict] | None:
    """Append chunks[b] to sessions[b] (distinct sessions of one model, each chunk within one
    of its session's chunk boundaries) in one step of the model's graphs (graphs.py: on CUDA,
    where a step launches hundreds of kernels for a few rows, several prompts' chunks cost
    about one's). Returns each session's {n: logits after its first n tokens} for n in
    logits_at[b] within its chunk, and keeps each session's last logits; None, with nothing
    changed, where there are no graphs or the step would not be a graph's (the caller
    prefills them one by one)."""
    model = sessions[0].model
    if model.graphs is None or any(s.exact for s in sessions):
        return None
    rows, wants = [], []
    for s, ids, at in zip(sessions, chunks, logits_at):
        lo, hi = len(s), len(s) + len(ids)
        if not ids or hi > s.n_ctx or s.boundaries(lo, hi) != [hi]:
            raise ValueError(f"a chunk of {len(ids)} tokens at {lo} is not within one chunk of its session")
        want = sorted({n for n in at if lo < n <= hi} | {hi})
        rows.append([n - lo - 1 for n in want])
        wants.append(want)
    for s, ids in zip(sessions, chunks):
        s.reserve(len(s) + len(ids))
    got = model.graphs.prefill_many(sessions, chunks, rows)
    if got is None:
        return None
    out = []
    for s, ids, at, want, logits in zip(sessions, chunks, logits_at, wants, got):
        s.tokens.extend(ids)
        s.logits = logits[-1]
        out.append({n: row for n, row in zip(want, logits) if n in at})
    return out
