"""Prompt token ids, the already-encoded start of a recent prompt reused.

An agent resends its whole conversation every turn, and encoding a ~5,800-token prompt takes
~6 ms of the renderer's one thread (2-core EPYC): serial across requests, it is in every
turn's time to first token and in each request queued behind it. A new prompt usually starts
with a recent one's text. The tokenizer cuts special tokens out of the text before anything
else and encodes the fragments between them independently (tokenizer_spm: the same for
SentencePiece vocabularies, a fragment after a special token included), so the ids of a text
cut right after a special token are the ids of its two sides, concatenated: the new prompt is
encoded as the recent prompt's ids up to the last such cut both texts share, plus the
encoding of the rest. Identical to encoding the whole prompt (tests/procs/renderer/
test_encoding.py checks it on each tokenizer family the tests hold).
"""
from __future__ import annotations

import collections

from common.tokenizer import TextModel

KEEP = 16            # recent prompts remembered
MIN_REUSE = 256      # characters: a shorter shared start is encoded again


class _Encoded:
    def __init__(self, text: str, ids: list[int], cuts: list[tuple[int, int]]):
        self.text, self.ids, self.cuts = text, ids, cuts    # cuts: (characters, ids) after a special token


class PromptEncoder:
    def __init__(self, text: TextModel, keep: int = KEEP):
        self.model, self.keep = text, keep
        self.special = {i for i, a in text.tokenizer.get_added_tokens_decoder().items() if a.special}
        self.recent: collections.OrderedDict[str, _Encoded] = collections.OrderedDict()
        self.reused = 0      # characters taken from recent prompts, over all calls (for tests and logs)

    def encode(self, prompt: bytes) -> list[int]:
        """TextModel.encode(prompt), from a recent prompt's ids where one shares its start."""
        try:
            text = prompt.decode("utf-8")
        except UnicodeDecodeError:          # byte tokens: the plain path
            return self.model.encode(prompt)
        got = self.recent.get(text)
        if got is not None:
            self.recent.move_to_end(text)
            return list(got.ids)
        at, n, base = 0, 0, None
        for e in reversed(self.recent.values()):
            for c, k in reversed(e.cuts):
                if c <= at:
                    break
                if c <= len(text) and text.startswith(e.text[:c]):
                    at, n, base = c, k, e
                    break
        if base is None or at < MIN_REUSE:
            at, n, base = 0, 0, None
        enc = self.model.tokenizer.encode(text[at:], add_special_tokens=False) if at < len(text) else None
        tail = enc.ids if enc is not None else []
        ids = (base.ids[:n] if base else []) + tail
        cuts = [cut for cut in base.cuts if cut[0] <= at] if base else []
        if enc is not None:
            cuts += [(at + end, n + i + 1) for i, (t, (_, end)) in enumerate(zip(tail, enc.offsets))
                     if t in self.special]
        self.reused += at
        self.recent[text] = _Encoded(text, ids, cuts)
        while len(self.recent) > self.keep:
            self.recent.popitem(last=False)
        return list(ids)
