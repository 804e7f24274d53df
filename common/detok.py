"""Incremental detokenizer: token ids in, complete UTF-8 text out.

A token piece may end inside a multi-byte character; bytes are held back until they
decode, so no delta ever carries a replacement character that a later token would fix.
"""
from __future__ import annotations


class Detokenizer:
    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces
        self.pending = b""

    def push(self, tok: int) -> str:
        self.pending += self.pieces[tok]
        return self._drain()

    def _drain(self) -> str:
        buf = self.pending
        # longest prefix that decodes; an incomplete tail of at most 3 bytes waits
        for cut in range(len(buf), max(len(buf) - 4, -1), -1):
            try:
                text = buf[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            self.pending = buf[cut:]
            return text
        text = buf.decode("utf-8", errors="replace")   # invalid bytes, not a partial char
        self.pending = b""
        return text

    def flush(self) -> str:
        text = self.pending.decode("utf-8", errors="replace")
        self.pending = b""
        return text
