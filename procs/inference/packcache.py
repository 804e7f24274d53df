"""The native decoder's packed weights cached on disk, so a second start maps them instead of
making them again (dequantizing Q5_0 into int8 groups, fusing q/k/v and gate/up, packing
int4 nibbles: ~1.5 s of Qwen2.5-0.5B's load).

One file per (model file, its size and mtime, compute dtype, packing mode, the source of the
modules that make the packs): any change to one of them names another file, so a stale file
is never read; writing a file removes the others of the same model file name and dtype
(made by older code, or from an older copy of the model). The file is written once, whole, to a
temporary name and renamed, so a reader sees a complete file or none. Layout (JSON and raw bytes):

    MAGIC | u64 header length | header (JSON) | tensors, each at a multiple of ALIGN

header: {"version": 1, "size": total bytes, "entries": {key: [kind, w, s, n]}} with w and s
[dtype name, shape, offset] (s null when absent) and n the weight's rows (0: w's). A file whose header does not parse, or
whose size or any entry's extent disagrees with it, is ignored with a warning and rewritten.
Tensors come back as copy-on-write maps of the file: pages are read as decode first touches
them and shared with the page cache, never written.
"""
from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import struct
import tempfile
import time

import numpy as np
import torch

from procs.inference.packs import Packed

log = logging.getLogger("inference")

MAGIC = b"RICORDO-PACKED\n"
ALIGN = 64
# the modules whose code decides what a pack holds: a change to one of them is a new file
_SOURCES = ("packs.py", "native.py", "linear.py", "gguf_tensors.py", "loader.py", "hf_load.py", "weights.py",
            "model.py")
_DTYPES = {str(d).removeprefix("torch."): d for d in
           (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int32)}


def cache_file(directory: str, model_path: str, dtype: torch.dtype, packed: bool) -> str:
    """Where the packs of this model file, dtype and mode live (see the module doc)."""
    st = os.stat(model_path)
    h = hashlib.sha1()
    for part in (os.path.realpath(model_path), st.st_size, st.st_mtime_ns, str(dtype), packed):
        h.update(repr(part).encode() + b"\0")
    here = os.path.dirname(os.path.abspath(__file__))
    for name in _SOURCES:
        with open(os.path.join(here, name), "rb") as f:
            h.update(f.read())
    base = os.path.splitext(os.path.basename(model_path))[0]
    return os.path.join(directory, f"{base}.{str(dtype).removeprefix('torch.')}.{h.hexdigest()[:16]}.packed")


class PackCache:
    """Packs by key ("layers.3.wq+wk+wv", "head", ...): those the file holds, and those made
    during this load (`made`), which save() writes when the file held none."""

    def __init__(self, path: str = ""):
        self.path = path
        self.held: dict[str, Packed] = {}
        self.made: dict[str, Packed] = {}
        if path and os.path.exists(path):
            try:
                self.held = _read(path)
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("packed-weight cache %s unusable (%s): making the packs again", path, e)

    def get(self, key: str) -> Packed | None:
        return self.held.get(key)

    def put(self, key: str, p: Packed) -> None:
        if self.path and key not in self.held:
            self.made[key] = p

    def save(self) -> None:
        """Write the packs made in this load, when the file had none of them (a partial file is
        never extended: it is rewritten whole, from a load that made every pack)."""
        if not self.path or not self.made or self.held:
            return
        t0 = time.perf_counter()
        try:
            _write(self.path, self.made)
            log.info("packed weights cached for the next start: %s (%d MiB in %.2f s)", self.path,
                     os.path.getsize(self.path) >> 20, time.perf_counter() - t0)
            stem = self.path.rsplit(".", 2)[0] + "."
            for old in glob.glob(glob.escape(stem) + "*.packed"):
                if old != self.path and old.count(".") == self.path.count("."):
                    os.unlink(old)
        except OSError as e:
            log.warning("packed-weight cache %s not written: %s", self.path, e)
        self.made = {}


def _spec(t: torch.Tensor, offset: int) -> list:
    return [str(t.dtype).removeprefix("torch."), list(t.shape), offset]


def _write(path: str, packs: dict[str, Packed]) -> None:
    entries, tensors, offset = {}, [], 0

    def place(t: torch.Tensor | None):
        nonlocal offset
        if t is None:
            return None
        t = t.contiguous()
        spec = _spec(t, offset)
        tensors.append((offset, t))
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        return spec
    for key, p in packs.items():
        entries[key] = [int(p.kind), place(p.w), place(p.s), int(p.n)]
    # the header's own length is padded so the data starts at a multiple of ALIGN
    header = json.dumps({"version": 1, "size": offset, "entries": entries}).encode()
    start = -(-(len(MAGIC) + 8 + len(header)) // ALIGN) * ALIGN
    header += b" " * (start - len(MAGIC) - 8 - len(header))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".packed-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", len(header)) + header)
            for off, t in tensors:
                f.seek(start + off)
                f.write(t.view(torch.uint8).numpy().tobytes() if t.dtype == torch.bfloat16
                        else t.numpy().tobytes())
            f.truncate(start + offset)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _read(path: str) -> dict[str, Packed]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise ValueError("not a packed-weight file")
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size:
            raise ValueError("header longer than the file")
        head = json.loads(f.read(n))
    start = len(MAGIC) + 8 + n
    if head["version"] != 1 or start + head["size"] != size:
        raise ValueError(f"{size} bytes, the header says {start + head['size']}")
    data = np.memmap(path, dtype=np.uint8, mode="c", offset=start, shape=(head["size"],))
    whole = torch.from_numpy(data)

    def tensor(spec):
        if spec is None:
            return None
        dtype, shape, off = _DTYPES[spec[0]], spec[1], spec[2]
        nbytes = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
        if off < 0 or off % ALIGN or off + nbytes > head["size"]:
            raise ValueError(f"an entry at {off} (+{nbytes}) outside the data")
        return whole[off:off + nbytes].view(dtype).view(shape)
    return {key: Packed(int(kind), tensor(w), tensor(s), int(n)) for key, (kind, w, s, n) in head["entries"].items()}
