"""Signal handling for the process loops: a handler only sets a flag; the loop acts on it.
A second SIGTERM/SIGINT exits at once."""
from __future__ import annotations

import os
import signal


class StopFlag:
    def __init__(self):
        self.stop = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.stop:
            os._exit(128 + signum)
        self.stop = True

    def __bool__(self) -> bool:
        return self.stop
