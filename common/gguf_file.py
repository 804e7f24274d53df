"""Minimal GGUF reader: metadata and tensor views over one read-only mmap.

gguf.GGUFReader parses every metadata array element through numpy and takes ~4.6 s on
the default model's 49k-token vocabulary; this reader walks the same bytes with
struct in ~0.1 s. Tensor data stays in the mmap; dequantization is in
procs/inference/loader.py. Spec: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np

GGUF_MAGIC = b"GGUF"
_U64 = struct.Struct("<Q")

# metadata value types -> struct format (strings=8, arrays=9 handled apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
       6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}

# ggml tensor types we know the block geometry of: type -> (block elements, block bytes)
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
              6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34),
              10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
              13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 30: ("BF16", 1, 2),
              39: ("MXFP4", 32, 17)}


class GGUFError(ValueError):
    pass


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]   # ggml order: shape[0] is the fastest-varying (row length)
    type_id: int
    offset: int              # absolute file offset of the data
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.type_id][0]


class Skipped(tuple):
    """A string array not read (GGUFFile(strings=False)): its length only."""

    def __new__(cls, count: int):
        return super().__new__(cls)

    def __init__(self, count: int):
        self.count = count


class GGUFFile:
    def __init__(self, path: str, strings: bool = True):
        """strings=False: string arrays (the vocabulary, its merges) are stepped over, not
        read (Skipped): what the model loader and the context size need, in a fraction of the
        time for a 262k-token vocabulary."""
        self.path, self.read_strings = path, strings
        with open(path, "rb") as f:
            try:
                self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # empty file
                raise GGUFError(f"{path}: not a GGUF file ({e})") from None
        self.pos = 0
        if self._take(4) != GGUF_MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (bad magic)")
        (self.version,) = self._unpack("<I")
        if self.version not in (2, 3):
            raise GGUFError(f"{path}: unsupported GGUF version {self.version}")
        n_tensors, n_kv = self._unpack("<QQ")
        if n_tensors > 1 << 20 or n_kv > 1 << 20:
            raise GGUFError(f"{path}: implausible header counts")
        self.meta: dict[str, object] = {}
        for _ in range(n_kv):
            key = self._string()
            (vtype,) = self._unpack("<I")
            self.meta[key] = self._value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (ndim,) = self._unpack("<I")
            shape = self._unpack("<" + "Q" * ndim)
            (type_id, rel) = self._unpack("<IQ")
            infos.append((name, tuple(shape), type_id, rel))
        align = int(self.meta.get("general.alignment", 32))
        data_start = (self.pos + align - 1) // align * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, type_id, rel in infos:
            if type_id not in GGML_TYPES:
                raise GGUFError(f"{path}: tensor {name} has unsupported ggml type {type_id}")
            _, blk, bb = GGML_TYPES[type_id]
            n = int(np.prod(shape))
            nbytes = n // blk * bb
            off = data_start + rel
            if off + nbytes > len(self.mm):
                raise GGUFError(f"{path}: truncated (tensor {name} past end of file)")
            self.tensors[name] = TensorInfo(name, shape, type_id, off, nbytes)

    # -- byte walking --
    def _take(self, n: int) -> bytes:
        b = self.mm[self.pos:self.pos + n]
        if len(b) != n:
            raise GGUFError(f"{self.path}: truncated header")
        self.pos += n
        return b

    def _unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self._take(size))

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        return self._take(n).decode("utf-8", errors="replace")

    def _value(self, vtype: int):
        if vtype in _SCALARS:
            return self._unpack(_SCALARS[vtype])[0]
        if vtype == 8:
            return self._string()
        if vtype == 9:
            (etype, count) = self._unpack("<IQ")
            if etype in _NP:
                dt = np.dtype(_NP[etype])
                arr = np.frombuffer(self._take(count * dt.itemsize), dtype=dt)
                return arr
            if etype == 8:
                return self._strings(count)
            return [self._value(etype) for _ in range(count)]
        raise GGUFError(f"{self.path}: unknown metadata type {vtype}")

    def _strings(self, count: int) -> list[str]:
        """An array of strings (a vocabulary, its merges) in one tight loop: a GGUF's 262k
        tokens took 2 s through _string, ~0.1 s here."""
        mm, p, end, out = self.mm, self.pos, len(self.mm), []
        length = _U64.unpack_from
        keep = self.read_strings
        for _ in range(count):
            if p + 8 > end:
                raise GGUFError(f"{self.path}: truncated header")
            (n,) = length(mm, p)
            p += 8
            if p + n > end:
                raise GGUFError(f"{self.path}: truncated header")
            if keep:
                out.append(mm[p:p + n].decode("utf-8", errors="replace"))
            p += n
        self.pos = p
        return out if keep else Skipped(count)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a uint8 view into the mmap (no copy)."""
        t = self.tensors[name]
        return np.frombuffer(self.mm, dtype=np.uint8, count=t.nbytes, offset=t.offset)

    def release(self, name: str) -> None:
        """Drop the tensor's pages from this process's resident set (they are clean file
        pages: a later read maps them again), so a load's RSS holds what it built, not the file."""
        t = self.tensors[name]
        page = mmap.PAGESIZE
        a = -(-t.offset // page) * page
        b = (t.offset + t.nbytes) // page * page
        if b > a and hasattr(self.mm, "madvise"):
            self.mm.madvise(mmap.MADV_DONTNEED, a, b - a)

    def arch(self) -> str:
        return str(self.meta.get("general.architecture", ""))
