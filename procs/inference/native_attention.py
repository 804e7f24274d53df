"""The attention kernels' Python side: argument checks and calls into the built library
(procs/inference/native.py builds and loads it)."""
from __future__ import annotations

import ctypes

import torch

# the most query heads per K/V head and the largest head dim the kernels' task buffers hold:
# attention.c's MAXG, MAXD (decode, up to DeepSeek-V3's latent attention: 128 heads on one
# K/V head of 576) and prefill.c's
DECODE, PREFILL = (128, 576), (16, 256)


def _fits(limits: tuple[int, int], G: int, D: int) -> bool:
    return 1 <= G <= limits[0] and 1 <= D <= limits[1]


def _sinks(sinks: torch.Tensor | None, H: int) -> int | None:
    """The kernels' sinks argument: the address of H contiguous float32 logits, or NULL."""
    if sinks is None:
        return None
    if sinks.dtype != torch.float32 or not sinks.is_contiguous() or sinks.numel() != H:
        raise ValueError(f"sinks must be {H} contiguous float32 logits")
    return sinks.data_ptr()


def _check_kv(k: torch.Tensor, v: torch.Tensor, D: int, what: str) -> None:
    if k.dtype not in (torch.bfloat16, torch.float32) or k.stride(2) != 1 or k.stride(1) != D \
            or v.stride() != k.stride() or v.dtype != k.dtype:
        raise ValueError(f"native {what} attention needs bf16/f32 K/V with contiguous rows")


class DecodeAttention:
    """q [H, D] against k, v [KV, S, D] (views of the cache: rows contiguous, heads strided)
    -> [1, H*D] in q's dtype; sinks: float32 [H] or None (gpt-oss's). The same contract as
    torch_attention.decode_attention."""

    def __init__(self, lib: ctypes.CDLL):
        self.fn = lib.decode_attention
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] + [ctypes.c_int] * 4 + \
            [ctypes.c_float, ctypes.c_int] + [ctypes.c_void_p] * 3
        self.size = lib.decode_attention_scratch
        self.size.restype = ctypes.c_long
        self.size.argtypes = [ctypes.c_int] * 4
        self.scratch = torch.empty(0)

    @staticmethod
    def takes(G: int, D: int) -> bool:
        return _fits(DECODE, G, D)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        H, D = q.shape
        KV, S = k.shape[0], k.shape[1]
        _check_kv(k, v, D, "decode")
        need = self.size(KV, H // KV, D, S)
        if self.scratch.numel() < need:
            self.scratch = torch.empty(need * 2)    # grows geometrically with the context
        qf = q.float().contiguous()
        out = torch.empty(H * D)
        rc = self.fn(qf.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0), KV, H // KV, D, S,
                     scale, int(k.dtype == torch.bfloat16), _sinks(sinks, H), out.data_ptr(), self.scratch.data_ptr())
        if rc:
            raise ValueError(f"native decode attention does not take G={H // KV}, D={D}")
        return out.to(q.dtype).view(1, H * D)


class PrefillAttention:
    """q [T, H, D] at positions pos..pos+T-1 against k, v [KV, cap, D] (a layer's cache,
    rows 0..pos+T-1 written) -> [T, H*D] in q's dtype: causal, window > 0 a sliding window
    (kernels/prefill.c). Each row's bits do not depend on how the prompt was split. pairs:
    bf16 K/V multiplied as bf16 pairs where the kernels were built with them (q and the
    weights rounded to bf16), else widened to f32 (the f32 kernel's products on the same values).
    sinks: float32 [H] or None (gpt-oss's)."""

    def __init__(self, lib: ctypes.CDLL):
        self.fn = lib.prefill_attention
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] + [ctypes.c_int] * 7 + \
            [ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p]

    @staticmethod
    def takes(G: int, D: int) -> bool:
        return _fits(PREFILL, G, D)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, window: int,
                 scale: float, pairs: bool = True, sinks: torch.Tensor | None = None) -> torch.Tensor:
        T, H, D = q.shape
        KV = k.shape[0]
        _check_kv(k, v, D, "prefill")
        if k.shape[1] < pos + T:
            raise ValueError(f"the cache holds {k.shape[1]} rows, not the {pos + T} prefill attends to")
        qf = q.float().contiguous()
        out = torch.empty(T, H * D)
        kind = (1 if pairs else 2) if k.dtype == torch.bfloat16 else 0     # prefill.c's bf16 argument
        rc = self.fn(qf.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0), kind,
                     KV, H // KV, D, T, pos, window, scale, _sinks(sinks, H), out.data_ptr())
        if rc:
            raise ValueError(f"native prefill attention does not take G={H // KV}, D={D}")
        return out.to(q.dtype)
