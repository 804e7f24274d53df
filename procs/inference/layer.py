"""One decoder layer's tensors, as the loader's weights become them (build_layer, called by
model.Llama; forward(), decode_batch() and the native decoder read them)."""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from procs.inference.gdn import GatedDeltaNet
from procs.inference.linear import Linear
from procs.inference.mla import MLA, kv_b_split
from procs.inference.moe import MoE, SwigluOai


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
    mla: MLA | None = None                 # latent attention: its projections (wqkv is its first)
    kv: int = 0                            # the layer's index into the K/V caches
    gdn: GatedDeltaNet | None = None       # a Gated DeltaNet in place of attention (wqkv, wo are its)
    gated: bool = False                    # attention's output times sigmoid(gate rows after q|k|v)
    sh_gate: torch.Tensor | None = None    # the shared expert's output times sigmoid(h @ sh_gate.T) [1, dim]


def build_layer(c, t: dict, i: int, fused: Callable[..., Linear], experts: Callable | None = None) -> Layer:
    """Layer i from the loader's tensors t (names "layers.{i}.<name>") and config c: what the
    layer carries is what its tensors say (biases, q/k norms, experts, sinks). fused(*names)
    is one Linear over those weights' rows concatenated (model.Llama's, which knows the
    packing and the pack cache); experts(*names), where given, one Linear per expert of
    those expert tensors (linear.experts), else the experts stay dense tensors."""
    p = f"layers.{i}."
    bias = torch.cat([t[p + "bq"], t[p + "bk"], t[p + "bv"]]) if p + "bq" in t else None
    qkn = None
    if p + "q_norm" in t:   # one [D] weight per head row of q, then of k: [H+KV, D]
        qkn = torch.cat([t[p + "q_norm"].expand(c.n_heads, -1),
                         t[p + "k_norm"].expand(c.n_kv_heads, -1)]).contiguous()
    window = c.windows[i] if c.windows else 0
    biases = tuple(t[p + n] for n in ("router_b", "gate_exps_b", "up_exps_b", "down_exps_b")) \
        if p + "router_b" in t else None
    act = SwigluOai(c.swiglu_alpha, c.swiglu_limit) if c.act == "swiglu_oai" else None
    moe = None
    if p + "router" in t:
        packs = (experts("gate_exps", "up_exps"), experts("down_exps")) if experts else None
        dense = (None,) * 3 if packs else tuple(t[p + n] for n in ("gate_exps", "up_exps", "down_exps"))
        moe = MoE(t[p + "router"], *dense, c.n_experts_used, c.moe_norm_topk, biases, act, c.moe_gating,
                  t.get(p + "router_sb"), c.moe_scale, (c.moe_groups, c.moe_groups_used), packs)
    # the dense MLP, or beside the experts the shared one (GLM-4.5)
    mlp = ("w_gate_sh", "w_up_sh", "w_down_sh") if p + "w_gate_sh" in t else \
        (None, None, None) if moe else ("w_gate", "w_up", "w_down")
    linear = c.linear_layers[:i]
    gdn = None
    if p + "ssm_qkv" in t:    # a Gated DeltaNet: its input projections in one Linear
        gdn = GatedDeltaNet(c, sum(linear), fused("ssm_qkv", "ssm_z", "ssm_b", "ssm_alpha"), t[p + "ssm_conv"],
                            t[p + "ssm_a"], t[p + "ssm_dt"], t[p + "ssm_norm"], fused("ssm_out"))
    gated = p + "wg" in t
    mla = None
    if p + "wkv_a" in t:      # the query's first projection and kv_a read the same rows: one Linear
        wa = fused("wq_a" if p + "wq_a" in t else "wq", "wkv_a")
        if p + "wk_b" not in t:   # kv_b as one tensor (HF checkpoints): its two parts, as llama.cpp's converter writes them
            t[p + "wk_b"], t[p + "wv_b"] = kv_b_split(t[p + "wkv_b"], c.n_heads, c.qk_nope)
        mla = MLA(c, wa, t.get(p + "q_a_norm"), fused("wq_b") if p + "wq_b" in t else None, t[p + "kv_a_norm"],
                  fused("wk_b"), fused("wv_b"))
    return Layer(
        t[p + "attn_norm"],
        gdn.w_in if gdn else mla.wa if mla else fused("wq", "wk", "wv", "wg") if gated else fused("wq", "wk", "wv"),
        # ^ [(H+2KV)*D, dim], the gate's H*D rows after them
        bias,                                          # [(H+2KV)*D] or None
        qkn,                                           # [H+KV, D] or None
        gdn.w_out if gdn else fused("wo"),
        t.get(p + "post_attn_norm"),
        t[p + "ffn_norm"],
        fused(*mlp[:2]) if mlp[0] else None,            # [2*ffn, dim]
        fused(mlp[2]) if mlp[0] else None,
        moe,
        t.get(p + "post_ffn_norm"),
        window,
        1 if (window and c.rope_theta_local) or (c.no_rope and c.no_rope[i]) else 0,   # which rotary table
        t.get(p + "bo"),
        t[p + "sinks"].float() if p + "sinks" in t else None,
        mla,
        i - sum(linear),
        gdn,
        gated,
        t.get(p + "sh_gate"),
    )
