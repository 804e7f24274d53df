"""The architectures the loader takes, each a small description of what it adds to the Llama
decoder, and how each reads its config.json or GGUF metadata.

forward() never asks which architecture it runs: an architecture is the set of tensors the
loader fills (biases, q/k norms, post-norms), a few numbers in ModelConfig (activation,
embedding scale, attention scale, per-layer sliding windows and RoPE bases), and RoPE scaling
is a per-frequency divisor that the model folds into its rotary table once (procs/inference/rope.py).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

# RoPE scaling as each format states it lives in rope.py, the other config fields in
# arch_configs.py and attn_configs.py; re-exported for the loader and tests
from procs.inference.arch_configs import (GEMMA3_LOCAL_THETA, GEMMA3_SWA_PATTERN,  # noqa: F401
                                          GPT_OSS_SWA_PATTERN, gemma3_layers, gguf_gemma3, gguf_glm4moe,
                                          gguf_gpt_oss, gguf_moe, gguf_phi3, gguf_q_scale,
                                          hf_gemma3, hf_glm4moe, hf_gpt_oss, hf_moe,
                                          hf_partial_rope, hf_phi3, hf_q_scale, hf_text_config, nope_layers)
from procs.inference.attn_configs import gguf_hybrid, gguf_mla, hf_hybrid, hf_mla  # noqa: F401
from procs.inference.rope import (ModelLoadError, gguf_rope, hf_rope, llama3_factors,  # noqa: F401
                                  longrope_attn, yarn_factors, yarn_mscale)


@dataclass(frozen=True)
class Arch:
    name: str                        # the fingerprint's prefix: one name per distinct math
    qkv_bias: bool = False           # q/k/v projections carry biases (Qwen2)
    qk_norm: bool = False            # RMSNorm over each head of q and of k, before RoPE (Qwen3)
    # llama.cpp's converter permutes Q/K rows for its adjacent-pair RoPE only for the Llama
    # family; Qwen and Gemma GGUFs use NeoX RoPE, the Hugging Face half-split layout, unpermuted.
    gguf_permuted_qk: bool = True
    post_norms: bool = False         # RMSNorm on the attention and MLP outputs too (Gemma 3)
    act: str = "silu"                # the gated MLP's activation: silu | gelu_tanh (GeGLU)
    # Gemma's RMSNorm scales by (1 + w): HF stores w, llama.cpp's converter stores w + 1
    hf_norm_offset: float = 0.0
    embed_scale: bool = False        # embeddings times sqrt(dim) (Gemma)
    # HF tensor names that differ from LAYER_TENSORS' Llama names: ours -> HF suffix
    hf_names: tuple[tuple[str, str], ...] = ()
    # every layer's MLP is a mixture of SiLU-gated experts behind a softmax top-k router
    # (Qwen3 MoE) instead of one dense MLP
    moe: bool = False
    # Q, K and V in one tensor, gate and up in another (Phi-3): split by rows at load
    fused: bool = False
    # gpt-oss: a bias on the attention output, a learned sink logit per head in each layer's
    # softmax, biases on the router and the experts, whose activation is act
    o_bias: bool = False
    sinks: bool = False
    expert_bias: bool = False
    # GLM-4.5: a shared expert beside the routed ones, and a per-expert bias added to the
    # router's sigmoid scores for choosing (not for weighting) them
    shared_expert: bool = False
    score_bias: bool = False
    partial_rope: bool = False       # the GGUF's rope.dimension_count may be under head_dim
    # GLM-4 (0414): gate and up in one tensor, q/k/v apart; RoPE pairs adjacent dims (2i,
    # 2i+1) in both files, reordered at load into the half-split pairs forward() rotates
    fused_mlp: bool = False
    interleaved_rope: bool = False
    # GGUF tensor names that differ from LAYER_TENSORS' (ours -> GGUF suffix)
    gguf_names: tuple[tuple[str, str], ...] = ()
    # multi-head latent attention (procs/inference/mla.py) in place of q/k/v; q_lora: the
    # query through a low-rank pair (q_a, its norm, q_b) rather than one projection
    mla: bool = False
    q_lora: bool = False
    kv_b_split: bool = False         # kv_b stored as its two parts (llama.cpp's attn_k_b, attn_v_b)
    # Qwen3-Next / Qwen3.5 (gdn.py): Gated DeltaNet layers where the config says, the others
    # full attention with an output gate (q_proj's rows per head: query, then gate); the
    # shared expert's output times a sigmoid gate (shared_gate); the value heads in
    # llama.cpp's tiled order (ssm_tiled, qwen35); qwen3next's fused projections (ssm_fused:
    # q|k|v|z grouped per key head in HF's in_proj_qkvz, b|a per key head in in_proj_ba)
    linear_attn: bool = False
    attn_gate: bool = False
    shared_gate: bool = False
    ssm_tiled: bool = False
    ssm_fused: bool = False


_GEMMA_HF = (("ffn_norm", "pre_feedforward_layernorm.weight"),
             ("post_attn_norm", "post_attention_layernorm.weight"),
             ("post_ffn_norm", "post_feedforward_layernorm.weight"))


# HF model_type and GGUF general.architecture use these same names.
ARCHS = {
    "llama": Arch("llama"),
    "mistral": Arch("llama"),        # Mistral 7B v0.1-v0.3 is Llama with GQA: same math
    "qwen2": Arch("qwen2", qkv_bias=True, gguf_permuted_qk=False),
    "qwen3": Arch("qwen3", qk_norm=True, gguf_permuted_qk=False),
    # Gemma 3 text (HF Gemma3ForCausalLM is model_type gemma3_text; GGUF says gemma3)
    "gemma3": Arch("gemma3", qk_norm=True, gguf_permuted_qk=False, post_norms=True, act="gelu_tanh",
                   hf_norm_offset=1.0, embed_scale=True, hf_names=_GEMMA_HF),
}
ARCHS["gemma3_text"] = ARCHS["gemma3"]
# Qwen3 MoE: Qwen3 attention, experts in every layer (HF model_type qwen3_moe, GGUF qwen3moe)
ARCHS["qwen3moe"] = ARCHS["qwen3_moe"] = Arch("qwen3moe", qk_norm=True, gguf_permuted_qk=False, moe=True)
# Phi-3 / Phi-4: Llama with fused qkv and gate_up tensors (NeoX RoPE, unpermuted) and an
# optional sliding window over every layer (Phi-3 mini 4k: 2047, as transformers applies it)
ARCHS["phi3"] = Arch("phi3", gguf_permuted_qk=False, fused=True)
# gpt-oss: Llama attention with biases and sinks, every other layer over a sliding window,
# YaRN; experts behind a top-k router, their gate and up clamped (swiglu_oai). HF keeps gate
# and up of all experts in one interleaved tensor ([E, dim, 2*ffn]; the loader splits it),
# the GGUF apart; llama.cpp names the MLP's norm post_attention_norm there.
ARCHS["gpt-oss"] = ARCHS["gpt_oss"] = Arch(
    "gpt-oss", qkv_bias=True, gguf_permuted_qk=False, moe=True, o_bias=True, sinks=True, expert_bias=True,
    act="swiglu_oai",
    hf_names=(("router", "mlp.router.weight"), ("router_b", "mlp.router.bias"),
              ("gate_exps", "mlp.experts.gate_proj"), ("up_exps", "mlp.experts.up_proj"),
              ("down_exps", "mlp.experts.down_proj"), ("gate_exps_b", "mlp.experts.gate_proj_bias"),
              ("up_exps_b", "mlp.experts.up_proj_bias"), ("down_exps_b", "mlp.experts.down_proj_bias")),
    gguf_names=(("ffn_norm", "post_attention_norm.weight"),))
# GLM-4.5 / 4.6 / 4.7 (Air too): Llama attention over the first half of each head's dims
# (partial RoPE, NeoX pairs), q/k/v biases and q/k norms where the config sets them
# (variant), the first layers dense, the others routed experts by sigmoid scores plus a
# shared expert; its MTP layers (nextn) are not run. llama.cpp names the MLP's norm
# post_attention_norm.
ARCHS["glm4moe"] = ARCHS["glm4_moe"] = Arch(
    "glm4moe", gguf_permuted_qk=False, moe=True, shared_expert=True, score_bias=True, partial_rope=True,
    gguf_names=(("ffn_norm", "post_attention_norm.weight"),))
# DeepSeek-V2/V3 and GLM-4.7-Flash (config.json deepseek_v2, deepseek_v3, glm4_moe_lite; GGUF
# deepseek2): experts beside a shared one behind DeepSeek's multi-head latent attention
# (mla.py), the rotary dims interleaved in both files; the gating (sigmoid or softmax) and the
# router's score bias as the file says
ARCHS["deepseek2"] = ARCHS["glm4_moe_lite"] = ARCHS["deepseek_v2"] = ARCHS["deepseek_v3"] = Arch(
    "deepseek2", gguf_permuted_qk=False, moe=True, shared_expert=True, score_bias=True, interleaved_rope=True,
    mla=True)
# Qwen3-Next (80B-A3B, Qwen3-Coder-Next) and Qwen3.5: three Gated DeltaNet layers of four, the
# fourth full attention with an output gate, q/k norms and RoPE over the first quarter of each
# head (NeoX pairs); Gemma's (1 + w) RMSNorm (the GGUF stores w + 1, the DeltaNet's gated norm
# excepted); Qwen3-Next's and Qwen3.5 MoE's experts behind a softmax router with a gated
# shared expert, Qwen3.5's dense MLP. Qwen3.5's config.json names the multimodal model
# (qwen3_5: text_config qwen3_5_text); llama.cpp's qwen35 GGUFs hold its value heads tiled.
_QWEN_HYBRID = Arch("qwen3next", gguf_permuted_qk=False, qk_norm=True, hf_norm_offset=1.0, partial_rope=True,
                    linear_attn=True, attn_gate=True, moe=True, shared_expert=True, shared_gate=True,
                    ssm_fused=True, hf_names=(("w_gate_sh", "mlp.shared_expert.gate_proj.weight"),
                                              ("w_up_sh", "mlp.shared_expert.up_proj.weight"),
                                              ("w_down_sh", "mlp.shared_expert.down_proj.weight")),
                    gguf_names=(("ffn_norm", "post_attention_norm.weight"),))
ARCHS["qwen3next"] = ARCHS["qwen3_next"] = _QWEN_HYBRID
ARCHS["qwen35moe"] = ARCHS["qwen3_5_moe"] = ARCHS["qwen3_5_moe_text"] = dataclasses.replace(
    _QWEN_HYBRID, name="qwen35moe", ssm_tiled=True, ssm_fused=False)
ARCHS["qwen35"] = ARCHS["qwen3_5"] = ARCHS["qwen3_5_text"] = dataclasses.replace(
    _QWEN_HYBRID, name="qwen35", ssm_tiled=True, ssm_fused=False, moe=False, shared_expert=False, shared_gate=False)
# GLM-4 0414 (9B, 32B, Z1): Gemma's sandwich norms (on the attention's and the MLP's outputs),
# q/k/v biases where attention_bias says so, fused gate_up, RoPE over the first half of each
# head's dims in adjacent pairs
ARCHS["glm4"] = Arch("glm4", gguf_permuted_qk=False, post_norms=True, fused_mlp=True, partial_rope=True,
                     interleaved_rope=True, hf_names=(("post_attn_norm", "post_self_attn_layernorm.weight"),
                                                      ("post_ffn_norm", "post_mlp_layernorm.weight")))
# Seed-OSS (ByteDance, 36B): Llama with q/k/v biases and, where attention_out_bias says so,
# an output bias (NeoX RoPE, unpermuted in its GGUF, whose MLP norm is post_attention_norm)
ARCHS["seed_oss"] = Arch("seed_oss", qkv_bias=True, gguf_permuted_qk=False,
                         gguf_names=(("ffn_norm", "post_attention_norm.weight"),))
# SmolLM3: Llama whose every 4th layer has no RoPE (NoPE; its own rotary table of frequency 0)
ARCHS["smollm3"] = Arch("smollm3")
# Ministral 3 (3B, 8B, 14B) and Devstral Small 2: Llama with YaRN and a query scale that grows
# with the position past the trained context (GGUF mistral3, config.json ministral3)
ARCHS["mistral3"] = ARCHS["ministral3"] = Arch("ministral3")
# Gemma 3: every 6th layer attends globally, the others over a sliding window with their own
# RoPE base (llama.cpp's set_swa_pattern(6) and rope_freq_base_train_swa; transformers'
# layer_types and rope_parameters["sliding_attention"]).

# Our per-layer tensor name -> (HF name after "model.layers.{i}.", GGUF name after "blk.{i}.")
LAYER_TENSORS = {
    "attn_norm": ("input_layernorm.weight", "attn_norm.weight"),
    "wq": ("self_attn.q_proj.weight", "attn_q.weight"),
    "wk": ("self_attn.k_proj.weight", "attn_k.weight"),
    "wv": ("self_attn.v_proj.weight", "attn_v.weight"),
    "wo": ("self_attn.o_proj.weight", "attn_output.weight"),
    "ffn_norm": ("post_attention_layernorm.weight", "ffn_norm.weight"),
    "w_gate": ("mlp.gate_proj.weight", "ffn_gate.weight"),
    "w_up": ("mlp.up_proj.weight", "ffn_up.weight"),
    "w_down": ("mlp.down_proj.weight", "ffn_down.weight"),
    "bq": ("self_attn.q_proj.bias", "attn_q.bias"),
    "bk": ("self_attn.k_proj.bias", "attn_k.bias"),
    "bv": ("self_attn.v_proj.bias", "attn_v.bias"),
    "q_norm": ("self_attn.q_norm.weight", "attn_q_norm.weight"),
    "k_norm": ("self_attn.k_norm.weight", "attn_k_norm.weight"),
    "post_attn_norm": ("post_attention_layernorm.weight", "post_attention_norm.weight"),
    "post_ffn_norm": ("post_feedforward_layernorm.weight", "post_ffw_norm.weight"),
    # MoE: the router [E, dim], and the experts, which a GGUF stores stacked ([E, rows, cols]
    # in torch order) and an HF checkpoint one tensor per expert ({e}: the expert's index)
    "router": ("mlp.gate.weight", "ffn_gate_inp.weight"),
    "gate_exps": ("mlp.experts.{e}.gate_proj.weight", "ffn_gate_exps.weight"),
    "up_exps": ("mlp.experts.{e}.up_proj.weight", "ffn_up_exps.weight"),
    "down_exps": ("mlp.experts.{e}.down_proj.weight", "ffn_down_exps.weight"),
    # fused (Arch.fused): split into wq/wk/wv and w_gate/w_up by fused_rows()
    "wqkv": ("self_attn.qkv_proj.weight", "attn_qkv.weight"),
    "w_gate_up": ("mlp.gate_up_proj.weight", "ffn_up.weight"),
    # gpt-oss (Arch.o_bias, sinks, expert_bias); its HF experts are named in its hf_names
    "bo": ("self_attn.o_proj.bias", "attn_output.bias"),
    "sinks": ("self_attn.sinks", "attn_sinks.weight"),
    "router_b": ("mlp.gate.bias", "ffn_gate_inp.bias"),
    "gate_exps_b": ("mlp.experts.{e}.gate_proj.bias", "ffn_gate_exps.bias"),
    "up_exps_b": ("mlp.experts.{e}.up_proj.bias", "ffn_up_exps.bias"),
    "down_exps_b": ("mlp.experts.{e}.down_proj.bias", "ffn_down_exps.bias"),
    # multi-head latent attention (Arch.mla, q_lora)
    "wq_a": ("self_attn.q_a_proj.weight", "attn_q_a.weight"),
    "q_a_norm": ("self_attn.q_a_layernorm.weight", "attn_q_a_norm.weight"),
    "wq_b": ("self_attn.q_b_proj.weight", "attn_q_b.weight"),
    "wkv_a": ("self_attn.kv_a_proj_with_mqa.weight", "attn_kv_a_mqa.weight"),
    "kv_a_norm": ("self_attn.kv_a_layernorm.weight", "attn_kv_a_norm.weight"),
    "wkv_b": ("self_attn.kv_b_proj.weight", "attn_kv_b.weight"),
    "wk_b": ("self_attn.k_b_proj.weight", "attn_k_b.weight"),      # [H, r, nope] (kv_b_split)
    "wv_b": ("self_attn.v_b_proj.weight", "attn_v_b.weight"),      # [H, v, r]
    # GLM-4.5 (Arch.shared_expert, score_bias)
    "router_sb": ("mlp.gate.e_score_correction_bias", "exp_probs_b.bias"),
    "w_gate_sh": ("mlp.shared_experts.gate_proj.weight", "ffn_gate_shexp.weight"),
    "w_up_sh": ("mlp.shared_experts.up_proj.weight", "ffn_up_shexp.weight"),
    "w_down_sh": ("mlp.shared_experts.down_proj.weight", "ffn_down_shexp.weight"),
    # Qwen3-Next / Qwen3.5 (Arch.linear_attn, attn_gate, shared_gate): the gated query (split
    # at load into wq and its gate wg), the DeltaNet's projections (qwen3next's fused ones
    # split at load: fused_rows), convolution, decay (ssm_a = -exp(A_log), as llama.cpp
    # stores it), gated norm and output, the shared expert's gate
    "wqg": ("self_attn.q_proj.weight", "attn_q.weight"),
    "ssm_qkvz": ("linear_attn.in_proj_qkvz.weight", ""),
    "ssm_ba": ("linear_attn.in_proj_ba.weight", "ssm_ba.weight"),
    "ssm_qkv": ("linear_attn.in_proj_qkv.weight", "attn_qkv.weight"),
    "ssm_z": ("linear_attn.in_proj_z.weight", "attn_gate.weight"),
    "ssm_b": ("linear_attn.in_proj_b.weight", "ssm_beta.weight"),
    "ssm_alpha": ("linear_attn.in_proj_a.weight", "ssm_alpha.weight"),
    "ssm_conv": ("linear_attn.conv1d.weight", "ssm_conv1d.weight"),
    "ssm_a": ("linear_attn.A_log", "ssm_a"),
    "ssm_dt": ("linear_attn.dt_bias", "ssm_dt.bias"),
    "ssm_norm": ("linear_attn.norm.weight", "ssm_norm.weight"),
    "ssm_out": ("linear_attn.out_proj.weight", "ssm_out.weight"),
    "sh_gate": ("mlp.shared_expert_gate.weight", "ffn_gate_inp_shexp.weight"),
}
# Tensors of the layers that change the math, which an architecture without them must not
# silently drop (a Llama with attention_bias, say): present but unused is a load error.
MATH_EXTRAS = {"self_attn.o_proj.bias", "attn_output.bias", "mlp.gate_proj.bias", "mlp.up_proj.bias",
               "mlp.down_proj.bias", "ffn_gate.bias", "ffn_up.bias", "ffn_down.bias",
               "self_attn.q_a_proj.bias", "self_attn.kv_a_proj_with_mqa.bias"}


def arch_of(name: str, where: str) -> Arch:
    if name not in ARCHS:
        raise ModelLoadError(f"{where}: unsupported architecture {name!r} (supported: {', '.join(ARCHS)})")
    return ARCHS[name]


def layer_names(arch: Arch, dense: bool = False, linear: bool = False, fmt: int = 0) -> list[str]:
    """Our per-layer tensor names this architecture needs, all of them required; dense: a
    layer with one MLP where the others have experts (GLM-4.5's first layers); linear: a
    Gated DeltaNet layer (Arch.linear_attn), whose fused projections differ by format fmt
    (0: HF, 1: GGUF)."""
    if arch.fused:
        return ["attn_norm", "wqkv", "wo", "ffn_norm", "w_gate_up", "w_down"]
    names = ["attn_norm", "wq", "wk", "wv", "wo", "ffn_norm"]
    if linear:
        proj = (["ssm_qkvz", "ssm_ba"] if fmt == 0 else ["ssm_qkv", "ssm_z", "ssm_ba"]) if arch.ssm_fused \
            else ["ssm_qkv", "ssm_z", "ssm_b", "ssm_alpha"]
        names = ["attn_norm", "ffn_norm"] + proj + ["ssm_conv", "ssm_a", "ssm_dt", "ssm_norm", "ssm_out"]
    elif arch.attn_gate:
        names = ["attn_norm", "wqg", "wk", "wv", "wo", "ffn_norm"]
    if arch.mla:
        names = ["attn_norm", "wkv_a", "kv_a_norm", "wo", "ffn_norm"] + \
            (["wk_b", "wv_b"] if arch.kv_b_split else ["wkv_b"]) + \
            (["wq_a", "q_a_norm", "wq_b"] if arch.q_lora else ["wq"])
    experts = arch.moe and not dense
    names += ["router", "gate_exps", "up_exps", "down_exps"] if experts else \
        ["w_gate_up", "w_down"] if arch.fused_mlp else ["w_gate", "w_up", "w_down"]
    if experts and arch.shared_expert:
        names += ["w_gate_sh", "w_up_sh", "w_down_sh"]
    if experts and arch.score_bias:
        names += ["router_sb"]
    if experts and arch.shared_gate:
        names += ["sh_gate"]
    if arch.qkv_bias:
        names += ["bq", "bk", "bv"]
    if arch.o_bias:
        names += ["bo"]
    if arch.sinks:
        names += ["sinks"]
    if arch.expert_bias:
        names += ["router_b", "gate_exps_b", "up_exps_b", "down_exps_b"]
    if arch.qk_norm and not linear:
        names += ["q_norm", "k_norm"]
    if arch.post_norms:
        names += ["post_attn_norm", "post_ffn_norm"]
    return names


def fused_rows(cfg) -> dict[str, tuple[list[int] | None, list[tuple[str, int, int]]]]:
    """Each fused tensor's parts: (a row order applied first, or None; then per part our name,
    first row, end row). Phi-3's as transformers splits them (q, k, v; gate, then up); the
    gated query of Qwen3-Next / Qwen3.5 (per head: query rows, then gate rows); qwen3next's
    DeltaNet projections, grouped per key head (q, k, the group's v heads, their z; the
    group's b, then a)."""
    H, KV, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q, kv, ffn = H * D, KV * D, cfg.ffn_dim
    out = {"wqkv": (None, [("wq", 0, q), ("wk", q, q + kv), ("wv", q + kv, q + 2 * kv)]),
           "w_gate_up": (None, [("w_gate", 0, ffn), ("w_up", ffn, 2 * ffn)])}
    if cfg.linear_layers:
        out["wqg"] = ([h * 2 * D + j for part in (0, 1) for h in range(H) for j in range(part * D, part * D + D)],
                      [("wq", 0, q), ("wg", q, 2 * q)])
        nk, dk, dv = cfg.ssm_k_heads, cfg.ssm_k_dim, cfg.ssm_v_dim
        r = cfg.ssm_v_heads // nk
        g = 2 * dk + 2 * r * dv                    # one key head's group of rows
        spans = [(0, dk), (dk, 2 * dk), (2 * dk, 2 * dk + r * dv), (2 * dk + r * dv, g)]   # q, k, v, z
        order = [grp * g + j for a, b in spans for grp in range(nk) for j in range(a, b)]
        qkv = 2 * nk * dk + r * nk * dv
        out["ssm_qkvz"] = (order, [("ssm_qkv", 0, qkv), ("ssm_z", qkv, qkv + r * nk * dv)])
        nv = cfg.ssm_v_heads
        out["ssm_ba"] = ([grp * 2 * r + j for a in (0, r) for grp in range(nk) for j in range(a, a + r)],
                         [("ssm_b", 0, nv), ("ssm_alpha", nv, 2 * nv)])
    return out


def tensor_name(arch: Arch, ours: str, fmt: int) -> str:
    """The per-layer suffix of our tensor `ours` in format fmt (0: HF, 1: GGUF)."""
    names = arch.hf_names if fmt == 0 else arch.gguf_names
    return dict(names).get(ours, LAYER_TENSORS[ours][fmt])


def unused_math(arch: Arch, present: set[str], fmt: int) -> list[str]:
    """Per-layer tensors present (suffixes as in LAYER_TENSORS[..][fmt]) that change the math
    but that this architecture would not read."""
    names = layer_names(arch, fmt=fmt) + (layer_names(arch, dense=True) if arch.shared_expert else []) + \
        (layer_names(arch, linear=True, fmt=fmt) if arch.linear_attn else [])
    used = {tensor_name(arch, n, fmt) for n in names}
    known = {v[fmt] for v in LAYER_TENSORS.values()} | MATH_EXTRAS | \
        {v for _, v in (arch.hf_names if fmt == 0 else arch.gguf_names)}
    present = {re.sub(r"^mlp\.experts\.\d+\.", "mlp.experts.{e}.", s) for s in present}
    return sorted(s for s in present if s in known and s not in used)


def check_unused(arch, names, layer_prefix: str, fmt: int, path: str) -> None:
    """A load error for per-layer tensors that change the math but that arch would not read."""
    present = {re.sub("^" + layer_prefix, "", n) for n in names if re.match(layer_prefix, n)}
    extra = unused_math(arch, present, fmt)
    if extra:
        raise ModelLoadError(f"{path}: tensors {extra} are not part of architecture {arch.name!r}")


# Flags a model of these architectures sets for itself: (Arch field, config.json key and its
# default, the GGUF tensor whose presence says it). The same math name either way: the
# tensors themselves tell the fingerprint apart.
_PER_MODEL = {
    "glm4moe": (("qkv_bias", "attention_bias", False, "blk.0.attn_q.bias"),
                ("qk_norm", "use_qk_norm", False, "blk.0.attn_q_norm.weight")),
    "glm4": (("qkv_bias", "attention_bias", False, "blk.0.attn_q.bias"),),
    "deepseek2": (("q_lora", "q_lora_rank", True, "blk.0.attn_q_a.weight"),
                  ("kv_b_split", "", False, "blk.0.attn_k_b.weight")),
    "seed_oss": (("qkv_bias", "attention_bias", True, "blk.0.attn_q.bias"),
                 ("o_bias", "attention_out_bias", False, "blk.0.attn_output.bias")),
}


def hf_variant(arch: Arch, c: dict) -> Arch:
    """arch with the flags its config.json sets (GLM's and Seed-OSS's biases and q/k norms)."""
    return dataclasses.replace(arch, **{f: bool(c.get(k, d)) for f, k, d, _ in _PER_MODEL.get(arch.name, ())})


def gguf_variant(arch: Arch, tensors) -> Arch:
    """The same, told by the GGUF's tensors."""
    return dataclasses.replace(arch, **{f: t in tensors for f, _, _, t in _PER_MODEL.get(arch.name, ())})
