"""Logging set-up shared by every process: one line per event, process name first."""
from __future__ import annotations

import logging
import sys


def setup(proc: str, level: str = "info") -> logging.Logger:
    logging.basicConfig(stream=sys.stderr, level=getattr(logging, level.upper(), logging.INFO),
                        format=f"%(asctime)s {proc} %(levelname)s %(message)s")
    return logging.getLogger(proc)
