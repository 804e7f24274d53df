"""Attention in torch's ops, for the paths that do not run the native kernels: the additive
mask of causal (and sliding-window) visibility, and one decode row's grouped-heads product.
"""
from __future__ import annotations

import torch


def causal_mask(qpos: torch.Tensor, kpos: torch.Tensor, window: int, dtype) -> torch.Tensor:
    """Additive mask [queries, keys]: query at absolute position p sees key j iff j <= p and,
    in a windowed layer, p - j < window (transformers' and llama.cpp's sliding window)."""
    kpos = kpos.unsqueeze(0)
    hidden = kpos > qpos
    if window:
        hidden |= kpos <= qpos - window
    return torch.zeros(hidden.shape, dtype=dtype, device=qpos.device).masked_fill_(hidden, float("-inf"))


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """One query row against S keys (the CPU's decode; graphs.static_step's on any device):
    q [H, D], k and v [KV, S, D] -> [1, H*D];
    mask: float32 [S] added to the scores (graphs.static_step's: -inf where a row is not to be seen).
    The H/KV query heads that share a K/V head go as one small GEMM per K/V head. SDPA's CPU
    path for a single bf16 row is 4-15x slower (2 threads, avx512_bf16: 14.9 against 1.0 ms
    per layer at 23k keys; f32 alike), and at an agent's context attention is most of a
    decode step. Softmax in f32, as SDPA does."""
    H, D = q.shape
    KV = k.shape[0]
    s = torch.bmm(q.view(KV, H // KV, D), k.transpose(1, 2)).float() * scale  # [KV, G, S]
    if mask is not None:
        s = s + mask
    p = torch.softmax(s, dim=-1).to(v.dtype)
    return torch.bmm(p, v).view(1, H * D)
