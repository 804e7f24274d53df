"""Attention in torch's ops, for the paths that do not run the native kernels: the additive
mask of causal (and sliding-window) visibility, one decode row's grouped-heads product, and
the graphs' step of several rows of several sequences (the product, or torch's fused kernel:
graphs.GraphDecoder times both at start and keeps the faster).
"""
from __future__ import annotations

import statistics
import time

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
                      mask: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query row against S keys (the CPU's decode; graph_step.static_step's on any device):
    q [H, D], k and v [KV, S, D] -> [1, H*D];
    mask: float32 [S] added to the scores (graph_step.static_step's: -inf where a row is not to be seen);
    sinks: float32 [H] (gpt-oss's; sink_attention).
    The H/KV query heads that share a K/V head go as one small GEMM per K/V head. SDPA's CPU
    path for a single bf16 row is 4-15x slower (2 threads, avx512_bf16: 14.9 against 1.0 ms
    per layer at 23k keys; f32 alike), and at an agent's context attention is most of a
    decode step. Softmax in f32, as SDPA does."""
    H, D = q.shape
    KV = k.shape[0]
    if sinks is not None:
        return sink_attention(q.unsqueeze(0), k, v, None if mask is None else mask.view(1, -1), scale, sinks)
    s = torch.bmm(q.view(KV, H // KV, D), k.transpose(1, 2)).float() * scale  # [KV, G, S]
    if mask is not None:
        s = s + mask
    p = torch.softmax(s, dim=-1).to(v.dtype)
    return torch.bmm(p, v).view(1, H * D)


SINK_BLOCK = 1 << 24    # scores (f32) held at once by sink_attention: 64 MB


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                   sinks: torch.Tensor) -> torch.Tensor:
    """Attention whose softmax has one more logit per head, a learned sink that takes a
    share of the weight and gives no value (gpt-oss): q [T, H, D], k and v [KV, S, D], mask
    additive [T, S] or None, sinks float32 [H] -> [T, H*D]. No fused kernel takes the extra
    logit, so the scores are a tensor of their own, in blocks of query rows that hold at
    most SINK_BLOCK of them; softmax in f32."""
    T, H, D = q.shape
    KV, S = k.shape[0], k.shape[1]
    G = H // KV
    rows = max(1, SINK_BLOCK // (H * max(S, 1)))
    if T > rows:
        return torch.cat([sink_attention(q[a:a + rows], k, v, None if mask is None else mask[a:a + rows],
                                         scale, sinks) for a in range(0, T, rows)])
    qg = q.reshape(T, KV, G, D).permute(1, 2, 0, 3).reshape(KV, G * T, D)
    s = (torch.bmm(qg, k.transpose(1, 2)).float() * scale).view(KV, G, T, S)
    if mask is not None:
        s = s + mask
    sink = sinks.view(KV, G, 1, 1)
    top = torch.maximum(s.amax(-1, keepdim=True), sink)
    e = torch.exp(s - top)
    p = e / (e.sum(-1, keepdim=True) + torch.exp(sink - top))
    o = torch.bmm(p.to(v.dtype).view(KV, G * T, S), v)                          # [KV, G*T, D]
    return o.view(KV, G, T, D).permute(2, 0, 1, 3).reshape(T, H * D)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                      fused: bool) -> torch.Tensor:
    """B sequences' rows against their keys, a K/V head's G query heads as one block of rows:
    q [B, KV, G*T, D], k and v [B, KV, S, D] (any strides but the last) -> [B, KV, G*T, D].
    mask, additive (-inf: not seen): float32 [B, 1, 1, T, S] (shared by the G heads), or
    when fused q's dtype [B, 1, G*T, S] (grouped_mask).
    Not fused: the product, f32 scores and softmax as tensors of their own (B*H*T*S floats,
    written and read several times: at 512 rows x 8k keys, 150 MB a layer). Fused: torch's
    memory-efficient kernel, which keeps the scores on chip (flash attention takes no mask;
    neither fused kernel takes grouped K/V heads with a mask, hence the rows folded). On the
    CPU (tests) fused is torch's flash kernel, which takes a mask there."""
    if fused:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        kernel = SDPBackend.EFFICIENT_ATTENTION if q.device.type == "cuda" else SDPBackend.FLASH_ATTENTION
        with sdpa_kernel([kernel]):               # no silent fallback to the math path
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    B, KV, GT, S = *q.shape[:3], k.shape[2]
    T = mask.shape[-2]
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale                      # [B, KV, G*T, S]
    p = torch.softmax(s.view(B, KV, GT // T, T, S) + mask, dim=-1).to(v.dtype)
    return torch.matmul(p.view(B, KV, GT, S), v)


def grouped_mask(qpos: torch.Tensor, kpos: torch.Tensor, window: int, G: int, dtype, fused: bool) -> torch.Tensor:
    """grouped_attention's mask for query positions qpos [B, T] against keys kpos [S]."""
    B, T = qpos.shape
    if fused:
        rows = qpos.unsqueeze(1).expand(B, G, T).reshape(-1, 1)
        return causal_mask(rows, kpos, window, dtype).view(B, 1, G * T, -1)
    return causal_mask(qpos.reshape(-1, 1), kpos, window, torch.float32).view(B, 1, 1, T, -1)


def time_attention(fused: bool, B: int, KV: int, G: int, T: int, S: int, D: int, dtype, device,
                   reps: int = 5) -> float:
    """Median ms of grouped_attention on random rows, T queries of each of B sequences at the
    end of S keys (the shape a step's graph bakes in); raises where the fused kernel does not
    take the shape."""
    dev = torch.device(device)
    q = torch.randn(B, KV, G * T, D, dtype=dtype, device=dev)
    k = torch.randn(B, KV, S, D, dtype=dtype, device=dev)
    v = torch.randn(B, KV, S, D, dtype=dtype, device=dev)
    mask = grouped_mask(torch.arange(S - T, S, device=dev).expand(B, T), torch.arange(S, device=dev), 0, G,
                        dtype, fused)
    times = []
    for i in range(reps + 2):                     # two warm-ups
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        grouped_attention(q, k, v, mask, D ** -0.5, fused)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
