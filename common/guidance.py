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
        # control tokens only: llguidance keeps special tokens out of text matching, and a
        # SentencePiece USER_DEFINED token (Gemma's "\n", whitespace runs) is how the model
        # writes that text (tokenizer_spm adds those as added tokens not flagged special)
        added = text.tokenizer.get_added_tokens_decoder()
        self.special_token_ids = sorted(i for i, a in added.items() if a.special)

    def __call__(self, data: bytes) -> list[int]:
        return self.text.encode(data)


def tokenizer(text: TextModel) -> llguidance.LLTokenizer:
    """Every stop id counts as end of sequence: a finished grammar allows exactly those."""
    eos = sorted(text.stop_ids) or None
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocab(text)), eos_token=eos)
