"""Weights as the native kernels read them (kernels.h's Mat): the packing of a dense or
quantized weight into int4, int8 or 5-bit groups (pack), and the struct that points at it.
native.py builds and calls the kernels; linear.py and the pack cache hold these."""
from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

GROUP = 32                                          # kernels.h GROUP
QROWS = 16                                          # kernels.h QROWS: int4 rows per block
ATT_CHUNK = 128                                     # kernels.h ATT_CHUNK: attention rows per task
MAT_F32, MAT_BF16, MAT_Q4, MAT_Q8, MAT_Q5 = range(5)       # kernels.h Mat kinds
QUANTIZED = (MAT_Q4, MAT_Q8, MAT_Q5)                         # kinds that are the weight's only copy
KIND_NAMES = ("f32", "bf16", "int4", "int8", "q5")          # by kind, for logs and the bench


class Mat(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("n", ctypes.c_int32), ("k", ctypes.c_int32), ("pad", ctypes.c_int32),
                ("w", ctypes.c_void_p), ("s", ctypes.c_void_p)]


class Packed(NamedTuple):
    """A weight as decode.c reads it: kind, the tensors holding it (kept alive here), and its
    rows when w holds more (int4's padded last block; 0: w's rows)."""
    kind: int
    w: torch.Tensor
    s: torch.Tensor | None
    n: int = 0

    def rows(self, start: int, count: int) -> "Packed":
        """Rows start..start+count-1 as a Packed of their own (views, no copy): whole blocks
        of QROWS for int4 and int8, whose blocks interleave their rows."""
        if self.kind in (MAT_Q4, MAT_Q8) and (start % QROWS or count % QROWS):
            raise ValueError(f"int4 and int8 rows are taken in blocks of {QROWS}")
        return Packed(self.kind, self.w[start:start + count], None if self.s is None else self.s[start:start + count],
                      count)

    def mat(self) -> Mat:
        num, den = {MAT_Q4: (2, 1), MAT_Q5: (8, 5)}.get(self.kind, (1, 1))   # values per stored byte/element
        n, k = self.n or self.w.shape[0], self.w.shape[1] * num // den
        return Mat(self.kind, n, k, 0, self.w.data_ptr(), 0 if self.s is None else self.s.data_ptr())


F16_MAX = 65504.0


def f16_fits(x: torch.Tensor) -> bool:
    """Whether every value of an f32 tensor is finite in f16 (NaN fails the comparison).
    Checked in f32: torch's isfinite on f16 is unvectorized on the CPU (18 ms a call on
    Gemma 3's packs, a second of its load)."""
    return x.numel() == 0 or bool(x.abs().amax() <= F16_MAX)


def q5_bytes(q: torch.Tensor) -> torch.Tensor:
    """int8 levels in [-16, 15] [N, K] as kernels.h's Q5 rows: [N, K/2 nibble bytes (Q4's
    layout) + K/GROUP uint32 of high bits, little-endian], in uint8 ops throughout."""
    n, k = q.shape
    u = (q.view(torch.uint8) + 16).view(n, k // GROUP, GROUP)     # level + 16 in [0, 31] (wraps exactly)
    qs = ((u[:, :, :16] & 15) | (u[:, :, 16:] << 4)).reshape(n, k // 2)
    hb = (u >> 4).view(n, k // GROUP, 4, 8)                       # bit j of the group: byte j/8, bit j%8
    bits = hb[..., 0].clone()
    for i in range(1, 8):
        bits |= hb[..., i] << i
    return torch.cat([qs, bits.view(n, k // GROUP * 4)], dim=1).contiguous()


def q4_blocks(q: torch.Tensor, sm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 levels q [N, K] (uint8, 0-15) and f16 sm [N, 2, K/32] (scales, mins) in kernels.h's
    Q4 layout (qdot.c): rows in blocks of QROWS (zero rows pad the last), then groups; a
    block's group is 4 chunks of QROWS x 4 bytes, byte (c, r, e) = value 4c+e of row r (low
    nibble) and value 16+4c+e (high). Returns w [N', K/2] uint8 and s [N', 2K/32] f16."""
    n, k = q.shape
    pad = -n % QROWS
    if pad:
        q = torch.cat([q.to(torch.uint8), q.new_zeros(pad, k, dtype=torch.uint8)])
        sm = torch.cat([sm, sm.new_zeros(pad, *sm.shape[1:])])
    nb, g = (n + pad) // QROWS, k // GROUP
    v = q.to(torch.uint8).view(nb, QROWS, g, 2, 4, 4)                   # block, row, group, half, c, e
    w = (v[:, :, :, 0] | (v[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)   # block, group, c, row, e
    s = sm.view(nb, QROWS, 2, g).permute(0, 3, 2, 1)                    # block, group, scale|min, row
    return w.contiguous().view(nb * QROWS, k // 2), s.contiguous().view(nb * QROWS, 2 * g)


def q8_blocks(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values q [N, K] and f16 scales d [N, K/32] in kernels.h's Q8 layout (qdot.c):
    blocks of QROWS rows (zero rows pad the last), then groups; a block's group is 8 chunks
    of QROWS x 4 bytes, byte (c, r, e) = value 4c+e of row r plus 128. Returns w [N', K]
    uint8 and s [N', K/32] f16."""
    n, k = q.shape
    pad = -n % QROWS
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        d = torch.cat([d, d.new_zeros(pad, d.shape[1])])
    nb, g = (n + pad) // QROWS, k // GROUP
    u = (q.contiguous().view(torch.uint8) ^ 128).view(nb, QROWS, g, 8, 4)   # + 128, mod 256
    w = u.permute(0, 2, 3, 1, 4)                                             # block, group, c, row, e
    return w.contiguous().view(nb * QROWS, k), d.view(nb, QROWS, g).transpose(1, 2).contiguous().view(nb * QROWS, g)


def pack(w: torch.Tensor | None, parts=None, int8: bool = False, q8=None) -> Packed | None:
    """w [N, K] (the dense weight, compute dtype) as decode reads it: int4 groups from a 4-bit
    source's parts (q uint8 [N, K], scale and min f32 [N, K/32]: its own levels; scale and min
    rounded to f16), int8 groups from a Q8_0 source's q8 (int8 [N, K], f16 scales [N, K/32]:
    the source itself; 5-bit groups when its levels fit, as a Q5_0 source's do), int8 groups
    of 32 with an f16 scale when int8 (a requantization of w), else w itself (bf16 or f32, no copy). w may be None when parts or q8 are given; then
    None is the answer when they cannot be used."""
    if q8 is not None:
        q, d = q8
        lo, hi = torch.aminmax(q) if q.numel() else (0, 99)
        if q.shape[1] % GROUP == 0 and int(lo) >= -16 and int(hi) <= 15:
            return Packed(MAT_Q5, q5_bytes(q), d.to(torch.float16).contiguous())
        return Packed(MAT_Q8, *q8_blocks(q, d.to(torch.float16)), n=q.shape[0])
    n, k = w.shape if w is not None else parts[0].shape
    if parts is not None and k % GROUP == 0:
        q, scale, mn = parts
        sm = torch.stack([scale, mn], dim=1)                                 # [N, 2, K/32]
        if f16_fits(sm):
            return Packed(MAT_Q4, *q4_blocks(q, sm.to(torch.float16)), n=n)
    if w is None:
        return None
    if int8 and k % GROUP == 0:
        q = torch.empty(n, k, dtype=torch.int8)
        s = torch.empty(n, k // GROUP, dtype=torch.float16)
        fits = True
        for a in range(0, n, 8192):          # in row blocks: transients of a block, not of w
            wg = w[a:a + 8192].to(torch.float32, copy=True).view(-1, k // GROUP, GROUP)   # divided in place
            sb32 = wg.abs().amax(dim=-1) / 127
            fits = fits and f16_fits(sb32)
            sb = sb32.to(torch.float16)
            sf = sb.float().unsqueeze(-1)
            q[a:a + 8192] = wg.div_(torch.where(sf > 0, sf, 1.0)).round_().clamp_(-127, 127).view(-1, k)
            s[a:a + 8192] = sb
        if fits:
            return Packed(MAT_Q8, *q8_blocks(q, s), n=n)
    w = w.contiguous()
    return Packed(MAT_BF16 if w.dtype == torch.bfloat16 else MAT_F32, w, None)
