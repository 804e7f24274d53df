"""Constrained decoding's shared half: llguidance's view of a model's vocabulary.

The renderer validates grammars against it (a bad schema is the client's 400 before any
work is queued); inference computes token masks with it. Both build it from the same
`TextModel.pieces`, so a token's bytes are the bytes the prompt and the cache text use.
llguidance was chosen over xgrammar by measured mask cost and footprint (README).
Also shared: how an answer that opens with a fenced call is recognised (renderer/toolfmt.py
says why), by the renderer's parser and by inference's trigger alike.
"""
from __future__ import annotations

import re

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


# the opening of a call written as JSON at the start of an answer, up to the quote that opens
# its name: fenced (```json) or bare, as llama.cpp's Hermes parser also takes them
FENCE_HEAD = re.compile(r'\s*(```(?:json)?[ \t]*\r?\n\s*)?\{\s*"name"\s*:\s*"')
# the same, piece by piece, to tell a prefix that may still become one: regexes that may
# match nothing, literals, and optional literals ("?" + text)
_CALL_STEPS = ("{", re.compile(r"\s*"), '"name"', re.compile(r"\s*"), ":", re.compile(r"\s*"), '"')
_HEAD_STEPS = ((re.compile(r"\s*"), "```", "?json", re.compile(r"[ \t]*"), "?\r", "\n", re.compile(r"\s*")) + _CALL_STEPS,
               (re.compile(r"\s*"),) + _CALL_STEPS)


def _steps_state(s: str, steps) -> int:
    i = 0
    for step in steps:
        rest = s[i:]
        if not isinstance(step, str):
            i = step.match(s, i).end()
            if i == len(s):
                return 0
            continue
        lit = step.lstrip("?")
        if rest.startswith(lit):
            i += len(lit)
        elif lit.startswith(rest):
            return 0
        elif not step.startswith("?"):
            return -1
    return 1


def fence_state(s: str) -> int:
    """1 when the answer s opens a call written as JSON (FENCE_HEAD), 0 while it still may,
    -1 when it cannot."""
    if FENCE_HEAD.match(s):
        return 1
    return max(_steps_state(s, steps) for steps in _HEAD_STEPS)


# the first rule of a JSON call's grammar, whose other rules (fc, WS) are Constraint.fence: a
# fenced call ends with its closing fence, a bare one at its object's brace
_CALL_START = {True: 'start: fc WS "}" "\\n```"\n', False: 'start: fc WS "}"\n'}


def call_grammar(rules: str, fenced: bool) -> str:
    return _CALL_START[fenced] + rules


def head_grammar(rules: str, text: str) -> str:
    """The grammar of the call `text` opened (FENCE_HEAD matches it), Constraint.fence's rules
    under the start its form takes."""
    return call_grammar(rules, bool(FENCE_HEAD.match(text).group(1)))
