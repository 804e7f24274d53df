"""Socket addresses, all derived from one run directory so two servers can run side by side."""
from __future__ import annotations

import hashlib
import logging
import os
import stat

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
    _own_private(path)
    return path


def _own_private(path: str) -> None:
    """The run dir holds the sockets every process trusts: it must be a real directory of
    ours that no one else can enter (the default name is predictable, so someone may have
    made it first). Ours but loose: tightened to 0700 with a warning; anything else: refused."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise SystemExit(f"run directory {path} is not a directory (a symlink?); remove it or set --run-dir")
    if st.st_uid != os.getuid():
        raise SystemExit(f"run directory {path} belongs to uid {st.st_uid}, not to us ({os.getuid()}); "
                         "remove it or set --run-dir")
    if stat.S_IMODE(st.st_mode) & 0o077:
        logging.getLogger("ricordo").warning("run directory %s was mode %o; tightened to 700",
                                             path, stat.S_IMODE(st.st_mode))
        os.chmod(path, 0o700)


def address(s: Settings, name: str) -> str:
    return "ipc://" + os.path.join(run_dir(s), name + ".sock")


# Every socket and who is on it; the messages each carries: common/messages.py
RENDERER = "renderer"          # ROUTER, bound by the renderer; every web worker's DEALER connects (RendererIn / WebIn)
INFERENCE_JOBS = "inference"   # PULL, bound by inference; the renderer and the persister push (InferenceIn)
RENDERER_EVENTS = "events"     # PULL, bound by the renderer; inference and the persister push (EventsIn)
PERSISTER = "persister"       # PULL, bound by the persister; inference and the renderer push (PersisterIn)
