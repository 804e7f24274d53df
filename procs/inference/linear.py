"""A weight as the model uses it: Linear holds the dense weight and/or the packed copy decode
reads (torch's int4/int8 packs, or the native kernels' groups), fuse() concatenates a layer's
projections, pack_source() packs one tensor from its quantized parts when it has them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from procs.inference.cpu import f32_gemms_split
from procs.inference.packs import MAT_Q4, MAT_Q5, MAT_Q8, QUANTIZED, pack

# Decode (a few rows) is bound by weight bytes read: it reads weight-only packed copies, 4-bit
# (int4 groups of 32) or 8-bit (int8 rows), 2-4x fewer bytes than bf16 and up to 8x fewer than
# f32. Prefill is compute-bound and keeps the dense matmul.
PACKED_MAX_ROWS = 4
# f32 GEMMs with a short inner dimension run faster on some CPUs in blocks of output features
# (cpu.f32_gemms_split says where; on an AVX2-only AMD EPYC a 576x576 one 73 -> 122 GFLOP/s,
# K >= 1536 gains nothing). A block's rows are the same dot products over the same K, and the
# split depends on the weight's shape and the CPU only, so a row's value still does not depend
# on how many rows the call has.
SPLIT_N, SPLIT_MAX_K = 384, 1024
# An expert's rows in a prefill are few (a chunk's tokens spread over the experts), and
# dequantizing an expert for a GEMM costs more than the kernels' product up to this many rows
# (Xeon, a 896x1024 expert, medians: int4 64 rows 0.44 ms against 0.76, int8 0.47 against
# 1.26; Q5's 5-bit groups, which have no integer product, break even near 24 rows). Their
# products take int8 activations, as decode's do (and llama.cpp's prefill).
EXPERT_ROWS = {MAT_Q4: 64, MAT_Q8: 64, MAT_Q5: 16}


def dense(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w[N, K].T, in blocks of SPLIT_N output features where that is faster."""
    n, k = w.shape
    if x.dtype != torch.float32 or x.device.type != "cpu" or k > SPLIT_MAX_K or n <= SPLIT_N \
            or x.shape[0] <= PACKED_MAX_ROWS or not f32_gemms_split():
        return F.linear(x, w)
    return torch.cat([F.linear(x, w[i:i + SPLIT_N]) for i in range(0, n, SPLIT_N)], dim=1)


class Linear:
    """A dense weight in the compute dtype and, on the CPU, a packed copy decode reads: int4
    for a 4-bit source (its own levels, scales and mins: exact), int8 per row for another
    quantized source (a requantization no coarser than the source). torch's packed kernels
    take bf16 activations, whatever the compute dtype: decode rows are bf16-rounded at the
    linears (prefill rows are not; the server never compares the two)."""

    def __init__(self, w: torch.Tensor | None, parts=None, int8: bool = False, packed: bool = True,
                 kernels=None, dtype=None, q8=None):
        """kernels (procs/inference/native.Kernels): the copy is the native decoder's
        (native.pack: int4 or int8 groups, or the dense weight itself when not packed), and a
        quantized copy is the only one: prefill reads its values (w, dequantized per call
        into a shared buffer) instead of a second, dense copy beside it; w may then be None
        (dtype: the compute dtype)."""
        self._w, self.kernels, self.dtype = w, kernels, dtype if w is None else w.dtype
        self.rows = PACKED_MAX_ROWS     # the most rows the kernels' product takes (else a GEMM)
        self.packed, self.kind, self.mat = None, "", None
        if kernels is not None:
            self.mat = pack(w, parts if packed else None, int8 and packed, q8 if packed else None)
            if self.mat is None:   # parts past f16's range: the dense weight after all
                q, scale, mn = parts
                self._w = (q.float() * scale.repeat_interleave(32, 1) + mn.repeat_interleave(32, 1)).to(dtype)
                self.mat = pack(self._w)
            if self.mat.kind in QUANTIZED:
                self._w = None
            return
        if not packed or w.device.type != "cpu":
            return
        # torch's int4 packing takes rows in multiples of 16 (a tiny model's may not be)
        if parts is not None and hasattr(torch, "_weight_int4pack_mm_for_cpu") and parts[0].shape[0] % 16 == 0:
            q, scale, mn = parts                                # [N, K], [N, K/32] x2
            self.packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
            # torch's int4 dequant is (q - 8) * scale + zero, ours q * scale + min
            self.sz = torch.stack([scale.t(), (mn + 8 * scale).t()], dim=-1).to(torch.bfloat16).contiguous()
            self.kind = "int4"
        elif int8 and hasattr(torch, "_weight_int8pack_mm"):
            wf = w.float()
            scale = (wf.abs().amax(dim=1).clamp_min(1e-30) / 127).to(torch.bfloat16)
            self.packed = torch.round(wf / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
            self.sz = scale
            self.kind = "int8"

    @classmethod
    def of(cls, mat, kernels, dtype) -> "Linear":
        """The Linear of a quantized native pack made by an earlier load (packcache)."""
        lin = cls(None, kernels=None, dtype=dtype, packed=False)
        lin.kernels, lin.mat = kernels, mat
        return lin

    @property
    def w(self) -> torch.Tensor:
        """The dense weight [N, K] in the compute dtype (from the packed copy: valid until the
        next Linear's w)."""
        return self.weight(self.dtype)

    def weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense weight [N, K] in dtype: a quantized copy dequantized straight into it
        (valid until the next Linear's weight of that dtype), a dense one converted."""
        if self._w is not None:
            return self._w.to(dtype)
        return self.kernels.rows(self.mat, dtype, scratch=True)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._w is None and x.shape[0] <= self.rows:   # a quantized native copy, decode-sized
            return self.kernels.mat_mul(self.mat, x).to(x.dtype)
        if self.packed is not None and x.shape[0] <= PACKED_MAX_ROWS:
            xb = x.to(torch.bfloat16)
            if self.kind == "int4":
                return torch._weight_int4pack_mm_for_cpu(xb, self.packed, 32, self.sz).to(x.dtype)
            return torch._weight_int8pack_mm(xb, self.packed, self.sz).to(x.dtype)
        return dense(x, self.w)


def _rows(w: torch.Tensor) -> torch.Tensor:
    """A weight as rows: per-head matrices [H, N, K] (latent attention's) as H * N rows."""
    return w.reshape(-1, w.shape[-1])


def fuse(names, t, q4, q8, packed: bool, kernels, q8p=None) -> Linear:
    """Weights concatenated along the output dim: int4 when every part has 4-bit parts, int8
    groups as stored when every part has exact int8 parts (Q8_0, Q5_0; native kernels only),
    int8 when every part is quantized (a 4-bit part requantized with the rest), else dense."""
    if kernels is not None and packed and q8p and all(n in q8p for n in names):
        parts = tuple(torch.cat(xs) for xs in zip(*(q8p[n] for n in names)))
        return Linear(None, packed=packed, kernels=kernels, dtype=t["norm"].dtype, q8=parts)
    if all(n in q4 for n in names):
        parts = tuple(torch.cat(xs) for xs in zip(*(q4[n] for n in names)))
        # the native copy from the parts is the only one: no dense weight to make
        w = None if kernels is not None and packed else torch.cat([_rows(t[n]) for n in names]).contiguous()
        return Linear(w, parts, packed=packed, kernels=kernels, dtype=t["norm"].dtype)
    w = torch.cat([_rows(t[n]) for n in names]).contiguous()
    return Linear(w, int8=all(n in q4 or n in q8 for n in names), packed=packed, kernels=kernels)


def experts(names, n: int, t, q4, q8, packed: bool, kernels, q8p=None, cache=None, key: str = "") -> list[Linear]:
    """One Linear per expert of the expert tensors `names` ([E, N, K] each, concatenated along
    N: gate|up, or down), made as fuse() makes a layer's from each expert's rows: the
    kernels' packs of a quantized source's groups as stored where they can be, so the
    experts take about the bytes the file gives them (a dense copy of Qwen3-30B-A3B's is
    61 GB, its Q4_K_M file 18). cache (PackCache): the packs of an earlier load, f"{key}.{e}"."""
    dtype = t["norm"].dtype
    made = [cache.get(f"{key}.{e}") if cache else None for e in range(n)]
    if all(m is not None for m in made):        # the sources are never read (their loads are lazy)
        out = [Linear.of(m, kernels, dtype) for m in made]
    else:
        out = _make_experts(names, n, t, q4, q8, packed, kernels, q8p, cache, key)
    for lin in out:
        lin.rows = EXPERT_ROWS.get(lin.mat.kind, PACKED_MAX_ROWS)
    return out


def _make_experts(names, n, t, q4, q8, packed, kernels, q8p, cache, key) -> list[Linear]:
    mode = "q8" if packed and q8p and all(x in q8p for x in names) else \
        "q4" if packed and all(x in q4 for x in names) else "dense"
    src = {x: (q8p if mode == "q8" else q4 if mode == "q4" else t)[x] for x in names}
    # dense: fuse() sees q4 for membership only (int8 groups when every part is quantized),
    # never when it would take its parts (all in q4, packed off), which are the whole layer's
    member = {} if all(x in q4 for x in names) else q4
    out = []
    for e in range(n):
        if mode == "dense":
            lin = fuse(names, {"norm": t["norm"], **{x: w[e] for x, w in src.items()}}, member, q8, packed, kernels)
        else:
            rows = {x: tuple(part.view(n, -1, part.shape[-1])[e] for part in parts) for x, parts in src.items()}
            lin = fuse(names, {"norm": t["norm"]}, rows if mode == "q4" else {}, q8, packed, kernels,
                       rows if mode == "q8" else None)
        if cache and lin.mat is not None and lin.mat.kind in QUANTIZED:
            cache.put(f"{key}.{e}", lin.mat)
        out.append(lin)
    return out


def pack_source(t, name: str, q4, q8, q8p, packed: bool):
    """native.Packed for one source tensor, from its quantized parts when it has them (no
    dense copy made), else from the dense tensor."""
    if packed and (name in q4 or name in q8p):
        p = pack(None, q4.get(name), q8=q8p.get(name))
        if p is not None:
            return p
    return pack(t[name], None, packed and name in q8)
