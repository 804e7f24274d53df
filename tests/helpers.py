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
