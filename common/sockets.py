"""Socket addresses, all derived from one run directory so two servers can run side by side."""
from __future__ import annotations

import hashlib
import os

from common.config import Settings


def run_dir(s: Settings) -> str:
    """The settings' run dir, or one per user and working directory (honcho starts every
    process of a Procfile in the same directory, and gives each a different PORT)."""
    if s.run_dir:
        path = s.run_dir
    else:
        tag = hashlib.sha1(os.path.realpath(os.getcwd()).encode()).hexdigest()[:10]
        path = os.path.join("/tmp", f"ricordo-{os.getuid()}-{tag}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def address(s: Settings, name: str) -> str:
    return "ipc://" + os.path.join(run_dir(s), name + ".sock")


RENDERER = "renderer"          # ROUTER, bound by the renderer; web workers connect
INFERENCE_JOBS = "inference"   # PULL, bound by inference; the renderer pushes jobs
RENDERER_EVENTS = "events"     # PULL, bound by the renderer; inference pushes events
PERSISTER = "persister"       # PULL, bound by the persister; inference pushes saves
