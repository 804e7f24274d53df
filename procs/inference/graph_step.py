"""The model's step with every shape fixed, as a CUDA graph needs (static_step: layers over
pools of K/V slots, attention under one mask), and the buckets that shapes are rounded up to
so that few graphs serve every step. graphs.py captures and replays it; tests run it eagerly."""
from __future__ import annotations

import torch

from procs.inference.linear import dense
from procs.inference.torch_attention import grouped_attention, grouped_mask

MIN_CAP = 512           # the smallest attended capacity; buckets double from it
MIN_ROWS = 16           # the smallest padded prefill; buckets double from it


def bucket(n: int, limit: int, least: int = MIN_CAP) -> int:
    """least times a power of two, at least n, at most max(limit, n): a growing conversation
    changes graphs O(log n) times."""
    cap = least
    while cap < n:
        cap *= 2
    return min(cap, max(limit, n))


def buckets(limit: int, least: int) -> list[int]:
    """Every value bucket(n, limit, least) takes for 1 <= n <= limit, in order."""
    out, c = [], least
    while c < limit:
        out.append(c)
        c *= 2
    return out + [limit]


@torch.inference_mode()
def static_step(model, ids: torch.Tensor, pos: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
                cap: int, fused: bool = False) -> torch.Tensor:
    """The model's layers with every shape fixed, as a CUDA graph needs: B sequences of T
    tokens each, ids [B*T] and pos [B, T] device tensors; sequence b's K/V is slot b of
    pool_k/pool_v [L, S, KV, C, D] (B <= S, max(pos) < cap <= C). K/V rows are written at
    their positions by index; attention is over rows < cap for all rows under one mask, a K/V
    head's query heads folded into its rows (torch_attention.grouped_attention: the product,
    or with fused the memory-efficient kernel). Every row there must be finite (see the
    invariants in graphs.py). The caller fills the rotary tables up to max(pos) first. Returns the final
    hidden rows [B*T, dim]."""
    c = model.cfg
    H, D = c.n_heads, c.head_dim
    L, S, KV, C, _ = pool_k.shape
    B, T = pos.shape
    G = H // KV
    dev = ids.device
    flat = pos.reshape(-1)
    x = model.embed_rows(ids)                                                  # [B*T, dim]
    if c.embed_scale:
        x = x * c.embed_scale
    ropes = [(cos[flat].unsqueeze(1), sin[flat].unsqueeze(1)) for cos, sin in model.rope]
    # row (slot b, head h, position pos[b, t]) of one layer's [S * KV * C, D], in (b, h, t) order
    at = ((torch.arange(B, device=dev).view(B, 1, 1) * KV + torch.arange(KV, device=dev).view(1, KV, 1)) * C
          + pos.unsqueeze(1)).reshape(-1)
    kpos = torch.arange(cap, device=dev)
    masks = {}     # window -> its mask (torch_attention.grouped_mask)

    def attend(li: int, ly, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kl, vl = pool_k[li], pool_v[li]                                        # [S, KV, C, D]
        kl.view(-1, D).index_copy_(0, at, k.reshape(B, T, KV, D).transpose(1, 2).reshape(-1, D))
        vl.view(-1, D).index_copy_(0, at, v.reshape(B, T, KV, D).transpose(1, 2).reshape(-1, D))
        if ly.window not in masks:
            masks[ly.window] = grouped_mask(pos, kpos, ly.window, G, q.dtype, fused)
        qg = q.reshape(B, T, KV, G, D).permute(0, 2, 3, 1, 4).reshape(B, KV, G * T, D)
        o = grouped_attention(qg, kl[:B, :, :cap], vl[:B, :, :cap], masks[ly.window], model.scale, fused)
        return o.view(B, KV, G, T, D).permute(0, 3, 1, 2, 4).reshape(B * T, H * D)
    return model._blocks(x, ropes, lambda f, h: f(h), dense, attend, model.q_scales(flat))
