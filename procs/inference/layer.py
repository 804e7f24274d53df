"""One decoder layer's tensors, as the loader's weights become them (model.Llama builds
them; forward(), decode_batch() and the native decoder read them)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from procs.inference.linear import Linear
from procs.inference.moe import MoE


class Layer(NamedTuple):
    attn_norm: torch.Tensor
    wqkv: Linear
    bqkv: torch.Tensor | None
    qk_norm: torch.Tensor | None
    wo: Linear
    post_attn_norm: torch.Tensor | None    # Gemma 3: RMSNorm on the attention output
    ffn_norm: torch.Tensor
    wgu: Linear | None                     # the dense MLP; with moe, None or the shared expert
    wd: Linear | None
    moe: MoE | None                        # Qwen3 MoE: experts in place of the dense MLP
    post_ffn_norm: torch.Tensor | None     # Gemma 3: RMSNorm on the MLP output
    window: int                            # sliding window (0: attends to every earlier key)
    rope: int                              # index into Llama.rope
    bo: torch.Tensor | None = None         # gpt-oss: the attention output's bias [dim]
    sinks: torch.Tensor | None = None      # gpt-oss: each head's sink logit, float32 [H]
