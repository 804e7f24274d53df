"""Constrained decoding's shared half: llguidance's view of a model's vocabulary.

The renderer validates grammars against it (a bad schema is the client's 400 before any
work is queued); inference computes token masks with it. Both build it from the same
`TextModel.pieces`, so a token's bytes are the bytes the prompt and the cache text use.
llguidance was chosen over xgrammar by measured mask cost and footprint (README).
"""
from __future__ import annotations

import llguidance

from common.tokenizer import TextModel


class _Vocab:
    """What llguidance.TokenizerWrapper reads: token bytes, special ids, an encoder."""

    def __init__(self, text: TextModel):
        self.text = text
        self.tokens = text.pieces
        self.eos_token_id = text.eos_id if text.eos_id is not None else min(text.stop_ids, default=0)
        self.bos_token_id = text.bos_id
        self.special_token_ids = sorted(text.tokenizer.get_added_tokens_decoder())

    def __call__(self, data: bytes) -> list[int]:
        return self.text.encode(data)


def tokenizer(text: TextModel) -> llguidance.LLTokenizer:
    """Every stop id counts as end of sequence: a finished grammar allows exactly those."""
    eos = sorted(text.stop_ids) or None
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocab(text)), eos_token=eos)
