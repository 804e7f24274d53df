"""Native CPU kernels for decode: C compiled here with the machine's gcc, once per source,
flags and CPU, cached on disk, loaded with ctypes.

- DecodeAttention, PrefillAttention (native_attention.py): decode's and prefill's attention
  over the K/V cache (kernels/attention.c, kernels/prefill.c).
- Decoder: a whole decode step (every layer and the output projection) in one call, on the
  weights in their packed form (kernels/decode.c; kernels/qdot.c for int4 and int8 weights,
  integer dot products on int8 activations; kernels/gemv.c for the rest): a torch step is
  ~1,000 small ops whose dispatch costs as much as the weight reads on a small model.
- DeltaStep (native_gdn.py): a Gated DeltaNet layer's decode step between its projections
  (kernels/gdn.c): the whole step's, and torch's step's where a model has no whole step.
  The whole step takes softmax-routed experts too (kernels/moe.c).

Built with -march=native, so the cache key includes the CPU's flags; a build that fails (no
compiler) leaves decode on torch's kernels with one warning, never a failed start.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

from common.config import _default_cache_root
from procs.inference.cpu import cpu_flags
from procs.inference.native_attention import DecodeAttention, PrefillAttention
from procs.inference.native_gdn import binder

log = logging.getLogger("ricordo.native")

DIR = Path(__file__).with_name("kernels")
SOURCES = ("attention.c", "prefill.c", "gemv.c", "qdot.c", "decode.c", "gdn.c", "moe.c")
HEADERS = ("kernels.h", "simd.h", "pairs.h")
# -fassociative-math (with what it requires) lets the dot products and sums vectorize; a build
# is still one fixed instruction sequence, so its results are deterministic.
# RICORDO_KERNEL_MARCH picks another target (haswell: the AVX2 paths on an AVX-512 machine;
# x86-64: the portable ones), for tests of the paths this CPU would not take.
MARCH = os.environ.get("RICORDO_KERNEL_MARCH", "native")
FLAGS = ["-O3", f"-march={MARCH}", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno",
         "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math"]
CC = os.environ.get("CC", "gcc")
GROUP = 32                                          # kernels.h GROUP
QROWS = 16                                          # kernels.h QROWS: int4 rows per block
ATT_CHUNK = 128                                     # kernels.h ATT_CHUNK: attention rows per task
MAT_F32, MAT_BF16, MAT_Q4, MAT_Q8, MAT_Q5 = range(5)       # kernels.h Mat kinds
QUANTIZED = (MAT_Q4, MAT_Q8, MAT_Q5)                         # kinds that are the weight's only copy
KIND_NAMES = ("f32", "bf16", "int4", "int8", "q5")          # by kind, for logs and the bench
ACTS = {"silu": 0, "gelu_tanh": 1}                  # decode.c ACT_*


def _build(cache_dir: Path) -> Path:
    src = b"".join((DIR / n).read_bytes() for n in (*SOURCES, *HEADERS))
    key = hashlib.sha1(src + " ".join([CC, *FLAGS, cpu_flags()]).encode()).hexdigest()[:16]
    out = cache_dir / f"kernels-{key}.so"
    if out.exists():
        return out
    cache_dir.mkdir(parents=True, exist_ok=True)
    # built beside its final name and renamed: a concurrent start never loads half a file
    fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run([CC, *FLAGS, "-o", tmp, *(str(DIR / n) for n in SOURCES), "-lm"],
                       check=True, capture_output=True, text=True)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


# ------------------------------------------------------------------ the C structs (kernels.h, decode.c)

class Mat(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("n", ctypes.c_int32), ("k", ctypes.c_int32), ("pad", ctypes.c_int32),
                ("w", ctypes.c_void_p), ("s", ctypes.c_void_p)]


class LayerW(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ("attn_norm", "bqkv", "q_norm", "k_norm", "post_attn_norm",
                                               "ffn_norm", "post_ffn_norm")] + \
               [(n, Mat) for n in ("qkv", "wo", "gu", "down")] + \
               [(n, ctypes.c_int32) for n in ("window", "rope", "kv", "gated")] + \
               [("gdn", ctypes.c_void_p), ("slot", ctypes.c_int32), ("pad", ctypes.c_int32), ("moe", ctypes.c_void_p)]


class MoeW(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in ("n", "k", "norm_topk", "ffn")] + \
               [("scale", ctypes.c_float), ("pad", ctypes.c_int32), ("router", Mat)] + \
               [(n, ctypes.c_void_p) for n in ("gu", "down", "sh_gate")]


class ModelW(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in ("n_layers", "dim", "H", "KV", "D", "ffn", "act", "kv_bf16",
                                              "rope_bf16", "pad")] + \
               [("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("cos", ctypes.c_void_p * 2), ("sin", ctypes.c_void_p * 2),
                ("layers", ctypes.POINTER(LayerW)), ("norm", ctypes.c_void_p), ("head", Mat),
                ("q_scale", ctypes.c_void_p), ("lin_in", ctypes.c_int32), ("lin_out", ctypes.c_int32),
                ("conv_slot", ctypes.c_long), ("ssm_slot", ctypes.c_long)]


class Packed(NamedTuple):
    """A weight as decode.c reads it: kind, the tensors holding it (kept alive here), and its
    rows when w holds more (int4's padded last block; 0: w's rows)."""
    kind: int
    w: torch.Tensor
    s: torch.Tensor | None
    n: int = 0

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


# ------------------------------------------------------------------ the kernels

class Decoder:
    """model.forward for one token at position pos, in one C call: ids [1], the session's
    caches [layers, KV, cap, D] -> float32 logits [1, V]. Built by Kernels.decoder for a model
    whose every Linear carries a Packed (model.Linear with native=True)."""

    def __init__(self, lib: ctypes.CDLL, model):
        c = model.cfg
        self.model = model
        self.batch_fn = lib.decode_batch
        self.batch_fn.restype = ctypes.c_int
        self.batch_fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p] + \
            [ctypes.c_void_p] * 10
        self.batch_size = lib.decode_batch_scratch
        self.batch_size.restype = ctypes.c_long
        self.batch_size.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        keep = self._keep = []              # f32 copies the structs point into

        def f32(t):
            if t is None:
                return None
            t = t.float().contiguous()
            keep.append(t)
            return t.data_ptr()
        layers = (LayerW * c.n_layers)()
        for ly, lw in zip(model.layers, layers):
            qn = kn = None
            if ly.qk_norm is not None:          # [H+KV, D]: one row per head, q's then k's
                qn, kn = ly.qk_norm[0], ly.qk_norm[c.n_heads]
            for name, t in (("attn_norm", ly.attn_norm), ("bqkv", ly.bqkv), ("q_norm", qn), ("k_norm", kn),
                            ("post_attn_norm", ly.post_attn_norm), ("ffn_norm", ly.ffn_norm),
                            ("post_ffn_norm", ly.post_ffn_norm)):
                setattr(lw, name, f32(t))
            for name, lin in (("qkv", ly.wqkv), ("wo", ly.wo), ("gu", ly.wgu), ("down", ly.wd)):
                if lin is not None:         # (experts alone: no dense MLP)
                    setattr(lw, name, lin.mat.mat())
            if ly.moe is not None:
                lw.moe = ctypes.addressof(self._moe(ly, f32))
            lw.window, lw.rope, lw.kv, lw.gated = ly.window, ly.rope, ly.kv, int(ly.gated)
            if ly.gdn is not None:      # its step's constants (gdn.c), as torch's decode path calls them
                lw.gdn, lw.slot = ctypes.addressof(ly.gdn.native.w), ly.gdn.slot
                keep.append(ly.gdn.native)      # the struct and the f32 copies it points into
        self._layers = layers
        ropes = [(cos.contiguous(), sin.contiguous()) for cos, sin in model.rope]
        keep.extend(t for pair in ropes for t in pair)
        ffn = max([c.ffn_dim] + [ly.wgu.mat.mat().n // 2 for ly in model.layers if ly.wgu is not None])  # scratch
        m = self.m = ModelW(c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim, ffn, ACTS[c.act],
                            int(model.dtype == torch.bfloat16), int(model.dtype == torch.bfloat16), 0,
                            c.norm_eps, model.scale)
        for i, (cos, sin) in enumerate(ropes + ropes[:1] * (2 - len(ropes))):
            m.cos[i], m.sin[i] = cos.data_ptr(), sin.data_ptr()
        m.layers = layers
        m.norm = f32(model.norm)
        m.head = model.head_mat.mat()
        # rounded to the compute dtype first, as the torch path multiplies by it
        m.q_scale = f32(None if model.q_scale is None else model.q_scale.to(model.dtype))
        if c.linear_layers:
            step = next(ly.gdn.native for ly in model.layers if ly.gdn is not None)
            m.lin_in, m.lin_out = step.width, step.w.nv * step.w.dv
            m.conv_slot, m.ssm_slot = step.state_values
        self.vocab = m.head.n
        self.scratch = torch.empty(0)

    def _moe(self, ly, f32) -> MoeW:
        """A layer's experts as moe.c reads them (kept alive with the decoder)."""
        moe = ly.moe
        router = pack(moe.router.contiguous())
        gu = (Mat * len(moe.gate_up))(*(lin.mat.mat() for lin in moe.gate_up))
        down = (Mat * len(moe.down))(*(lin.mat.mat() for lin in moe.down))
        w = MoeW(len(moe.gate_up), moe.k, int(moe.norm_topk), moe.down[0].mat.mat().k, moe.scale, 0, router.mat(),
                 ctypes.addressof(gu), ctypes.addressof(down),
                 f32(None if ly.sh_gate is None else ly.sh_gate.reshape(-1)))
        self._keep.extend([router, gu, down, w])
        return w

    def __call__(self, ids: torch.Tensor, pos: int, kc: torch.Tensor, vc: torch.Tensor, state=None) -> torch.Tensor:
        """One token of one sequence: the batch of one."""
        return self.batch(ids[:1], [pos], [(kc, vc)], states=[state])

    def batch(self, ids: torch.Tensor, pos: list[int], caches: list, share=None, states=None) -> torch.Tensor:
        """B tokens of B sequences in one call: ids [B], pos[b] and caches[b] = (kc, vc) of
        sequence b -> float32 logits [B, V], row b equal (bit for bit) to __call__ on it alone.
        The weights are read once for all rows (decode.c decode_batch). share[b] = (a, n):
        the first n rows (a multiple of ATT_CHUNK) of b's caches equal a's (a < b) bit for
        bit, so attention reads them once for both; (b, 0): none. states[b]: sequence b's
        gdn.Recurrent (a model with DeltaNet layers), advanced in place."""
        model, B = self.model, len(pos)
        model.ensure_rope(max(pos) + 1)
        for kc, vc in caches:
            if not (kc.is_contiguous() and vc.is_contiguous() and kc.stride() == vc.stride()
                    and kc.dtype == vc.dtype == model.dtype):
                raise ValueError("native decode needs contiguous caches in the compute dtype")
        x = model.embed_rows(ids)
        if model.cfg.embed_scale:
            x = x * model.cfg.embed_scale
        x = x.to(torch.float32, copy=True).contiguous()     # [B, dim]: decode_batch overwrites it, never the table's rows
        need = self.batch_size(ctypes.byref(self.m), B, max(pos) + 1)
        if self.scratch.numel() < need:
            self.scratch = torch.empty(need + need // 2)

        def arr(ctype, values):
            return (ctype * B)(*values)
        lead = shared = None
        if share is not None and any(n for _, n in share):
            if any(n % ATT_CHUNK or (n and not a < b) for b, (a, n) in enumerate(share)):
                raise ValueError(f"shared prefixes must be whole chunks of {ATT_CHUNK} of an earlier row")
            lead, shared = arr(ctypes.c_int, [a for a, _ in share]), arr(ctypes.c_int, [n for _, n in share])
        logits = torch.empty(B, self.vocab)
        rc = self.batch_fn(ctypes.byref(self.m), B, x.data_ptr(), arr(ctypes.c_int, pos),
                           arr(ctypes.c_void_p, [kc.data_ptr() for kc, _ in caches]),
                           arr(ctypes.c_void_p, [vc.data_ptr() for _, vc in caches]),
                           arr(ctypes.c_long, [kc.stride(0) for kc, _ in caches]),
                           arr(ctypes.c_long, [kc.stride(1) for kc, _ in caches]),
                           lead, shared, logits.data_ptr(), self.scratch.data_ptr(), *self._states(states, B))
        if rc:
            raise ValueError("native decode does not take this model's shapes")
        return logits

    def _states(self, states, B: int):
        """decode_batch's conv and ssm arrays (None, None for a model without DeltaNet layers)."""
        if not self.model.cfg.linear_layers:
            return None, None
        if not states or any(st is None for st in states):
            raise ValueError("native decode of a DeltaNet model needs each sequence's state")
        for st in states:
            if not (st.conv.is_contiguous() and st.ssm.is_contiguous() and st.conv.dtype == self.model.dtype):
                raise ValueError("native decode needs contiguous states, convolution inputs in the compute dtype")
        return ((ctypes.c_void_p * B)(*(st.conv.data_ptr() for st in states)),
                (ctypes.c_void_p * B)(*(st.ssm.data_ptr() for st in states)))


class Kernels:
    """The built library: attention for torch's decode path, decoder() for the whole step."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        self.attention = DecodeAttention(lib)
        self.prefill = PrefillAttention(lib)
        self.delta_step = binder(lib)      # layer, dtype -> a Gated DeltaNet's decode step
        one = lib.mat_vec_one
        one.restype = ctypes.c_int
        one.argtypes = [ctypes.POINTER(Mat)] + [ctypes.c_void_p] * 2
        self._mat_vec = one
        mm = lib.mat_mul
        mm.restype = ctypes.c_int
        mm.argtypes = [ctypes.POINTER(Mat), ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
                       ctypes.c_long]
        self._mat_mul = mm
        rows = lib.mat_rows
        rows.restype = None
        rows.argtypes = [ctypes.POINTER(Mat), ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_int]
        self._rows = rows
        self._scratch: dict = {}

    def rows(self, p: Packed, dtype: torch.dtype, ids: torch.Tensor | None = None,
             scratch: bool = False) -> torch.Tensor:
        """The rows ids (all rows when None) of a Packed weight as the values decode
        multiplies by, in dtype (bf16 or f32): [len(ids), K]. scratch: into a buffer shared by
        every call of that dtype (a prefill's weight, used at once and never kept)."""
        m = p.mat()
        n = m.n if ids is None else ids.numel()
        if scratch:
            buf = self._scratch.get(dtype)
            if buf is None or buf.numel() < n * m.k:
                buf = self._scratch[dtype] = torch.empty(n * m.k, dtype=dtype)
            out = buf[:n * m.k].view(n, m.k)
        else:
            out = torch.empty(n, m.k, dtype=dtype)
        idx = None if ids is None else ids.to(torch.int64).contiguous()
        self._rows(ctypes.byref(m), 0 if idx is None else idx.data_ptr(), n, out.data_ptr(),
                   int(dtype == torch.bfloat16))
        return out

    def mat_mul(self, p: Packed, x: torch.Tensor) -> torch.Tensor:
        """Y = X W^T for a few rows x [B, K] (f32 [B, N]): the decoder's own product (each
        weight row read once for all B; int8 activations for int4 and int8 groups), for the
        linears of a model the whole-step decoder declines (Linear.__call__)."""
        m = p.mat()
        xf = x.float().contiguous()
        y = torch.empty(xf.shape[0], m.n)
        if self._mat_mul(ctypes.byref(m), xf.shape[0], xf.data_ptr(), m.k, y.data_ptr(), m.n):
            raise MemoryError("mat_mul: no scratch memory")
        return y

    def mat_vec(self, p: Packed, x: torch.Tensor) -> torch.Tensor:
        """y = W x for one Packed weight (tests and benches of the packing)."""
        m = p.mat()
        xf = x.float().contiguous()
        y = torch.empty(m.n)
        if self._mat_vec(ctypes.byref(m), xf.data_ptr(), y.data_ptr()):
            raise MemoryError("mat_vec: no scratch memory")
        return y

    @staticmethod
    def takes(model) -> bool:
        c = model.cfg
        return (model.device.type == "cpu" and model.dtype in (torch.bfloat16, torch.float32)
                and (not c.n_experts or (c.moe_gating == "softmax" and c.act in ACTS))
                and not c.kv_lora and c.head_dim <= 256 and c.n_heads % c.n_kv_heads == 0
                and DecodeAttention.takes(c.n_heads // c.n_kv_heads, c.head_dim))

    def decoder(self, model) -> Decoder | None:
        # experts: packed (linear.experts), softmax-routed without biases (moe.c)
        experts = all(ly.moe is None or (ly.moe.packed and not ly.moe.sigmoid and ly.moe.router_b is None
                                         and ly.moe.gate_up_b is None and ly.moe.down_b is None)
                      for ly in model.layers)
        return Decoder(self.lib, model) if self.takes(model) and experts else None


@functools.lru_cache(maxsize=None)
def load(cache_root: str = "") -> Kernels | None:
    """The kernels, built if needed; None (with a warning) when they cannot be built or
    loaded. Must be called after torch is imported: the library links libgomp.so.1, which
    then resolves to torch's own OpenMP runtime (one thread pool, torch.set_num_threads)."""
    cache_dir = Path(cache_root or _default_cache_root()) / "kernels"
    try:
        lib = ctypes.CDLL(str(_build(cache_dir)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("native decode kernels unavailable (%s); decode uses torch's kernels",
                    detail.strip().splitlines()[-1] if detail.strip() else e)
        return None
    return Kernels(lib)


def decode_attention(cache_root: str = "") -> DecodeAttention | None:
    k = load(cache_root)
    return None if k is None else k.attention
