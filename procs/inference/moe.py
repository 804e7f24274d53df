"""A mixture-of-experts MLP (Qwen3 MoE): a router picks k of E SiLU-gated experts per token.

Only the chosen experts' weights are read: the (token, choice) pairs are grouped by expert
and each expert that some token chose runs once on its tokens' rows, so a decode step reads
k experts and a prefill at most min(E, T * k). Each token's k outputs land in their own
slots and are summed in choice order, so a row's result does not depend on which other
tokens share the call (exact mode's promise, with its padded matmul).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

# mm(x [n, in], w [out, in]) -> [n, out]: the forward pass's matmul (exact mode pads rows)
MatMul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class MoE:
    def __init__(self, router: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                 k: int, norm_topk: bool):
        """router [E, dim]; gate and up [E, ffn, dim]; down [E, dim, ffn]."""
        self.router = router
        self.gate_up = torch.cat([gate, up], dim=1).contiguous()     # [E, 2*ffn, dim]
        self.down = down.contiguous()
        self.k, self.norm_topk = k, norm_topk

    def __call__(self, h: torch.Tensor, mm: MatMul) -> torch.Tensor:
        T, dim = h.shape
        # softmax over all E in f32, then the top k; their weights renormalized or not, as
        # transformers' Qwen3MoeTopKRouter and llama.cpp's build_moe_ffn
        probs = torch.softmax(mm(h, self.router).float(), dim=-1)              # [T, E]
        weight, chosen = probs.topk(self.k, dim=-1)                            # [T, k]
        if self.norm_topk:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        flat = chosen.flatten()                                                # pair j: token j // k
        order = flat.argsort(stable=True)
        experts, counts = flat[order].unique_consecutive(return_counts=True)
        out = h.new_empty(T * self.k, dim)
        start = 0
        for e, n in zip(experts.tolist(), counts.tolist()):
            pairs = order[start:start + n]
            start += n
            g, u = mm(h[pairs // self.k], self.gate_up[e]).chunk(2, dim=-1)
            out[pairs] = mm(F.silu(g) * u, self.down[e])
        out, weight = out.view(T, self.k, dim), weight.to(h.dtype)
        acc = out[:, 0] * weight[:, :1]     # elementwise, choice by choice: no reduction kernel
        for j in range(1, self.k):          # whose order could depend on T
            acc = acc + out[:, j] * weight[:, j:j + 1]
        return acc
