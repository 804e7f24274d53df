"""Load a Hugging Face safetensors dir (config.json, *.safetensors) into torch: the same
ModelConfig and tensor names as a GGUF of the same model (procs/inference/loader.py), rows
reordered as the GGUF's (procs/inference/rows.py), gpt-oss's MXFP4 experts packed as the
GGUF's are, with dense values made only if torch's path reads them."""
from __future__ import annotations

import glob
import json
import os
from dataclasses import replace

import torch

from procs.inference.gguf_tensors import Lazy, mxfp4_levels, mxfp4_rows
from procs.inference.hf_files import gpt_oss_experts, read_safetensors, text_tensors
from procs.inference.rows import (ROTATED, grouped_rows, mla_rows, rotary_perm, rotary_rows, split_fused,
                                  tile_v_heads)
from procs.inference.archs import (ModelLoadError, arch_of, check_unused, hf_gemma3, hf_glm4moe, hf_gpt_oss,
                                   hf_hybrid, hf_mla, hf_moe, hf_partial_rope, hf_phi3, hf_q_scale, hf_rope,
                                   hf_text_config, hf_variant, layer_names, nope_layers, tensor_name)
from procs.inference.weights import LoadedWeights, ModelConfig, fingerprint


def load_hf_dir(path: str, dtype: torch.dtype, device: str) -> LoadedWeights:
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    multimodal = isinstance(c.get("text_config"), dict)
    c = hf_text_config(c)
    arch = hf_variant(arch_of(str(c.get("model_type")), path), c)
    if c.get("use_sliding_window"):
        raise ModelLoadError(f"{path}: sliding-window attention is not supported")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files")
    st = {}
    for fp in files:
        st.update(read_safetensors(fp))
    if multimodal:
        st = text_tensors(st)
    missing = [k for k in _HF_REQUIRED if k not in c]
    if missing:
        raise ModelLoadError(f"{path}: config.json has no {', '.join(missing)}")
    return _hf_weights(path, c, arch, st, dtype, device)


_HF_REQUIRED = ("num_attention_heads", "hidden_size", "num_hidden_layers", "vocab_size", "rms_norm_eps")


def _hf_weights(path: str, c: dict, arch, st: dict, dtype: torch.dtype, device: str) -> LoadedWeights:
    n_heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // n_heads
    if arch.name == "gemma3":
        extra = hf_gemma3(c, head_dim, path)
        if c.get("final_logit_softcapping") or c.get("attn_logit_softcapping"):
            raise ModelLoadError(f"{path}: logit soft-capping is not supported")
    elif arch.fused:
        extra = hf_phi3(c, head_dim, path)
    mx = {}
    if arch.name == "gpt-oss":
        extra = hf_gpt_oss(c, head_dim, path)
        mx = gpt_oss_experts(st)
    elif arch.mla:     # DeepSeek-V2's router has no score bias; V3's and GLM-4.7-Flash's have
        arch = replace(arch, score_bias=any(k.endswith("e_score_correction_bias") for k in st))
        extra = hf_mla(c, path)
        head_dim = extra.pop("head_dim")
    elif arch.linear_attn:
        extra = hf_hybrid(c, head_dim, path, arch.moe)
        if arch.ssm_tiled:
            extra["ssm_tiled"] = True
    elif arch.shared_expert:
        extra = hf_glm4moe(c, head_dim, path)
    elif arch.partial_rope:         # GLM-4
        extra = hf_partial_rope(c, head_dim, path)
    elif arch.name != "gemma3" and not arch.fused:
        extra = dict(zip(("rope_theta", "rope_factors", "rope_attn_factor"), hf_rope(c, head_dim, path)))
        if arch.name == "smollm3":   # no_rope_layers: 1 where a layer rotates
            flags = c.get("no_rope_layers") or nope_layers(c["num_hidden_layers"], c.get("no_rope_layer_interval", 4))
            extra["no_rope"] = tuple(not f for f in flags)
        if arch.name == "ministral3":
            extra.update(hf_q_scale(c, path))
    if arch.name != "gpt-oss" and not arch.shared_expert and not arch.linear_attn:
        extra.update(hf_moe(c, path) if arch.moe else dict(ffn_dim=c["intermediate_size"]))
    if arch.fused and c.get("sliding_window"):
        extra["windows"] = (int(c["sliding_window"]),) * c["num_hidden_layers"]
    cfg = ModelConfig(
        n_layers=c["num_hidden_layers"], dim=c["hidden_size"],
        n_heads=n_heads, n_kv_heads=extra.pop("n_kv_heads", c.get("num_key_value_heads", n_heads)),
        head_dim=head_dim, vocab_size=c["vocab_size"],
        norm_eps=float(c["rms_norm_eps"]), max_context=int(c.get("max_position_embeddings", 4096)),
        tied_embeddings="lm_head.weight" not in st, quant_bits=16, arch=arch.name, act=arch.act, **extra)
    check_unused(arch, st, r"model\.layers\.\d+\.", 0, path)
    names = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm",
             "lm_head.weight": "lm_head"}
    for i in range(cfg.n_layers):
        for ours in layer_names(arch, i < cfg.dense_layers, cfg.is_linear(i)):
            names[f"model.layers.{i}.{tensor_name(arch, ours, 0)}"] = f"layers.{i}.{ours}"
    tensors, q8p, norms = Lazy(), Lazy(), {}
    for hf, ours in names.items():
        if hf in mx:     # MXFP4 experts: levels for the kernels' packs, dense values only if read
            blocks, scales = mx[hf]
            tensors.later(ours, lambda b=blocks, s=scales: mxfp4_rows(b, s).to(device=device, dtype=dtype))
            q8p.later(ours, lambda b=blocks, s=scales, n=ours: mxfp4_levels(b, s, f"{path}: {n}"))
            continue
        if "{e}" in hf:   # one tensor per expert: stacked as a GGUF stores them, [E, rows, cols]
            hf = [hf.format(e=e) for e in range(cfg.n_experts)]
        missing = [n for n in (hf if isinstance(hf, list) else [hf]) if n not in st]
        if missing:
            if ours == "lm_head":
                continue
            raise ModelLoadError(f"{path}: missing tensor {missing[0]}")
        w = torch.stack([st[n] for n in hf]) if isinstance(hf, list) else st[hf]
        short = ours.rsplit(".", 1)[-1]
        if ours.endswith("norm"):   # as a GGUF stores it: Gemma's (1 + w) folded in (not the DeltaNet's)
            w = w.float() + (arch.hf_norm_offset if short != "ssm_norm" else 0.0)
            norms[ours] = w
        elif short == "ssm_a":      # A_log, as llama.cpp's converter stores it: -exp(A_log)
            w = -w.float().exp()
        elif short == "ssm_conv":   # [conv_dim, 1, K] -> [conv_dim, K]
            w = w.reshape(w.shape[0], -1)
        f32 = (arch.score_bias and short in ("router", "router_sb")) or short == "ssm_a"   # read in f32
        tensors[ours] = w.to(device=device, dtype=torch.float32 if f32 else dtype)
    perm = rotary_perm(cfg.head_dim, cfg.rope_dims, arch.interleaved_rope) if arch.partial_rope else None
    for name in [n for n in tensors if perm is not None and n.rsplit(".", 1)[-1] in ROTATED]:
        tensors[name] = rotary_rows(tensors[name], cfg.head_dim, perm)
    mla = mla_rows(cfg) if arch.mla and c.get("rope_interleave", True) else {}
    for name in [n for n in tensors if n.rsplit(".", 1)[-1] in mla]:
        tensors[name] = grouped_rows(tensors[name], *mla[name.rsplit(".", 1)[-1]])
    if arch.fused or arch.fused_mlp or arch.linear_attn:
        split_fused(tensors, cfg)
    if arch.ssm_tiled:              # Qwen3.5's value heads in llama.cpp's order (ModelConfig.ssm_tiled)
        tile_v_heads(tensors, cfg)
    return LoadedWeights(cfg, tensors, fingerprint(cfg, norms), {}, frozenset(q8p), q8p)
