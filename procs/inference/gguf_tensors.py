"""A GGUF's tensors as torch tensors: dequantized (whole, or in row blocks straight into the
compute dtype), the parts the packed decode copies are made from (4-bit levels with scales
and mins; Q8_0 as stored), and Lazy, the map that makes them one at a time.

Each reader drops the tensor's file pages once read (GGUFFile.release).
"""
from __future__ import annotations

import numpy as np
import torch

from common.gguf_file import GGUFFile

# ggml types read by the decode kernels as int4 groups of 32 (their own levels, scales and
# mins: exact), and the other quantized types, which decode reads as int8 groups of 32 (approximate:
# a requantization of the dequantized weight, as fine as the source's 5-8 bits or finer)
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
INT8_TYPES = ("Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q5_K", "Q6_K")


def q4_parts(g: GGUFFile, name: str):
    """(q uint8 [N, K], scale f32 [N, K/32], min f32 [N, K/32]) with w = q * scale + min,
    exactly the tensor's values, for a type in INT4_TYPES (experts [E, N, K]: E * N rows)."""
    info = g.tensors[name]
    n, k = int(np.prod(info.shape[1:])), info.shape[0]
    if info.type_name == "Q4_K":
        return q4k_parts(g.raw(name), n, k)
    blocks = torch.from_numpy(g.raw(name).copy()).view(-1, 20 if info.type_name == "Q4_1" else 18)
    d = blocks[:, 0:2].contiguous().view(torch.float16).float().view(n, k // 32)
    off = 4 if info.type_name == "Q4_1" else 2
    qs = blocks[:, off:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1).reshape(n, k)
    if info.type_name == "Q4_1":
        mn = blocks[:, 2:4].contiguous().view(torch.float16).float().view(n, k // 32)
    else:
        mn = -8.0 * d
    return q, d, mn


def q4k_parts(raw: np.ndarray, n: int, k: int):
    """Q4_K super-blocks (256 values: f16 d and dmin, twelve bytes of 6-bit scales and mins
    for eight sub-blocks of 32, 128 bytes of nibbles) as groups of 32: value =
    q * (d * scale_j) - dmin * min_j, ggml's dequantize_row_q4_K."""
    b = raw.reshape(-1, 144)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, qs = b[:, 4:16], b[:, 16:]
    s = np.empty((b.shape[0], 8), np.uint8)
    m = np.empty((b.shape[0], 8), np.uint8)
    s[:, :4], m[:, :4] = sc[:, :4] & 63, sc[:, 4:8] & 63
    s[:, 4:] = (sc[:, 8:12] & 0xF) | ((sc[:, 0:4] >> 6) << 4)
    m[:, 4:] = (sc[:, 8:12] >> 4) | ((sc[:, 4:8] >> 6) << 4)
    q = qs.reshape(-1, 4, 32)      # 64 values per 32 bytes: low nibbles, then high nibbles
    q = np.stack([q & 0xF, q >> 4], axis=2).reshape(n, k)
    scale = (d * s).reshape(n, k // 32)
    mn = -(dmin * m).reshape(n, k // 32)
    return torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(mn)


ROW_BLOCK = 16384


def dequant_to(g: GGUFFile, name: str, dtype: torch.dtype) -> torch.Tensor:
    """dequant's tensor in dtype. A large matrix (an embedding of 262,144 rows) is done in
    blocks of rows written into the result, so the load holds one block in f32, not the whole
    tensor twice over (Gemma 3 270M: 0.7 GB of f32 per copy)."""
    info = g.tensors[name]
    shape = tuple(reversed(info.shape))
    if len(shape) != 2 or shape[0] <= ROW_BLOCK:
        return dequant(g, name).to(dtype)
    raw = g.raw(name)
    per_row = raw.size // shape[0]
    out = torch.empty(shape, dtype=dtype)
    for a in range(0, shape[0], ROW_BLOCK):
        b = min(a + ROW_BLOCK, shape[0])
        out[a:b] = dequant(g, name, raw[a * per_row:b * per_row], (b - a, shape[1]))
    return out


def dequant(g: GGUFFile, name: str, raw=None, shape=None) -> torch.Tensor:
    """Tensor in float32, shape in torch order ([rows, row_len]); raw and shape: a block of
    whole rows of it instead."""
    info = g.tensors[name]
    shape = shape or tuple(reversed(info.shape))
    raw = torch.from_numpy((g.raw(name) if raw is None else raw).copy())
    t = info.type_name
    if t == "F32":
        return raw.view(torch.float32).reshape(shape)
    if t == "F16":
        return raw.view(torch.float16).float().reshape(shape)
    if t == "BF16":
        return raw.view(torch.bfloat16).float().reshape(shape)
    if t in ("Q4_0", "Q4_1", "Q8_0"):
        bb = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[t]
        blocks = raw.view(-1, bb)
        d = blocks[:, 0:2].contiguous().view(torch.float16).float()           # [nb, 1]
        if t == "Q8_0":
            q = blocks[:, 2:].contiguous().view(torch.int8).float()          # [nb, 32]
            return (q * d).reshape(shape)
        off = 4 if t == "Q4_1" else 2
        qs = blocks[:, off:]                                                  # [nb, 16]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=1).float()                   # [nb, 32]
        if t == "Q4_1":
            m = blocks[:, 2:4].contiguous().view(torch.float16).float()
            return (q * d + m).reshape(shape)
        return ((q - 8) * d).reshape(shape)
    if t == "Q6_K":
        return _q6_k(raw).reshape(shape)
    if t == "Q5_0":
        return _q5_0(raw).reshape(shape)
    if t == "MXFP4":
        return _mxfp4(raw).reshape(shape)
    from gguf.quants import dequantize   # the other K-quants and the rest: slower, but correct
    from gguf.constants import GGMLQuantizationType
    arr = dequantize(raw.numpy().reshape(shape[0], -1), GGMLQuantizationType(info.type_id))
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(shape)


# MXFP4's e2m1 levels by nibble (OCP microscaling; the scale byte is a power of two, 2^(s-127))
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_rows(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """An HF MXFP4 tensor (blocks uint8 [..., rows, G, 16], two values a byte, the low nibble
    first; scales uint8 [..., rows, G]) as f32 [..., rows, G * 32]."""
    lut = torch.tensor(E2M1)
    vals = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)   # [..., G, 16, 2]
    vals = vals.flatten(-2) * torch.exp2(scales.float() - 127).unsqueeze(-1)                # [..., G, 32]
    return vals.flatten(-2)


def mxfp4_scale(sbytes: torch.Tensor, name: str) -> torch.Tensor:
    """MXFP4 block scale bytes as f16 halves of their powers of two, 2^(s - 128), the scale of
    the doubled (integer) levels: exact in f16 from 2^-24 to 2^15; a scale below (values under
    1e-6) becomes 0, one above (values over 2^18) cannot be a trained weight's."""
    d = torch.exp2(sbytes.float() - 128)
    if bool((d > 2.0 ** 15).any()):
        raise ValueError(f"{name}: an MXFP4 block scale past f16's range")
    return d.to(torch.float16)


def mxfp4_levels(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """An HF MXFP4 tensor (mxfp4_rows' layout) as q8_parts gives a GGUF's: (q int8 [rows, K],
    the e2m1 values doubled, integers in [-12, 12]; scale f16 [rows, K/32]), leading dims
    (experts) folded into the rows."""
    lut = torch.tensor([int(2 * v) for v in E2M1], dtype=torch.int8)
    q = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)    # [..., G, 16, 2]
    rows = int(np.prod(blocks.shape[:-2]))
    return q.reshape(rows, -1), mxfp4_scale(scales, name).reshape(rows, -1)


def _mxfp4(raw: torch.Tensor) -> torch.Tensor:
    """GGUF's MXFP4 blocks (17 bytes: the scale byte, then 16 bytes whose low nibbles are
    values 0-15 and high nibbles 16-31) -> float32 [blocks, 32], the gguf package's values."""
    b = raw.view(-1, 17)
    lut = torch.tensor(E2M1)
    qs = b[:, 1:]
    vals = torch.cat([lut[(qs & 0x0F).long()], lut[(qs >> 4).long()]], dim=1)
    return vals * torch.exp2(b[:, :1].float() - 127)


# source types whose blocks of 32 are exactly int8 levels times one f16 scale (q8_parts)
EXACT_INT8_TYPES = ("Q8_0", "Q5_0", "MXFP4")


def q8_parts(g: GGUFFile, name: str):
    """(q int8 [N, K], scale f16 [N, K/32]) of a Q8_0, Q5_0 or MXFP4 tensor, exactly its values:
    Q8_0's blocks as stored, Q5_0's levels q - 16 (in [-16, 15]) with the block's d, MXFP4's
    e2m1 values doubled (integers in [-12, 12]) with half the block's power of two (experts
    [E, N, K]: E * N rows)."""
    info = g.tensors[name]
    n, k = int(np.prod(info.shape[1:])), info.shape[0]
    raw = torch.from_numpy(g.raw(name).copy())
    if info.type_name == "MXFP4":
        b = raw.view(-1, 17)
        lut = torch.tensor([int(2 * v) for v in E2M1], dtype=torch.int8)
        q = torch.cat([lut[(b[:, 1:] & 0x0F).long()], lut[(b[:, 1:] >> 4).long()]], dim=1)
        return q.view(n, k), mxfp4_scale(b[:, 0], name).view(n, k // 32)
    if info.type_name == "Q5_0":
        d, q = _q5_0_levels(raw)
        return q.to(torch.int8).view(n, k), d.view(n, k // 32)
    blocks = raw.view(-1, 34)
    return (blocks[:, 2:].contiguous().view(torch.int8).view(n, k),
            blocks[:, 0:2].contiguous().view(torch.float16).view(n, k // 32))


class Lazy(dict):
    """A dict whose values may be made when first read (later(name, make)): a model built
    from a GGUF dequantizes one layer's tensors at a time and drops them once packed, so a
    load never holds every weight dense at once. Membership and iteration see every name.

    Invariant: no read returns an unmade value (the None placeholder): [], get, pop,
    values(), items(), copy(), and dict(lazy) / {**lazy} (which go through keys() and []
    because __iter__ is overridden, not dict's C fast path) all make what they yield."""

    def __init__(self):
        super().__init__()
        self._make = {}

    def later(self, name: str, make) -> None:
        self._make[name] = make
        super().__setitem__(name, None)

    def __getitem__(self, name):
        make = self._make.pop(name, None)
        if make is not None:
            super().__setitem__(name, make())
        return super().__getitem__(name)

    def get(self, name, default=None):
        return self[name] if name in self else default

    def __iter__(self):
        return super().__iter__()

    def values(self):
        return [self[k] for k in list(super().keys())]

    def items(self):
        return [(k, self[k]) for k in list(super().keys())]

    def copy(self):
        return dict(self.items())

    def __delitem__(self, name):
        self._make.pop(name, None)
        super().__delitem__(name)

    def pop(self, name, *default):
        if name not in self:
            if default:
                return default[0]
            raise KeyError(name)
        v = self[name]
        del self[name]
        return v


def _q6_k(raw: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks (210 bytes: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, an
    f16 d) -> float32 [blocks, 256]: the gguf package's arithmetic (d * scale, times q - 32,
    in f32), so the values are the same bit for bit, in torch's threaded ops (Gemma 3's
    embedding: 0.47 s -> ~0.1 s of a load)."""
    b = raw.view(-1, 210)
    nb = b.shape[0]
    ql = b[:, :128].reshape(nb, 2, 1, 64)
    ql = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(nb, 8, 32)
    qh = b[:, 128:192].reshape(nb, 2, 1, 32)
    qh = torch.cat([qh & 3, (qh >> 2) & 3, (qh >> 4) & 3, qh >> 6], dim=2).reshape(nb, 8, 32)
    q = ((ql | (qh << 4)).view(torch.int8) - 32).reshape(nb, 16, 16).float()
    scales = b[:, 192:208].contiguous().view(torch.int8).float()            # [nb, 16]
    d = b[:, 208:210].contiguous().view(torch.float16).float()              # [nb, 1]
    return ((d * scales).reshape(nb, 16, 1) * q).reshape(nb, 256)


def _q5_0_levels(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q5_0 blocks (22 bytes: an f16 d, 32 high bits, 16 bytes of low nibbles) -> (d f16
    [blocks, 1], levels q - 16 int8 [blocks, 32]). In uint8 throughout: a quarter of int32's
    memory traffic (81 such tensors in Gemma 3's Q4_K_M file)."""
    b = raw.view(-1, 22)
    d = b[:, 0:2].contiguous().view(torch.float16)                          # [nb, 1]
    qh = b[:, 2:6].unsqueeze(-1)                                            # [nb, 4, 1]: bit j is value j's
    high = ((qh >> torch.arange(8, dtype=torch.uint8)) & 1).view(-1, 32)    # [nb, 32]
    qs = b[:, 6:22]
    low = torch.cat([qs & 0x0F, qs >> 4], dim=1)                            # [nb, 32]
    return d, (low | (high << 4)).view(torch.int8) - 16


def _q5_0(raw: torch.Tensor) -> torch.Tensor:
    """Q5_0 blocks -> float32 [blocks, 32], the gguf package's arithmetic (d times q - 16, in
    f32). llama.cpp's Q4_K_M stores a Gemma 3's rows of 640 this way (not a multiple of
    K-quants' 256)."""
    d, q = _q5_0_levels(raw)
    return d.float() * q.float()
