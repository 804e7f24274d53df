"""Helpers shared by unit-test modules of several packages (fixtures are in conftest.py)."""
from __future__ import annotations

import hashlib
import logging
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository
LOG = logging.getLogger("tests")


def sha1(b: bytes) -> str:
    """A checkpoint's name without its suffix: the sha1 of its text."""
    return hashlib.sha1(b).hexdigest()


def detokenize_cases(pieces: list[bytes], cases, text_bytes) -> int:
    """Each case's (name, text, ids) through the incremental detokenizer: the deltas join
    to text_bytes(text), and none carries a replacement character a later token would have
    fixed. Returns how many tokens were part of a character (invalid UTF-8 alone)."""
    from common.detok import Detokenizer
    split = 0
    for name, text, ref in cases:
        d = Detokenizer(pieces)
        deltas = [d.push(t) for t in ref]
        assert ("".join(deltas) + d.flush()).encode() == text_bytes(text), name
        assert all("\ufffd" not in x for x in deltas), name
        split += sum(not _valid_utf8(pieces[t]) for t in ref)
    return split


def _valid_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
