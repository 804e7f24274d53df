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
  The whole step takes experts too (kernels/moe.c: softmax- or sigmoid-routed, gpt-oss's
  biases and clamped SwiGLU), attention sinks (attention.c) and latent attention (decode.c's
  mla_layer: DeepSeek, GLM-4.7-Flash).

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

import torch

from common.config import _default_cache_root
from procs.inference.cpu import cpu_flags
from procs.inference.native_attention import DecodeAttention, PrefillAttention
from procs.inference.moe import SwigluOai
from procs.inference.native_gdn import binder
from procs.inference.packs import (ATT_CHUNK, GROUP, KIND_NAMES, MAT_BF16, MAT_F32, MAT_Q4, MAT_Q5,  # noqa: F401
                                   MAT_Q8, QROWS, QUANTIZED, Mat, Packed, f16_fits, pack, q8_blocks)

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
ACTS = {"silu": 0, "gelu_tanh": 1, "swiglu_oai": 2}  # kernels.h ACT_*


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

class LayerW(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ("attn_norm", "bqkv", "q_norm", "k_norm", "post_attn_norm",
                                               "ffn_norm", "post_ffn_norm")] + \
               [(n, Mat) for n in ("qkv", "wo", "gu", "down")] + \
               [(n, ctypes.c_int32) for n in ("window", "rope", "kv", "gated")] + \
               [("gdn", ctypes.c_void_p), ("slot", ctypes.c_int32), ("pad", ctypes.c_int32), ("moe", ctypes.c_void_p),
                ("bo", ctypes.c_void_p), ("sinks", ctypes.c_void_p), ("mla", ctypes.c_void_p)]


class MlaW(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in ("r", "rope", "nope", "v", "q_lora", "pad")] + \
               [("q_a_norm", ctypes.c_void_p), ("kv_a_norm", ctypes.c_void_p), ("wq_b", Mat),
                ("uk", ctypes.c_void_p), ("uv", ctypes.c_void_p)]


class MoeW(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in ("n", "k", "norm_topk", "ffn")] + \
               [("scale", ctypes.c_float), ("sigmoid", ctypes.c_int32), ("router", Mat)] + \
               [(n, ctypes.c_void_p) for n in ("gu", "down", "sh_gate")] + \
               [("groups", ctypes.c_int32), ("groups_used", ctypes.c_int32), ("alpha", ctypes.c_float),
                ("limit", ctypes.c_float)] + \
               [(n, ctypes.c_void_p) for n in ("router_b", "score_b", "gu_b", "down_b")]


class ModelW(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in ("n_layers", "dim", "H", "KV", "D", "ffn", "act", "kv_bf16",
                                              "rope_bf16", "pad")] + \
               [("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("cos", ctypes.c_void_p * 2), ("sin", ctypes.c_void_p * 2),
                ("layers", ctypes.POINTER(LayerW)), ("norm", ctypes.c_void_p), ("head", Mat),
                ("q_scale", ctypes.c_void_p), ("lin_in", ctypes.c_int32), ("lin_out", ctypes.c_int32),
                ("conv_slot", ctypes.c_long), ("ssm_slot", ctypes.c_long)]


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
                            ("post_ffn_norm", ly.post_ffn_norm), ("bo", ly.bo), ("sinks", ly.sinks)):
                setattr(lw, name, f32(t))
            for name, lin in (("qkv", ly.wqkv), ("wo", ly.wo), ("gu", ly.wgu), ("down", ly.wd)):
                if lin is not None:         # (experts alone: no dense MLP)
                    setattr(lw, name, lin.mat.mat())
            if ly.moe is not None:
                lw.moe = ctypes.addressof(self._moe(ly, f32))
            if ly.mla is not None:
                lw.mla = ctypes.addressof(self._mla(ly.mla, f32))
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
        oai = moe.act if isinstance(moe.act, SwigluOai) else SwigluOai(0.0, 0.0)
        w = MoeW(len(moe.gate_up), moe.k, int(moe.norm_topk), moe.down[0].mat.mat().k, moe.scale, int(moe.sigmoid),
                 router.mat(), ctypes.addressof(gu), ctypes.addressof(down),
                 f32(None if ly.sh_gate is None else ly.sh_gate.reshape(-1)), *moe.groups,
                 oai.alpha, oai.limit, f32(moe.router_b), f32(moe.score_bias), f32(moe.gate_up_b),
                 f32(moe.down_b))
        self._keep.extend([router, gu, down, w])
        return w

    def _mla(self, mla, f32) -> MlaW:
        """A latent-attention layer's constants as decode.c's mla_layer reads them: each head's
        W_UK and W_UV rows as mla.heads holds them (packed groups, or views of the dense rows)."""
        uks, uvs = ((Mat * mla.H)(*(lin.mat.mat() for lin in hs)) for hs in (mla.uk, mla.uv))
        w = MlaW(mla.r, mla.rope, mla.nope, mla.v, mla.q_lora, 0, f32(mla.q_a_norm), f32(mla.kv_a_norm),
                 mla.wq_b.mat.mat() if mla.wq_b is not None else Mat(), ctypes.addressof(uks), ctypes.addressof(uvs))
        self._keep.extend([uks, uvs, w])
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
        return (model.device.type == "cpu" and model.dtype in (torch.bfloat16, torch.float32) and c.act in ACTS
                and c.n_heads % c.n_kv_heads == 0 and DecodeAttention.takes(c.n_heads // c.n_kv_heads, c.head_dim))

    def decoder(self, model) -> Decoder | None:
        # experts: packed (linear.experts), as moe.c reads them
        experts = all(ly.moe is None or ly.moe.packed for ly in model.layers)
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
