"""A mixture-of-experts MLP (Qwen3 MoE, gpt-oss, GLM-4.5): a router picks k of E gated experts per token.

Only the chosen experts' weights are read: the (token, choice) pairs are grouped by expert
and each expert that some token chose runs once on its tokens' rows, so a decode step reads
k experts and a prefill at most min(E, T * k). Each token's k outputs land in their own
slots and are summed in choice order, so a row's result does not depend on which other
tokens share the call (exact mode's promise, with its padded matmul).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

# mm(x [n, in], w [out, in]) -> [n, out]: the forward pass's matmul (exact mode pads rows)
MatMul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class SwigluOai:
    """gpt-oss's gated activation: gate clamped above at limit, up to [-limit, limit],
    gate * sigmoid(alpha * gate) * (up + 1), as transformers' GptOssExperts. moe.c reads
    alpha and limit from this object, so both steps apply the same numbers."""
    alpha: float
    limit: float

    def __call__(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        g = g.clamp(max=self.limit)
        return g * torch.sigmoid(g * self.alpha) * (u.clamp(-self.limit, self.limit) + 1)


class MoE:
    def __init__(self, router: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                 k: int, norm_topk: bool, biases: tuple | None = None, act=None, gating: str = "softmax",
                 score_bias: torch.Tensor | None = None, scale: float = 1.0, groups: tuple[int, int] = (1, 1),
                 packs: tuple[list, list] | None = None):
        """router [E, dim]; gate and up [E, ffn, dim]; down [E, dim, ffn], or packs: (gate|up,
        down) as one linear.Linear per expert (the native kernels' packs; gate, up and down
        are then None and never read); biases (gpt-oss):
        (router [E], gate [E, ffn], up [E, ffn], down [E, dim]) or None; act(gate, up): the
        gated activation (default SiLU(gate) * up). gating "sigmoid" (GLM-4.5): the router,
        f32, scores each expert by sigmoid, score_bias [E] is added for choosing only, the
        choice is made within the best groups[1] of groups[0] groups, and the chosen
        weights are times scale."""
        self.router = router
        if packs is not None:
            self.gate_up, self.down = packs
        else:
            self.gate_up = torch.cat([gate, up], dim=1).contiguous()     # [E, 2*ffn, dim]
            self.down = down.contiguous()
        self.k, self.norm_topk = k, norm_topk
        self.router_b = self.gate_up_b = self.down_b = None
        if biases is not None:
            self.router_b = biases[0]
            self.gate_up_b = torch.cat([biases[1], biases[2]], dim=1).contiguous()   # [E, 2*ffn]
            self.down_b = biases[3]
        self.act = act or (lambda g, u: F.silu(g) * u)
        self.sigmoid = gating == "sigmoid"
        self.score_bias = None if score_bias is None else score_bias.float()
        self.scale, self.groups = scale, groups

    @property
    def packed(self) -> bool:
        """Whether the experts are the kernels' packs (a Linear each) or dense tensors."""
        return not isinstance(self.gate_up, torch.Tensor)

    def route(self, h: torch.Tensor, mm: MatMul) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] f32, experts [T, k]) for the rows h [T, dim]."""
        if self.sigmoid:   # transformers' Glm4MoeTopkRouter, llama.cpp's sigmoid gating
            probs = torch.sigmoid(mm(h.float(), self.router))                  # [T, E]
            score = probs if self.score_bias is None else probs + self.score_bias
            n, used = self.groups
            if n > 1:      # a group's score: its two best; experts outside the best `used` groups drop
                g = score.view(len(h), n, -1)
                best = g.topk(2, dim=-1).values.sum(dim=-1).topk(used, dim=-1).indices
                keep = torch.zeros(len(h), n, dtype=torch.bool, device=h.device).scatter_(1, best, True)
                score = g.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(len(h), -1)
            chosen = score.topk(self.k, dim=-1).indices
            weight = probs.gather(1, chosen)
            if self.norm_topk:
                weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20)
            return weight * self.scale, chosen
        # softmax over all E in f32, then the top k; their weights renormalized or not, as
        # transformers' Qwen3MoeTopKRouter and llama.cpp's build_moe_ffn
        logits = mm(h, self.router)
        if self.router_b is not None:
            logits = logits + self.router_b
        probs = torch.softmax(logits.float(), dim=-1)                          # [T, E]
        weight, chosen = probs.topk(self.k, dim=-1)                            # [T, k]
        if self.norm_topk:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        return weight * self.scale, chosen          # (DeepSeek-V2's routed_scaling_factor; 1 exactly elsewhere)

    def __call__(self, h: torch.Tensor, mm: MatMul, lin=None) -> torch.Tensor:
        """h [T, dim] -> [T, dim]; mm: the forward pass's matmul (router, dense experts),
        lin(Linear, x): its call of a Linear (packed experts)."""
        T, dim = h.shape
        weight, chosen = self.route(h, mm)
        flat = chosen.flatten()                                                # pair j: token j // k
        order = flat.argsort(stable=True)
        experts, counts = flat[order].unique_consecutive(return_counts=True)
        out = h.new_empty(T * self.k, dim)
        start = 0
        for e, n in zip(experts.tolist(), counts.tolist()):
            pairs = order[start:start + n]
            start += n
            x = h[pairs // self.k]
            gu = lin(self.gate_up[e], x) if self.packed else mm(x, self.gate_up[e])
            if self.gate_up_b is not None:
                gu = gu + self.gate_up_b[e]
            a = self.act(*gu.chunk(2, dim=-1))
            o = lin(self.down[e], a) if self.packed else mm(a, self.down[e])
            out[pairs] = o if self.down_b is None else o + self.down_b[e]
        out, weight = out.view(T, self.k, dim), weight.to(h.dtype)
        acc = out[:, 0] * weight[:, :1]     # elementwise, choice by choice: no reduction kernel
        for j in range(1, self.k):          # whose order could depend on T
            acc = acc + out[:, j] * weight[:, j:j + 1]
        return acc
