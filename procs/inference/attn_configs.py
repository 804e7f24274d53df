"""How the models whose attention is not the Llama's read their config.json or GGUF metadata
into ModelConfig's fields: multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash; mla.py)
and the Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5; gdn.py). The readers they build on
(experts, partial RoPE, GLM-4.5's routing) are in arch_configs.py."""
from __future__ import annotations

import math

from procs.inference.arch_configs import as_f32, hf_glm4moe, hf_moe, hf_partial_rope
from procs.inference.rope import ModelLoadError


def hf_mla(c: dict, where: str) -> dict:
    """Multi-head latent attention's ModelConfig fields (mla.py) from a config.json, with
    GLM-4.5's experts (GLM-4.7-Flash, DeepSeek-V3; DeepSeek-V2's by softmax): one K/V head
    of kv_lora_rank + qk_rope_head_dim dims, RoPE over the last qk_rope_head_dim, the
    softmax scale of the unabsorbed head
    (qk_nope + qk_rope)^-0.5, times YaRN's mscale_all_dim squared where the config scales
    (transformers' yarn_apply_mscale); the first layers dense as mlp_layer_types (or
    first_k_dense_replace) say."""
    try:
        r, rope, nope, v = (int(c[k]) for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"))
    except (KeyError, TypeError) as e:
        raise ModelLoadError(f"{where}: latent attention needs {e}") from None
    if rope % 2 or (r + rope) % 2:
        raise ModelLoadError(f"{where}: odd rotary or latent dims ({rope}, {r})")
    moe = hf_glm4moe({**c, "partial_rotary_factor": None}, rope, where)
    if c.get("model_type") == "deepseek_v2":      # softmax, unrenormalized unless said, no bias
        if c.get("topk_method") not in (None, "greedy") and int(c.get("n_group") or 1) > 1:
            raise ModelLoadError(f"{where}: DeepSeek-V2's group-limited routing is not supported")
        moe.update(moe_gating="softmax", moe_norm_topk=bool(c.get("norm_topk_prob", False)), moe_groups=1,
                   moe_groups_used=1)
    rp = c.get("rope_parameters") or c.get("rope_scaling") or {}
    scale = (nope + rope) ** -0.5
    if rp.get("rope_type", rp.get("type", "default")) not in ("default", None) and rp.get("mscale_all_dim"):
        # yarn_mscale's 1 + 0.1 m ln(factor), with 0.1 m in f32 as a GGUF stores it
        # (yarn_log_multiplier): one config, one fingerprint, whichever file
        mul = as_f32(0.1 * float(rp["mscale_all_dim"]))
        scale *= (1 + mul * math.log(float(rp["factor"]))) ** 2
    types = c.get("mlp_layer_types")
    dense = next((i for i, t in enumerate(types) if t != "dense"), len(types)) if types else \
        int(c.get("first_k_dense_replace", 1 if c.get("model_type") == "glm4_moe_lite" else 0))
    # the routed scale as a GGUF stores it (f32): one config, one fingerprint, whichever file
    moe["moe_scale"] = as_f32(moe["moe_scale"])
    # (moe's rope fields: hf_partial_rope over the rope dims, the whole of them: rope_dims 0 there)
    return {**moe, "rope_dims": rope,
            "dense_layers": dense, "attn_scale": scale, "kv_lora": r, "q_lora": int(c.get("q_lora_rank") or 0),
            "qk_nope": nope, "v_head_dim": v, "head_dim": r + rope, "n_kv_heads": 1}


def gguf_mla(meta: dict, prefix: str, where: str, score_bias: bool) -> dict:
    """The same from a deepseek2 GGUF, as llama.cpp's converter writes it: key_length is the
    cached row (kv_lora_rank + rope) and key_length_mla the unabsorbed head (nope + rope)
    since kv_b was split into attn_k_b and attn_v_b; older files state the unabsorbed head
    in key_length. Experts gated by sigmoid (GLM-4.7-Flash, DeepSeek-V3) or softmax
    (DeepSeek-V2). YaRN (DeepSeek-V2's): the softmax scale times (1 + yarn_log_multiplier
    ln(factor))^2, the converter's 0.1 mscale_all_dim making it transformers' mscale^2."""
    get = lambda k, d=None: meta.get(prefix + k, d)
    mscale = 1.0
    if get("rope.scaling.type") == "yarn" and float(get("rope.scaling.factor", 1.0)) > 1:
        mscale = 1 + float(get("rope.scaling.yarn_log_multiplier", 0.0)) * math.log(float(get("rope.scaling.factor")))
    try:
        r, rope = int(meta[prefix + "attention.kv_lora_rank"]), int(meta[prefix + "rope.dimension_count"])
        k_len = int(get("attention.key_length_mla", 0)) or int(meta[prefix + "attention.key_length"])
        v = int(get("attention.value_length_mla", 0)) or int(meta[prefix + "attention.value_length"])
        moe = dict(ffn_dim=int(meta[prefix + "expert_feed_forward_length"]),
                   n_experts=int(meta[prefix + "expert_count"]), n_experts_used=int(meta[prefix + "expert_used_count"]))
    except KeyError as e:
        raise ModelLoadError(f"{where}: missing GGUF field {e}") from None
    # a file without the key (GLM-4.7-Flash's first conversions): sigmoid where the router
    # has a score bias (DeepSeek-V3's and GLM's, both sigmoid), else softmax (V2's)
    gating = {1: "softmax", 2: "sigmoid"}.get(int(get("expert_gating_func", 2 if score_bias else 1)))
    if gating is None or not int(get("expert_shared_count", 0)):
        raise ModelLoadError(f"{where}: latent attention's experts need softmax or sigmoid gating and a shared expert")
    return {**moe, "moe_norm_topk": bool(get("expert_weights_norm", False)), "moe_gating": gating,
            "moe_scale": float(get("expert_weights_scale", 1.0)) or 1.0,
            "moe_groups": int(get("expert_group_count", 1)) or 1,
            "moe_groups_used": int(get("expert_group_used_count", 1)) or 1,
            "dense_layers": int(get("leading_dense_block_count", 0)), "rope_dims": rope,
            "attn_scale": k_len ** -0.5 * mscale ** 2, "kv_lora": r, "q_lora": int(get("attention.q_lora_rank", 0)),
            "qk_nope": k_len - rope, "v_head_dim": v,
            "head_dim": r + rope, "n_kv_heads": 1}


def hybrid_layers(n_layers: int, interval: int, layer_types=None) -> tuple[bool, ...]:
    """Qwen3-Next / Qwen3.5: per layer whether it is a Gated DeltaNet (linear attention); every
    interval-th is full attention unless layer_types says otherwise."""
    if layer_types is None:
        return tuple((i + 1) % interval != 0 for i in range(n_layers))
    return tuple(t == "linear_attention" for t in layer_types)


def hf_hybrid(c: dict, head_dim: int, where: str, moe: bool) -> dict:
    """Qwen3-Next's and Qwen3.5's ModelConfig fields from a config.json (text_config for
    Qwen3.5), as transformers reads them: RoPE over partial_rotary_factor of each head (0.25
    when absent; Qwen3.5's mrope sections rotate text positions as plain RoPE), the layer
    types (full_attention_interval 4 when absent), the DeltaNet's heads, and the experts,
    their weights renormalized (norm_topk_prob; always for Qwen3.5 MoE)."""
    rp = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    for k in ("mrope_section", "mrope_interleaved"):
        rp.pop(k, None)
    partial = rp.get("partial_rotary_factor") or c.get("partial_rotary_factor") or 0.25
    out = hf_partial_rope({**c, "rope_parameters": {**rp, "partial_rotary_factor": partial}}, head_dim, where)
    n = c["num_hidden_layers"]
    out.update(linear_layers=hybrid_layers(n, int(c.get("full_attention_interval") or 4), c.get("layer_types")),
               ssm_conv=int(c.get("linear_conv_kernel_dim", 4)), ssm_k_heads=int(c.get("linear_num_key_heads", 16)),
               ssm_v_heads=int(c.get("linear_num_value_heads", 32)), ssm_k_dim=int(c.get("linear_key_head_dim", 128)),
               ssm_v_dim=int(c.get("linear_value_head_dim", 128)))
    if out["ssm_v_heads"] % out["ssm_k_heads"]:
        raise ModelLoadError(f"{where}: {out['ssm_v_heads']} value heads over {out['ssm_k_heads']} key heads")
    if moe:
        out.update({**hf_moe({**c, "norm_topk_prob": c.get("norm_topk_prob", True)}, where)})
    else:
        out["ffn_dim"] = int(c["intermediate_size"])
    return out


def gguf_hybrid(meta: dict, prefix: str, where: str, n_layers: int, moe: bool) -> dict:
    """The same from GGUF metadata, as llama.cpp's qwen3next / qwen35 read it: the DeltaNet's
    conv_kernel, group_count (key heads), time_step_rank (value heads), state_size (the key
    head's dims, and the value head's: inner_size / value heads)."""
    get = lambda k, d=None: meta.get(prefix + k, d)
    try:
        nv = int(meta[prefix + "ssm.time_step_rank"])
        out = dict(linear_layers=hybrid_layers(n_layers, int(get("full_attention_interval", 4))),
                   ssm_conv=int(meta[prefix + "ssm.conv_kernel"]), ssm_k_heads=int(meta[prefix + "ssm.group_count"]),
                   ssm_v_heads=nv, ssm_k_dim=int(meta[prefix + "ssm.state_size"]),
                   ssm_v_dim=int(meta[prefix + "ssm.inner_size"]) // nv)
        if moe:
            out.update(ffn_dim=int(meta[prefix + "expert_feed_forward_length"]),
                       n_experts=int(meta[prefix + "expert_count"]),
                       n_experts_used=int(meta[prefix + "expert_used_count"]), moe_norm_topk=True)
        else:
            out["ffn_dim"] = int(meta[prefix + "feed_forward_length"])
    except KeyError as e:
        raise ModelLoadError(f"{where}: missing GGUF field {e}") from None
    if nv % out["ssm_k_heads"]:
        raise ModelLoadError(f"{where}: {nv} value heads over {out['ssm_k_heads']} key heads")
    return out
