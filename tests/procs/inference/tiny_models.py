"""Tiny random-weight models of each supported architecture, the references the architecture
tests hold ricordo to: the transformers model (its config per CASES), the same weights saved as
a Hugging Face dir and written as an F32 GGUF the way llama.cpp's converter writes them (the
module-scoped `build` fixture), the reference logits and greedy tokens (_transformers), and
ricordo's own (_ours). Used by test_architectures.py and the per-family tests."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from procs.inference.loader import load  # noqa: E402
from procs.inference import native  # noqa: E402
from procs.inference.model import Llama  # noqa: E402
from procs.inference.kvsession import KVSession  # noqa: E402
from procs.inference.steps import decode_many  # noqa: E402

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 320, 64, 128, 2, 4, 2, 16
PROMPT, GREEDY, MAX_POS = 40, 64, 128
# f32 logits are O(1-10) here; measured max abs differences are ~1e-6 (HF dir) and the GGUF
# matches the HF dir to ~1e-6 as well (its tensors are the same f32 values).
LOGIT_TOL = 1e-3

COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
              num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
              max_position_embeddings=MAX_POS, rms_norm_eps=1e-6, bos_token_id=None,
              eos_token_id=None, pad_token_id=None)
# original_max_position_embeddings=64 with theta 50000 and D=16 puts one frequency in each
# llama3 regime (kept, interpolated, divided), so the scaling matters at every position.
LLAMA3 = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# YaRN stretching 32 trained positions to MAX_POS: with theta 10000 and D=16 the ramp runs over
# dims 0..2, so one frequency is kept, one blended, six divided by 4, and positions 32+ (most
# of the prompt and all the greedy tokens) lie past the original context
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}

PHI_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "original_max_position_embeddings": 32,
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5], "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]}

# Ministral 3's YaRN and query scale (16384 trained positions and factor 16, scaled down): q
# times 1 + 0.1 ln(1 + floor(pos / 16)), so the prompt and the greedy tokens cross 6 steps of it
MINISTRAL3 = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 16,
              "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}

# gpt-oss's YaRN (factor 32 over 4096 positions, scaled down): truncate false ends the ramp
# at dim 1.41, not 2
GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 32}

# Gated DeltaNet layers: 2 key heads and 4 value heads (2 per key head) of 32 dims (llama.cpp
# takes one dim for both, ssm.state_size; a value head a whole quant block, as in released
# models, so that the GGUF's tiled columns of ssm_out quantize as the reference's do)
HYBRID = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
              linear_conv_kernel_dim=4)
QWEN35_ROPE = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
               "mrope_interleaved": True}

CASES = {   # name: (transformers config class, its arguments, GGUF architecture)
    "llama": ("LlamaConfig", dict(rope_theta=10000.0, tie_word_embeddings=False), "llama"),
    "llama3": ("LlamaConfig", dict(rope_parameters=LLAMA3, tie_word_embeddings=True), "llama"),
    "mistral": ("MistralConfig", dict(rope_theta=1e6, sliding_window=None, tie_word_embeddings=False),
                "llama"),
    "qwen2": ("Qwen2Config", dict(rope_theta=1e6, tie_word_embeddings=True), "qwen2"),
    # head_dim 32 != hidden/heads: q/k/v/o shapes must come from head_dim
    "qwen3": ("Qwen3Config", dict(rope_theta=1e6, tie_word_embeddings=False, head_dim=32), "qwen3"),
    # a window of 8 over a 40-token prompt, five sliding layers and a global one (pattern 6), two RoPE
    # bases, (1 + w) norms, GeGLU, scaled embeddings; query_pre_attn_scalar as llama.cpp assumes it
    # Qwen3 attention, four SiLU experts per layer, two chosen per token and renormalized
    "qwen3moe": ("Qwen3MoeConfig", dict(num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=48, norm_topk_prob=True, rope_theta=1e6,
                                        tie_word_embeddings=False), "qwen3moe"),
    "yarn": ("Qwen2Config", dict(rope_parameters=YARN, tie_word_embeddings=True), "qwen2"),
    # fused qkv and gate_up, every layer over a sliding window of 8
    "phi3": ("Phi3Config", dict(rope_theta=10000.0, sliding_window=8, tie_word_embeddings=False), "phi3"),
    # Phi-4 mini's RoPE: 12 of 16 dims rotate, LongRoPE trained at 32 positions (the prompt is
    # longer: transformers and a context of MAX_POS both take the long factors) with its
    # attention factor (sqrt(1 + ln 4 / ln 32))
    "phi4mini": ("Phi3Config", dict(rope_parameters=PHI_LONGROPE, original_max_position_embeddings=32,
                                    tie_word_embeddings=True), "phi3"),
    # biases everywhere, a sink logit per head, every other layer over a window of 8, YaRN
    # unrounded (truncate false), four experts with biases, two chosen, clamped SwiGLU
    # (_hf_model widens the gates so that the clamps bite)
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64,
                                     sliding_window=8, rope_parameters=GPT_OSS_YARN, tie_word_embeddings=False),
                "gpt-oss"),
    # GLM-4.5: half of each head rotates, q/k/v biases and q/k norms (GLM-4.5 355B's), layer 0
    # dense, then eight experts chosen by sigmoid score plus bias within the better of two
    # groups, renormalized, times 2.5, beside a shared expert
    "glm4moe": ("Glm4MoeConfig", dict(num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2,
                                      moe_intermediate_size=64, first_k_dense_replace=1, n_shared_experts=1,
                                      routed_scaling_factor=2.5, n_group=2, topk_group=1, norm_topk_prob=True,
                                      attention_bias=True, use_qk_norm=True, tie_word_embeddings=False,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                       "partial_rotary_factor": 0.5}),
                "glm4moe"),
    # GLM-4.7-Flash: GLM-4.5's experts (layer 0 dense) behind latent attention (a low-rank
    # query, K/V from a 32-dim latent and 16 interleaved rotary dims); 24 + 16 dims for q.k,
    # values of 16 (every row a whole number of quant blocks)
    "glm4_moe_lite": ("Glm4MoeLiteConfig", dict(num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2,
                                                moe_intermediate_size=64, n_shared_experts=1, routed_scaling_factor=1.8,
                                                n_group=1, topk_group=1, norm_topk_prob=True, kv_lora_rank=32,
                                                q_lora_rank=64, qk_nope_head_dim=24, qk_rope_head_dim=HEAD_DIM,
                                                v_head_dim=16, num_key_value_heads=HEADS, rope_interleave=True,
                                                tie_word_embeddings=False,
                                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
                      "deepseek2"),
    # DeepSeek-V2-Lite's shape: one query projection, softmax over the experts, not
    # renormalized but scaled, two shared experts' worth of MLP, YaRN with mscale_all_dim (the
    # softmax scale) equal to mscale (the rotary tables' factor then 1)
    "deepseek_v2": ("DeepseekV2Config", dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8,
                                             num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=2,
                                             routed_scaling_factor=1.5, topk_method="greedy", n_group=1, topk_group=1,
                                             norm_topk_prob=False, kv_lora_rank=32, q_lora_rank=None,
                                             qk_nope_head_dim=24, qk_rope_head_dim=HEAD_DIM, v_head_dim=16,
                                             num_key_value_heads=HEADS, tie_word_embeddings=False,
                                             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                              "original_max_position_embeddings": 32, "beta_fast": 32.0,
                                                              "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}),
                    "deepseek2"),
    # DeepSeek-V3's: sigmoid scores plus a bias within the better of two groups, two dense layers
    "deepseek_v3": ("DeepseekV3Config", dict(num_hidden_layers=4, first_k_dense_replace=2, n_routed_experts=8,
                                             num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                                             routed_scaling_factor=2.5, n_group=2, topk_group=1, norm_topk_prob=True,
                                             kv_lora_rank=32, q_lora_rank=64, qk_nope_head_dim=24,
                                             qk_rope_head_dim=HEAD_DIM, v_head_dim=16, num_key_value_heads=HEADS,
                                             tie_word_embeddings=False,
                                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
                    "deepseek2"),
    # GLM-4 0414: sandwich norms, q/k/v biases, fused gate_up, half of each head rotating in
    # adjacent pairs
    "glm4": ("Glm4Config", dict(attention_bias=True, tie_word_embeddings=False,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                 "partial_rotary_factor": 0.5}), "glm4"),
    # Seed-OSS: Llama with q/k/v biases (no output bias, as released)
    "seed_oss": ("SeedOssConfig", dict(attention_bias=True, attention_out_bias=False, rope_theta=1e7,
                                       tie_word_embeddings=False), "seed_oss"),
    # SmolLM3: layer 3 of 4 without RoPE
    "smollm3": ("SmolLM3Config", dict(num_hidden_layers=4, rope_theta=1e6, tie_word_embeddings=True), "smollm3"),
    # Ministral 3 / Devstral Small 2: Llama with YaRN and the query scale
    "ministral3": ("Ministral3Config", dict(rope_parameters=MINISTRAL3, tie_word_embeddings=False), "mistral3"),
    # Qwen3-Next: layers 0-2 Gated DeltaNet (two key heads, four value heads grouped over
    # them, convolution of 4), layer 3 full attention with its output gate, q/k norms and a
    # quarter of each head rotating; (1 + w) norms; two of four experts beside a gated shared one
    "qwen3_next": ("Qwen3NextConfig", dict(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=48, shared_expert_intermediate_size=32,
                                           norm_topk_prob=True, **HYBRID, tie_word_embeddings=False,
                                           rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                            "partial_rotary_factor": 0.25}), "qwen3next"),
    # Qwen3.5 (dense) and Qwen3.5 MoE: the same layers, their GGUFs' value heads tiled; text
    # positions through mrope's sections rotate as plain RoPE
    "qwen3_5": ("Qwen3_5TextConfig", dict(num_hidden_layers=4, **HYBRID, tie_word_embeddings=True,
                                          rope_parameters=QWEN35_ROPE), "qwen35"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
                                                 moe_intermediate_size=48, shared_expert_intermediate_size=32,
                                                 **HYBRID, tie_word_embeddings=False, rope_parameters=QWEN35_ROPE),
                    "qwen35moe"),
    "gemma3": ("Gemma3TextConfig", dict(num_hidden_layers=6, sliding_window=8,
                                        query_pre_attn_scalar=HEAD_DIM, tie_word_embeddings=True,
                                        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                         "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 10000.0}}),
               "gemma3"),
}

# mixtures of experts (test_quant_files: a requantized file's tolerance is its own error)
MOE = ("qwen3moe", "gpt_oss", "glm4moe", "glm4_moe_lite", "deepseek_v2", "deepseek_v3", "qwen3_next", "qwen3_5_moe")
# (1 + w) RMSNorms: their weights randomized around 0 (the DeltaNet's gated norm is plain w)
ZERO_NORMS = ("gemma3", "qwen3_next", "qwen3_5", "qwen3_5_moe")
HYBRIDS = ("qwen3next", "qwen35", "qwen35moe")


def _hf_model(name: str, **override):
    cls, extra, _ = CASES[name]
    cfg = getattr(transformers, cls)(**{**COMMON, **extra, **override})
    cfg._attn_implementation = "eager"
    torch.manual_seed(sum(map(ord, name)))
    m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():   # transformers zeroes biases and sets norms to 1: randomize all
        for pname, p in m.named_parameters():
            if "norm" in pname:   # Gemma scales by (1 + w): 0.3 * randn keeps it near 1 too
                p.copy_((0 if name in ZERO_NORMS and "linear_attn" not in pname else 1) + 0.3 * torch.randn_like(p))
            elif pname.endswith("gate_up_proj"):   # gpt-oss: gates and ups past its clamps (+-7)
                p.normal_(0.0, 0.6)
            elif pname.endswith("sinks"):          # sinks that take a real share of the softmax
                p.normal_(1.0, 1.0)
            else:
                p.normal_(0.0, 0.15)
        for bname, b in m.named_buffers():
            if bname.endswith("e_score_correction_bias"):   # GLM: biases that change the choice
                b.normal_(0.0, 0.2)
    return m


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf LlamaModel.permute (Q and K rows, Llama family)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llamacpp_rope_freqs(rp: dict, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf's Llama 3.1 rope_freqs, computed as it does (f32 frequencies)."""
    base = rp["rope_theta"]
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
    old = rp["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _copy_tokenizer(w, src: str) -> None:
    """Every tokenizer.* field of the GGUF src (its vocabulary, merges, ids, chat template)."""
    for name, f in gguf.GGUFReader(src).fields.items():
        if name.startswith("tokenizer."):
            t = gguf.GGUFValueType(f.types[0])
            sub = gguf.GGUFValueType(f.types[1]) if t == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(name, f.contents(), t, sub)


def _write_gguf(m, path: str, arch: str, qtype=None, experts_qtype=None, tokenizer_from: str = "") -> None:
    """As llama.cpp's converter writes it; `qtype` (a GGMLQuantizationType the gguf package
    can quantize) stores every 2-D weight quantized, norms and biases in F32;
    `experts_qtype` the stacked experts' weights; tokenizer_from: a GGUF whose tokenizer the
    file takes (a servable model; m's vocabulary must be its size)."""
    c = m.config
    head_dim = c.head_dim
    w = gguf.GGUFWriter(path, arch)
    if tokenizer_from:
        _copy_tokenizer(w, tokenizer_from)
    w.add_block_count(c.num_hidden_layers + (arch == "glm4moe"))     # GLM's MTP layer counts
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(getattr(c, "intermediate_size", 0) or 0)
    w.add_head_count(c.num_attention_heads)
    mla = arch == "deepseek2"
    if mla:   # the converter's DeepseekV2Model: latent attention as MQA over the cached row
        r, rope = c.kv_lora_rank, c.qk_rope_head_dim
        w.add_head_count_kv(1)
        if c.q_lora_rank:
            w.add_q_lora_rank(c.q_lora_rank)
        w.add_kv_lora_rank(r)
        w.add_key_length(r + rope)
        w.add_value_length(r)
        w.add_key_length_mla(c.qk_nope_head_dim + rope)
        w.add_value_length_mla(c.v_head_dim)
    else:
        w.add_head_count_kv(c.num_key_value_heads)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    rp = c.rope_parameters
    rp = rp.get("full_attention", rp)
    rot = int(head_dim * rp.get("partial_rotary_factor", 1.0))
    w.add_rope_dimension_count(rot)
    if rp.get("rope_type") == "longrope":   # what convert_hf_to_gguf writes for Phi-3's LongRoPE
        orig = rp["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(orig)
        scale = c.max_position_embeddings / orig
        w.add_rope_scaling_attn_factors(1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(orig)))
        w.add_tensor("rope_factors_long.weight", np.array(rp["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rp["short_factor"], dtype=np.float32))
    w.add_rope_freq_base(float(rp["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    gemma = arch == "gemma3"
    if gemma or (arch == "phi3" and getattr(c, "sliding_window", None)):   # what llama.cpp's converter writes (Gemma:
        w.add_sliding_window(c.sliding_window)            # it reads the pattern (6) and local base itself)
    if rp.get("rope_type") == "yarn":   # what convert_hf_to_gguf writes for a yarn config
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
        for key, add in (("attention_factor", w.add_rope_scaling_yarn_attn_factor),
                         ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
            if rp.get(key) is not None:
                add(rp[key])
    if arch == "mistral3":   # the converter's Ministral3Model
        w.add_rope_scaling_yarn_log_mul(rp["mscale_all_dim"])
        w.add_attn_temperature_scale(rp["llama_4_scaling_beta"])
    state = m.state_dict()
    if arch == "gpt-oss":   # as the converter's GptOssModel: gate and up apart, [E, rows, cols]
        w.add_expert_count(c.num_local_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.intermediate_size)
        w.add_sliding_window(c.sliding_window)
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            gu, b = state.pop(p + "mlp.experts.gate_up_proj"), state.pop(p + "mlp.experts.gate_up_proj_bias")
            state[p + "mlp.experts.gate_proj.weight"] = gu[:, :, 0::2].transpose(1, 2)
            state[p + "mlp.experts.up_proj.weight"] = gu[:, :, 1::2].transpose(1, 2)
            state[p + "mlp.experts.down_proj.weight"] = state.pop(p + "mlp.experts.down_proj").transpose(1, 2)
            state[p + "mlp.experts.gate_proj.bias"], state[p + "mlp.experts.up_proj.bias"] = b[:, 0::2], b[:, 1::2]
            state[p + "mlp.experts.down_proj.bias"] = state.pop(p + "mlp.experts.down_proj_bias")
            state[p + "self_attn.sinks.weight"] = state.pop(p + "self_attn.sinks")
    if arch == "glm4moe":    # the converter's Glm4MoeModel (the groups: as for DeepSeek's)
        w.add_expert_shared_count(c.n_shared_experts)
        w.add_leading_dense_block_count(c.first_k_dense_replace)
        w.add_expert_weights_scale(c.routed_scaling_factor)
        w.add_expert_weights_norm(c.norm_topk_prob)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_group_count(c.n_group)
        w.add_expert_group_used_count(c.topk_group)
        w.add_nextn_predict_layers(1)
        for i in range(c.first_k_dense_replace, c.num_hidden_layers):
            p = f"model.layers.{i}.mlp."
            state[p + "gate.e_score_correction.bias"] = state.pop(p + "gate.e_score_correction_bias")
        # an MTP layer after the others (block_count counts it), which llama.cpp does not run
        last = f"model.layers.{c.num_hidden_layers - 1}."
        state.update({k.replace(last, f"model.layers.{c.num_hidden_layers}."): v.clone()
                      for k, v in list(state.items()) if k.startswith(last)})
        state[f"model.layers.{c.num_hidden_layers}.eh_proj.weight"] = torch.randn(c.hidden_size, 2 * c.hidden_size)
    if mla:   # kv_b as its two parts per head, k_b transposed ([H, r, nope], [H, v, r])
        dense = 1 if c.model_type == "glm4_moe_lite" else c.first_k_dense_replace
        w.add_expert_shared_count(c.n_shared_experts)
        w.add_leading_dense_block_count(dense)
        w.add_expert_weights_scale(c.routed_scaling_factor)
        if c.norm_topk_prob:                      # the converter writes it only when true
            w.add_expert_weights_norm(True)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX if c.model_type == "deepseek_v2"
                                 else gguf.ExpertGatingFuncType.SIGMOID)
        if (c.n_group or 1) > 1:
            w.add_expert_group_count(c.n_group)
            w.add_expert_group_used_count(c.topk_group)
        if rp.get("rope_type") == "yarn":
            w.add_rope_scaling_yarn_log_mul(0.1 * rp["mscale_all_dim"])
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            kv_b = state.pop(p + "self_attn.kv_b_proj.weight").view(c.num_attention_heads, -1, c.kv_lora_rank)
            state[p + "self_attn.k_b_proj.weight"] = kv_b[:, :c.qk_nope_head_dim].transpose(1, 2).contiguous()
            state[p + "self_attn.v_b_proj.weight"] = kv_b[:, c.qk_nope_head_dim:].contiguous()
            if p + "mlp.gate.e_score_correction_bias" in state:
                state[p + "mlp.gate.e_score_correction.bias"] = state.pop(p + "mlp.gate.e_score_correction_bias")
    if arch in ("qwen3moe", "glm4moe", "deepseek2", "qwen3next", "qwen35moe"):   # the converter's stacked experts: [E, rows, cols], gate and up apart
        n = c.num_experts if arch in ("qwen3moe", "qwen3next", "qwen35moe") else c.n_routed_experts
        first = dense if mla else getattr(c, "first_k_dense_replace", 0)
        w.add_expert_count(n)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        for i in range(first, c.num_hidden_layers + (arch == "glm4moe")):
            p = f"model.layers.{i}.mlp.experts."
            state[p + "gate_proj.weight"], state[p + "up_proj.weight"] = state.pop(p + "gate_up_proj").chunk(2, dim=1)
            state[p + "down_proj.weight"] = state.pop(p + "down_proj")
    if arch in HYBRIDS:
        _hybrid_tensors(w, c, state, arch)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[{"glm4moe": "GLM4_MOE"}.get(arch, arch.upper().replace("-", "_"))],
                                     c.num_hidden_layers + 1)
    if rp.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llamacpp_rope_freqs(rp, head_dim))
    for hf_name, t in state.items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        a = t.numpy().astype(np.float32)
        if (gemma or arch in HYBRIDS) and hf_name.endswith("norm.weight") and "linear_attn" not in hf_name:
            a = a + 1                                   # the converter folds (1 + w) in
        if arch in ("llama", "smollm3", "mistral3") and ("q_proj" in hf_name or "k_proj" in hf_name):   # LlamaModel's permute
            a = _permute(a, c.num_attention_heads if "q_proj" in hf_name else c.num_key_value_heads)
        gname = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        # weights only: llama.cpp's quantizer keeps biases (gpt-oss's experts' are 2-D) in F32
        q = None if not gname.endswith(".weight") else experts_qtype if a.ndim == 3 else qtype if a.ndim == 2 else None
        if gname.endswith(("attn_k_b.weight", "attn_v_b.weight")):   # per-head 2-D matrices, quantized as
            q = qtype if a.shape[-1] % 32 == 0 else None           # such where their rows make whole blocks
        if "ssm_conv1d" in gname:      # llama.cpp keeps the convolution (rows of 4) in F32
            q = None
        if q is not None:
            w.add_tensor(gname, gguf.quants.quantize(np.ascontiguousarray(a), q), raw_dtype=q)
        else:
            w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _hybrid_tensors(w, c, state: dict, arch: str) -> None:
    """Qwen3-Next's / Qwen3.5's DeltaNet metadata and tensors as llama.cpp's converter writes
    them: qwen3next's in_proj_qkvz de-grouped into attn_qkv (q, k, v) and attn_gate (z), b|a
    as they are; -exp(A_log); the convolution [conv_dim, K]; qwen35's value heads tiled."""
    nk, nv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r = nv // nk
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(nk)
    w.add_ssm_time_step_rank(nv)
    w.add_ssm_inner_size(nv * dv)
    w.add_full_attention_interval(4)
    if arch != "qwen35":
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if arch != "qwen3next":      # Qwen3.5's mrope sections (llama.cpp requires them; text rotates as plain RoPE)
        w.add_rope_dimension_sections([*c.rope_parameters["mrope_section"], 0])
    tiled = torch.tensor([g * r + j for j in range(r) for g in range(nk)])     # the converter's _reorder_v_heads
    per = lambda d: (tiled[:, None] * d + torch.arange(d)).reshape(-1)
    with_v = torch.cat([torch.arange(2 * nk * dk), 2 * nk * dk + per(dv)])
    for i, kind in enumerate(c.layer_types):
        p = f"model.layers.{i}.linear_attn."
        if kind != "linear_attention":
            continue
        if arch == "qwen3next":
            qkvz = state.pop(p + "in_proj_qkvz.weight").view(nk, 2 * dk + 2 * r * dv, -1)
            q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=1)
            state[p + "in_proj_qkv.weight"] = torch.cat([x.reshape(-1, x.shape[-1]) for x in (q, k, v)])
            state[p + "in_proj_z.weight"] = z.reshape(-1, z.shape[-1])
        state[p + "A_log"] = -state.pop(p + "A_log").float().exp()
        state[p + "dt_proj.bias"] = state.pop(p + "dt_bias")
        state[p + "conv1d.weight"] = state[p + "conv1d.weight"].squeeze(1)
        if arch != "qwen3next":
            for name, order in (("in_proj_qkv.weight", with_v), ("conv1d.weight", with_v), ("in_proj_z.weight", per(dv)),
                                ("in_proj_b.weight", tiled), ("in_proj_a.weight", tiled), ("A_log", tiled),
                                ("dt_proj.bias", tiled)):
                state[p + name] = state[p + name][order]
            state[p + "out_proj.weight"] = state[p + "out_proj.weight"][:, per(dv)]


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """build(name) -> (name, transformers model, HF dir path, GGUF path), made once."""
    made = {}

    def get(name: str):
        if name not in made:
            m = _hf_model(name)
            d = tmp_path_factory.mktemp(name)
            m.save_pretrained(d / "hf")
            _write_gguf(m, str(d / "tiny.gguf"), CASES[name][2])
            made[name] = name, m, str(d / "hf"), str(d / "tiny.gguf")
        return made[name]
    return get


@pytest.fixture(scope="module", params=list(CASES))
def case(request, build):
    return build(request.param)


def _prompt(name: str) -> list[int]:
    g = torch.Generator().manual_seed(len(name))
    return torch.randint(0, VOCAB, (PROMPT,), generator=g).tolist()


def batched_steps(model, ids: list[int], steps: int = 5, alone_equal: bool = False):
    """Three sessions of model at different lengths (12, 21, 30 prompt tokens) decoding
    `steps` tokens together in batched steps (steps.decode_many), beside a copy of the
    second decoding alone: (logits [steps, 3, V], the three sessions). alone_equal: each step's
    second row must equal the lone copy's, bit for bit (the native decoder's promise)."""
    sess = [KVSession(model, MAX_POS, 16) for _ in range(3)]
    for i, s in enumerate(sess):
        s.prefill(ids[:12 + 9 * i])
    solo = KVSession(model, MAX_POS, 16)
    solo.copy_prefix(sess[1], len(sess[1]))
    toks = [ids[30 + i] for i in range(3)]
    rows = []
    for step in range(steps):
        rows.append(torch.stack(list(decode_many(sess, [t + step for t in toks]))))
        alone = solo.decode(toks[1] + step)      # the batch of one
        if alone_equal:
            assert torch.equal(alone, rows[-1][1]), step
    return torch.stack(rows), sess


def last_logits(w, name: str) -> torch.Tensor:
    """Our logits after the prompt of case `name`, from loaded weights w (changed or not)."""
    s = KVSession(Llama(w, MAX_POS), MAX_POS, 64)
    return s.prefill(_prompt(name), logits_at=[PROMPT])[PROMPT]


_REFERENCES = {}


def _reference(m, ids: list[int]):
    """_transformers' answer, computed once per model and prompt."""
    key = (id(m), tuple(ids))
    if key not in _REFERENCES:
        _REFERENCES[key] = _transformers(m, ids)
    return _REFERENCES[key]


@torch.inference_mode()
def _transformers(m, ids: list[int]):
    """transformers: logits after every prompt token, then GREEDY greedy tokens, each the
    argmax of a full forward over the sequence so far (no cache API to track across versions)."""
    logits = m(torch.tensor([ids]), use_cache=False).logits[0].float()
    seq, toks = list(ids), []
    nxt = int(logits[-1].argmax())
    for _ in range(GREEDY):
        toks.append(nxt)
        seq.append(nxt)
        nxt = int(m(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax())
    return logits, toks


def _ours(path: str, ids: list[int], kernels: str = "native"):
    """Prefill, then greedy decode with the server's native decode (native.Decoder; torch's
    path for a model it does not take, as qwen3moe) or with torch's ops only."""
    model = Llama(load(path, torch.float32, "cpu"), MAX_POS, kernels=native.load() if kernels == "native" else None)
    s = KVSession(model, MAX_POS, 16)        # chunks of 16: the prompt crosses two boundaries
    got = s.prefill(ids, logits_at=range(1, len(ids) + 1))
    logits = torch.stack([got[n] for n in range(1, len(ids) + 1)])
    toks = []
    for _ in range(GREEDY):
        toks.append(int(s.logits.argmax()))
        s.decode(toks[-1])
    return model, logits, toks
