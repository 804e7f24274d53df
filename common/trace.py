"""The --trace file: cache decisions, one line each, appended by every process.

Lines are written with one O_APPEND write each, so lines of several processes interleave
whole. Formats of ds4-server (docs/kv-format.md): `KV cache: hit for sha1=<sha1> (loaded <n> tokens)` and
`KV cache: miss for sha1=<sha1> (reason: ...)`.
"""
from __future__ import annotations

import os
import time


class Trace:
    def __init__(self, path: str, proc: str):
        self.path, self.proc = path, proc

    def __bool__(self) -> bool:
        return bool(self.path)

    def line(self, text: str) -> None:
        if not self.path:
            return
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        data = f"{stamp} {self.proc} {text}\n".encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        except OSError:
            pass   # tracing never takes a request down
