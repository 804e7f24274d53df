"""Prompt lookup decoding's drafts: the tokens that followed the conversation's last N ids
the last time those N ids occurred in it (prompt and answer so far). An agent's answer copies
much of its prompt (a file it edits, a call it repeats); the decode loop checks a draft in
one batched step (runs.Runs.speculate) and keeps what the model would have written anyway.

Invariant: `last` maps each N-gram of ids but the trailing one to the end of its latest
occurrence, so a draft never starts at the tail itself."""
from __future__ import annotations

N = 3          # ids a draft's context must match: fewer drafts, more of each kept


class Lookup:
    def __init__(self, ids):
        self.ids = list(ids)
        self.last: dict[tuple[int, ...], int] = {}
        for end in range(N, len(self.ids)):
            self.last[tuple(self.ids[end - N:end])] = end

    def push(self, tok: int) -> None:
        """tok follows the ids."""
        if len(self.ids) >= N:
            self.last[tuple(self.ids[-N:])] = len(self.ids)
        self.ids.append(tok)

    def draft(self, most: int) -> list[int]:
        """Up to `most` ids that followed the trailing N-gram where it occurred last; [] when it
        did not occur before."""
        if most <= 0 or len(self.ids) < N:
            return []
        end = self.last.get(tuple(self.ids[-N:]))
        return [] if end is None else self.ids[end:end + most]
