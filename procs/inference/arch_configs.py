"""How each architecture reads its config.json or GGUF metadata into ModelConfig's fields
beyond the Llama geometry (procs/inference/archs.py describes the tensors; rope.py the RoPE
scaling): mixtures of experts, Phi-3's LongRoPE, gpt-oss's windows and SwiGLU, GLM-4.5's
routing, Gemma 3's windows and bases, SmolLM3's layers without RoPE, Ministral 3's query
scale. Latent attention's and the DeltaNet hybrids' readers: attn_configs.py."""
from __future__ import annotations

import struct

from procs.inference.gguf_tensors import dequant
from procs.inference.rope import ModelLoadError, hf_rope, longrope_attn

GPT_OSS_SWA_PATTERN = 2         # layer i slides when i % 2 == 0 (transformers' layer_types default)
GEMMA3_SWA_PATTERN = 6
GEMMA3_LOCAL_THETA = 10000.0
# transformers' class defaults for the keys a released config.json leaves out (Gemma 3
# 4B/12B/27B's text_config names only what differs from Gemma3TextConfig's)
HF_DEFAULTS = {"gemma3_text": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                                   num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                                   max_position_embeddings=131072, rms_norm_eps=1e-6, query_pre_attn_scalar=256,
                                   sliding_window=4096)}


def hf_text_config(c: dict) -> dict:
    """The language model's config: a multimodal checkpoint's text_config (Gemma 3 4B and up,
    Mistral Small 3.1 and later, Ministral 3), or c itself, with transformers' defaults for
    the keys it leaves out."""
    if isinstance(c.get("text_config"), dict):
        c = c["text_config"]
    return {**HF_DEFAULTS.get(c.get("model_type"), {}), **c}


def hf_phi3(c: dict, head_dim: int, where: str) -> dict:
    """Phi-3's RoPE fields from a config.json: partial rotary embeddings (rope_dims, Phi-4
    mini's 0.75) and LongRoPE (Phi-3 128k, Phi-3.5, Phi-4 mini): per-frequency factors, the
    short set up to the trained context and the long set beyond (Llama picks one by its
    context, as llama.cpp does; transformers by the sequence's length), and an attention
    factor, as transformers' _compute_longrope_parameters reads them."""
    rp = c.get("rope_parameters") or c.get("rope_scaling") or {}
    theta = float(rp.get("rope_theta", c.get("rope_theta", 10000.0)))
    partial = float(rp.get("partial_rotary_factor") or c.get("partial_rotary_factor") or 1.0)
    dims = int(head_dim * partial)
    out = dict(rope_theta=theta, rope_dims=dims if dims != head_dim else 0)
    kind = rp.get("rope_type", rp.get("type", "default")) or "default"
    if kind == "default":
        return out
    if kind not in ("longrope", "su"):
        raise ModelLoadError(f"{where}: unsupported RoPE scaling {kind!r} for phi3 (default, longrope)")
    orig = int(c.get("original_max_position_embeddings") or rp["original_max_position_embeddings"])
    short, long = tuple(float(x) for x in rp["short_factor"]), tuple(float(x) for x in rp["long_factor"])
    if len(short) != dims // 2 or len(long) != dims // 2:
        raise ModelLoadError(f"{where}: LongRoPE factors of {len(short)} and {len(long)}, not {dims // 2}")
    attn = rp.get("attention_factor")
    if attn is None:
        attn = longrope_attn(float(rp.get("factor") or c["max_position_embeddings"] / orig), orig)
    return {**out, "rope_factors": short, "rope_factors_long": long, "rope_long_from": orig,
            "rope_attn_factor": float(attn)}


def gguf_phi3(g, p: str, head_dim: int, rope_dims: int, where: str) -> dict:
    """Phi-3's extra fields as llama.cpp's converter writes them: rope.dimension_count below
    the head size (partial rotary), LongRoPE's factor tensors with original_context_length
    and rope.scaling.attn_factor, and the sliding window."""
    m = g.meta
    window = int(m.get(p + "attention.sliding_window", 0))
    out = dict(windows=(window,) * int(m[p + "block_count"]) if window else (),
               rope_dims=rope_dims if rope_dims != head_dim else 0)
    if "rope_factors_long.weight" not in g.tensors:
        return out
    long, short = (tuple(dequant(g, f"rope_factors_{k}.weight").tolist()) for k in ("long", "short"))
    if len(long) != rope_dims // 2 or len(short) != rope_dims // 2:
        raise ModelLoadError(f"{where}: LongRoPE factors of {len(short)} and {len(long)}, not {rope_dims // 2}")
    orig = int(m.get(p + "rope.scaling.original_context_length", 0))
    if not orig:
        raise ModelLoadError(f"{where}: LongRoPE without rope.scaling.original_context_length")
    return {**out, "rope_factors": short, "rope_factors_long": long, "rope_long_from": orig,
            "rope_attn_factor": float(m.get(p + "rope.scaling.attn_factor", 1.0))}


def hf_moe(c: dict, where: str) -> dict:
    """A mixture-of-experts config's ModelConfig fields (Qwen3 MoE). Only the layout where
    every layer's MLP is the experts is supported: transformers makes layer i dense when it
    is in mlp_only_layers or (i + 1) % decoder_sparse_step != 0."""
    if c.get("mlp_only_layers") or int(c.get("decoder_sparse_step") or 1) != 1:
        raise ModelLoadError(f"{where}: dense MLP layers among the expert layers (mlp_only_layers, "
                             f"decoder_sparse_step) are not supported")
    n = c.get("num_experts", c.get("num_local_experts"))   # transformers 5 saves the latter
    if not n or not c.get("num_experts_per_tok") or not c.get("moe_intermediate_size"):
        raise ModelLoadError(f"{where}: a mixture of experts needs num_experts, num_experts_per_tok "
                             f"and moe_intermediate_size")
    return dict(ffn_dim=int(c["moe_intermediate_size"]), n_experts=int(n),
                n_experts_used=int(c["num_experts_per_tok"]), moe_norm_topk=bool(c.get("norm_topk_prob", False)))


def gguf_moe(meta: dict, prefix: str, where: str) -> dict:
    """The same fields from GGUF metadata. llama.cpp's qwen3moe graph always renormalizes the
    top-k weights (norm_topk_prob: true in every released Qwen3 MoE) and has no dense layers."""
    try:
        fields = dict(ffn_dim=int(meta[prefix + "expert_feed_forward_length"]),
                      n_experts=int(meta[prefix + "expert_count"]),
                      n_experts_used=int(meta[prefix + "expert_used_count"]), moe_norm_topk=True)
    except KeyError as e:
        raise ModelLoadError(f"{where}: missing GGUF field {e}") from None
    if int(meta.get(prefix + "leading_dense_block_count", 0)) or int(meta.get(prefix + "expert_shared_count", 0)):
        raise ModelLoadError(f"{where}: dense or shared-expert MLPs are not supported")
    # 1: softmax over all, 3 (gpt-oss): softmax over the chosen logits, which is the former
    # renormalized (moe_norm_topk)
    if int(meta.get(prefix + "expert_gating_func", 1)) not in (1, 3):
        raise ModelLoadError(f"{where}: only softmax expert gating is supported")
    return fields


def hf_gpt_oss(c: dict, head_dim: int, where: str) -> dict:
    """gpt-oss's ModelConfig fields from a config.json: its experts (each ffn wide; the router's
    softmax over the chosen k logits is the renormalized softmax over all), the alternating
    windows, YaRN (truncate false in the released configs: the ramp's bounds not rounded, as
    OpenAI's reference computes them), the clamped SwiGLU's alpha and limit."""
    n = c.get("num_local_experts", c.get("num_experts"))
    if not n or not c.get("num_experts_per_tok"):
        raise ModelLoadError(f"{where}: a mixture of experts needs num_local_experts and num_experts_per_tok")
    rp = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    rp.setdefault("rope_theta", c.get("rope_theta", 150000.0))
    theta, factors, attn = hf_rope({**c, "rope_parameters": rp}, head_dim, where)
    layers = int(c["num_hidden_layers"])
    types = c.get("layer_types") or ["sliding_attention" if i % GPT_OSS_SWA_PATTERN == 0 else "full_attention"
                                     for i in range(layers)]
    window = int(c.get("sliding_window") or 0)
    return dict(rope_theta=theta, rope_factors=factors, rope_attn_factor=attn, ffn_dim=int(c["intermediate_size"]),
                n_experts=int(n), n_experts_used=int(c["num_experts_per_tok"]), moe_norm_topk=True,
                windows=tuple(window if t == "sliding_attention" else 0 for t in types) if window else (),
                swiglu_alpha=float(c.get("swiglu_alpha", 1.702)), swiglu_limit=float(c.get("swiglu_limit", 7.0)))


def gguf_gpt_oss(meta: dict, prefix: str, n_layers: int) -> dict:
    """The same from GGUF metadata, as llama.cpp reads it: pattern 2 from layer 0, its SwiGLU
    constants (the converter writes none), YaRN's ramp unrounded (see hf_gpt_oss)."""
    window = int(meta.get(prefix + "attention.sliding_window", 0))
    windows = tuple(window if i % GPT_OSS_SWA_PATTERN == 0 else 0 for i in range(n_layers)) if window else ()
    return dict(windows=windows, swiglu_alpha=1.702, swiglu_limit=7.0)


def nope_layers(n_layers: int, every: int = 4) -> tuple[bool, ...]:
    """SmolLM3's layers without RoPE: every `every`-th (transformers' no_rope_layer_interval
    default, llama.cpp's n_no_rope_layer_step)."""
    return tuple((i + 1) % every == 0 for i in range(n_layers))


def hf_partial_rope(c: dict, head_dim: int, where: str) -> dict:
    """RoPE over the first partial_rotary_factor of each head's dims (GLM: 0.5), from a
    config.json: theta, divisors and attention factor over those dims, rope_dims."""
    rp = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    partial = float(rp.pop("partial_rotary_factor", None) or c.get("partial_rotary_factor") or 1.0)
    dims = int(head_dim * partial)
    theta, factors, attn = hf_rope({**c, "partial_rotary_factor": None, "rope_parameters": rp}, dims, where)
    return dict(rope_theta=theta, rope_factors=factors, rope_attn_factor=attn, rope_dims=dims if dims != head_dim else 0)


def hf_glm4moe(c: dict, head_dim: int, where: str) -> dict:
    """GLM-4.5's ModelConfig fields from a config.json, as transformers' Glm4Moe reads them:
    RoPE over the first partial_rotary_factor of each head (0.5 in every release), routed
    experts (n_routed_experts) chosen by sigmoid score plus bias within the best topk_group
    of n_group groups, their weights renormalized (norm_topk_prob) and scaled
    (routed_scaling_factor), the first first_k_dense_replace layers dense."""
    n = c.get("n_routed_experts", c.get("num_local_experts"))
    if not n or not c.get("num_experts_per_tok") or not c.get("moe_intermediate_size"):
        raise ModelLoadError(f"{where}: a mixture of experts needs n_routed_experts, num_experts_per_tok "
                             f"and moe_intermediate_size")
    if int(c.get("n_shared_experts") or 0) < 1:
        raise ModelLoadError(f"{where}: GLM's experts without a shared expert are not supported")
    return dict(**hf_partial_rope(c, head_dim, where), ffn_dim=int(c["moe_intermediate_size"]), n_experts=int(n),
                n_experts_used=int(c["num_experts_per_tok"]), moe_norm_topk=bool(c.get("norm_topk_prob", True)), moe_gating="sigmoid",
                moe_scale=float(c.get("routed_scaling_factor") or 1.0),
                moe_groups=int(c.get("n_group") or 1), moe_groups_used=int(c.get("topk_group") or 1),
                dense_layers=int(c.get("first_k_dense_replace") or 0))


def as_f32(x: float) -> float:
    """x as a GGUF stores it (f32): a config.json read the same as its GGUF."""
    return struct.unpack("f", struct.pack("f", x))[0]


def gguf_glm4moe(meta: dict, prefix: str, where: str) -> dict:
    """The same from GGUF metadata, as llama.cpp's glm4moe reads it (sigmoid gating when the
    file names none; groups where the file sets them, as the converter does for n_group > 1)."""
    get = lambda k, d=None: meta.get(prefix + k, d)
    if int(get("expert_gating_func", 2)) != 2:
        raise ModelLoadError(f"{where}: GLM's experts with softmax gating are not supported")
    if not int(get("expert_shared_count", 0)):
        raise ModelLoadError(f"{where}: GLM's experts without a shared expert are not supported")
    try:
        return dict(ffn_dim=int(meta[prefix + "expert_feed_forward_length"]),
                    n_experts=int(meta[prefix + "expert_count"]),
                    n_experts_used=int(meta[prefix + "expert_used_count"]),
                    moe_norm_topk=bool(get("expert_weights_norm", False)), moe_gating="sigmoid",
                    moe_scale=float(get("expert_weights_scale", 1.0)) or 1.0,
                    moe_groups=int(get("expert_group_count", 1)) or 1,
                    moe_groups_used=int(get("expert_group_used_count", 1)) or 1,
                    dense_layers=int(get("leading_dense_block_count", 0)))
    except KeyError as e:
        raise ModelLoadError(f"{where}: missing GGUF field {e}") from None


def gemma3_layers(n_layers: int, window: int, pattern: int = GEMMA3_SWA_PATTERN,
                  layer_types=None) -> tuple[int, ...]:
    """Per-layer sliding window (0: global attention)."""
    if layer_types is None:
        layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                       for i in range(n_layers)]
    return tuple(window if t == "sliding_attention" else 0 for t in layer_types)


def hf_gemma3(c: dict, head_dim: int, where: str) -> dict:
    """Gemma 3's extra ModelConfig fields from a config.json: RoPE per layer type (transformers
    5's rope_parameters keyed by layer type, or the older rope_theta / rope_local_base_freq /
    rope_scaling), the sliding windows, the attention scale."""
    rp = c.get("rope_parameters") or {}
    if "full_attention" in rp or "sliding_attention" in rp:
        full, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
    else:
        full = {**(c.get("rope_scaling") or {}), "rope_theta": c.get("rope_theta", 1e6)}
        local = {"rope_theta": c.get("rope_local_base_freq", GEMMA3_LOCAL_THETA)}
    if (local.get("rope_type") or "default") != "default":
        raise ModelLoadError(f"{where}: scaled RoPE on sliding-window layers is not supported")
    theta, factors, attn = hf_rope({**c, "rope_parameters": {"rope_theta": 1e6, **full}}, head_dim, where)
    n = c["num_hidden_layers"]
    return dict(rope_theta=theta, rope_factors=factors, rope_attn_factor=attn,
                rope_theta_local=float(local.get("rope_theta", GEMMA3_LOCAL_THETA)),
                windows=gemma3_layers(n, int(c.get("sliding_window") or 4096),
                                      int(c.get("sliding_window_pattern", GEMMA3_SWA_PATTERN)),
                                      c.get("layer_types")),
                attn_scale=float(c.get("query_pre_attn_scalar", head_dim)) ** -0.5,
                embed_scale=float(c["hidden_size"]) ** 0.5)


def gguf_gemma3(meta: dict, prefix: str, n_layers: int, dim: int, n_heads: int, head_dim: int) -> dict:
    """Gemma 3's extra ModelConfig fields as llama.cpp reads them from a GGUF: pattern 6,
    local base 10000, and its attention scale (1/sqrt(dim/heads) for the 62-layer 27B, whose
    query_pre_attn_scalar is that, else 1/sqrt(head_dim))."""
    window = int(meta.get(prefix + "attention.sliding_window", 0))
    scale_dim = dim / n_heads if n_layers == 62 else head_dim
    return dict(rope_theta_local=GEMMA3_LOCAL_THETA,
                windows=gemma3_layers(n_layers, window) if window else (0,) * n_layers,
                attn_scale=float(scale_dim) ** -0.5, embed_scale=float(dim) ** 0.5)


def hf_q_scale(c: dict, where: str) -> dict:
    """Ministral 3's query scale (transformers' get_llama_4_attn_scale) from its
    rope_parameters: llama_4_scaling_beta (at f32 precision, as a GGUF stores it, so both
    files make one config), over original_max_position_embeddings."""
    rp = c.get("rope_parameters") or c.get("rope_scaling") or {}
    beta = float(rp.get("llama_4_scaling_beta") or 0.0)
    if not beta:
        return {}
    floor = rp.get("original_max_position_embeddings") or c.get("original_max_position_embeddings")
    if not floor:
        raise ModelLoadError(f"{where}: llama_4_scaling_beta without original_max_position_embeddings")
    return dict(q_scale_beta=as_f32(beta), q_scale_floor=int(floor))


def gguf_q_scale(meta: dict, prefix: str, where: str) -> dict:
    """The same from GGUF metadata: attention.temperature_scale, over
    attention.temperature_length where the file has it, else YaRN's original context (as
    llama.cpp's mistral3 reads them)."""
    beta = float(meta.get(prefix + "attention.temperature_scale", 0.0))
    if not beta:
        return {}
    floor = int(meta.get(prefix + "attention.temperature_length", 0)
                or meta.get(prefix + "rope.scaling.original_context_length", 0))
    if not floor:
        raise ModelLoadError(f"{where}: attention.temperature_scale without rope.scaling.original_context_length")
    return dict(q_scale_beta=beta, q_scale_floor=floor)
