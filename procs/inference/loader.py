"""Load a checkpoint (a GGUF file here, a Hugging Face safetensors dir in hf_load.py) into torch.

The architectures (Llama, Mistral, Qwen2, Qwen3, Qwen3 MoE, Phi-3, Gemma 3, gpt-oss, GLM,
GLM-4.7-Flash's latent attention, Qwen3-Next's and Qwen3.5's linear attention among others)
are described in procs/inference/archs.py.
Format quirks live here, never in forward(): Llama-family GGUFs store Q/K rows permuted for
llama.cpp's adjacent-pair RoPE, and we un-permute them to the Hugging Face half-split layout
the model uses; quantized tensors are dequantized once, into the compute dtype.
"""
from __future__ import annotations

import os
from dataclasses import replace

import torch

from common.gguf_file import GGUFError, GGUFFile
from procs.inference.gguf_tensors import (EXACT_INT8_TYPES, INT4_TYPES, INT8_TYPES, Lazy, dequant, dequant_to,
                                          q4_parts, q8_parts)
from procs.inference.hf_load import load_hf_dir
from procs.inference.rows import (ROTATED, grouped_rows, mla_rows, rotary_perm, rotary_rows, split_fused,
                                  unpermute)
from procs.inference.archs import (ModelLoadError, arch_of, check_unused, fused_rows, gguf_gemma3, gguf_glm4moe,
                                   gguf_hybrid, gguf_mla, gguf_gpt_oss, gguf_moe, gguf_phi3, gguf_q_scale, gguf_rope,
                                   gguf_variant, layer_names, nope_layers, tensor_name)
from procs.inference.weights import LoadedWeights, ModelConfig, fingerprint

QUANT_BITS = {"F32": 32, "F16": 16, "BF16": 16, "Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5,
              "Q5_1": 5, "Q2_K": 2, "Q3_K": 3, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6, "MXFP4": 4}


def load_gguf(path: str, dtype: torch.dtype, device: str) -> LoadedWeights:
    g = GGUFFile(path, strings=False)
    arch = gguf_variant(arch_of(g.arch(), path), g.tensors)
    m = g.meta
    p = g.arch() + "."
    try:
        n_heads = int(m[p + "attention.head_count"])
        dim = int(m[p + "embedding_length"])
        emb = g.tensors["token_embd.weight"]
    except KeyError as e:
        raise ModelLoadError(f"{path}: missing GGUF field {e}") from None
    types = {}
    for t in g.tensors.values():
        if t.name.endswith(".weight") and len(t.shape) >= 2:   # experts are 3-D
            types[t.type_name] = types.get(t.type_name, 0) + 1
    main_type = max(types, key=types.get)
    head_dim = int(m.get(p + "attention.key_length", dim // n_heads))
    rf = dequant(g, "rope_freqs.weight").tolist() if "rope_freqs.weight" in g.tensors else None
    rope_dims = int(m.get(p + "rope.dimension_count", head_dim)) if arch.fused or arch.partial_rope or arch.mla \
        else head_dim
    theta, factors, attn = gguf_rope(m, p, rope_dims, rf, path, truncate=arch.name != "gpt-oss",
                                     log_mul=arch.name == "ministral3", mla=arch.mla)
    n_layers = int(m[p + "block_count"])
    if arch.mla:
        # DeepSeek-V2's router has no score bias (exp_probs_b); V3's and GLM-4.7-Flash's have
        arch = replace(arch, score_bias=any(n.endswith(".exp_probs_b.bias") for n in g.tensors))
        extra = gguf_mla(m, p, path, arch.score_bias)
        head_dim = extra.pop("head_dim")
        n_layers -= int(m.get(p + "nextn_predict_layers", 0))     # MTP layers, not run
    elif arch.linear_attn:
        n_layers -= int(m.get(p + "nextn_predict_layers", 0))     # MTP layers, not run
        extra = {**gguf_hybrid(m, p, path, n_layers, arch.moe), "rope_dims": rope_dims if rope_dims != head_dim else 0}
        if arch.ssm_tiled:
            extra["ssm_tiled"] = True
    elif arch.shared_expert:
        extra = {**gguf_glm4moe(m, p, path), "rope_dims": rope_dims if rope_dims != head_dim else 0}
        n_layers -= int(m.get(p + "nextn_predict_layers", 0))     # MTP layers, not run
    else:
        extra = gguf_moe(m, p, path) if arch.moe else dict(ffn_dim=int(m[p + "feed_forward_length"]))
        if arch.partial_rope:       # GLM-4
            extra["rope_dims"] = rope_dims if rope_dims != head_dim else 0
    if arch.name == "smollm3":      # llama.cpp's step, which its GGUF does not state
        extra["no_rope"] = nope_layers(n_layers)
    if arch.name == "ministral3":
        extra.update(gguf_q_scale(m, p, path))
    if arch.name == "gpt-oss":
        extra.update(gguf_gpt_oss(m, p, int(m[p + "block_count"])))
    if arch.name == "gemma3":
        extra.update(gguf_gemma3(m, p, int(m[p + "block_count"]), dim, n_heads, head_dim))
    if arch.fused:
        extra.update(gguf_phi3(g, p, head_dim, rope_dims, path))
    cfg = ModelConfig(
        n_layers=n_layers, dim=dim,
        n_heads=n_heads, n_kv_heads=extra.pop("n_kv_heads", int(m.get(p + "attention.head_count_kv", n_heads))),
        head_dim=head_dim, vocab_size=int(emb.shape[1]), rope_theta=theta,
        norm_eps=float(m[p + "attention.layer_norm_rms_epsilon"]),
        max_context=int(m.get(p + "context_length", 4096)),
        tied_embeddings="output.weight" not in g.tensors, quant_bits=QUANT_BITS.get(main_type, 0),
        arch=arch.name, act=arch.act, **{"rope_factors": factors, "rope_attn_factor": attn, **extra})
    check_unused(arch, g.tensors, r"blk\.\d+\.", 1, path)
    names = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head"}
    for i in range(cfg.n_layers):
        for ours in layer_names(arch, i < cfg.dense_layers, cfg.is_linear(i), fmt=1):
            names[f"blk.{i}.{tensor_name(arch, ours, 1)}"] = f"layers.{i}.{ours}"
    # rows of Q per query head, of K per key/value head, when permuted (no permuted
    # architecture has q/k biases: archs.layer_names)
    permuted = {"wq": cfg.n_heads, "wk": cfg.n_kv_heads} if arch.gguf_permuted_qk else {}
    perm = rotary_perm(cfg.head_dim, cfg.rope_dims, arch.interleaved_rope) if arch.partial_rope else None
    mla = mla_rows(cfg) if arch.mla else {}      # llama.cpp rotates adjacent pairs: interleaved rows
    keep_f32 = ("router", "router_sb") if arch.score_bias else ("ssm_a",)   # sigmoid routing reads them in f32
    tensors, q4, q8, q8p, norms = Lazy(), Lazy(), set(), Lazy(), {}
    for gname, ours in names.items():
        if gname not in g.tensors:
            if ours == "lm_head":
                continue
            raise ModelLoadError(f"{path}: missing tensor {gname}")
        info = g.tensors[gname]
        if ours.endswith("_exps") and info.shape[-1] != cfg.n_experts:
            raise ModelLoadError(f"{path}: {gname} holds {info.shape[-1]} experts, not {cfg.n_experts}")
        short = ours.rsplit(".", 1)[-1]
        heads = permuted.get(short)
        rot = (lambda t: rotary_rows(t, cfg.head_dim, perm)) if perm is not None and short in ROTATED else \
            (lambda t, gr=mla[short]: grouped_rows(t, *gr)) if short in mla else None
        f32 = ours.endswith("norm") or short in keep_f32

        def dense(gname=gname, heads=heads, rot=rot, to=torch.float32 if f32 else dtype):
            w = dequant_to(g, gname, to)          # norms in f32: they are fingerprinted
            g.release(gname)
            w = unpermute(w, heads) if heads else w
            return (w if rot is None else rot(w)).to(device=device)
        if ours.endswith("norm"):     # fingerprinted as stored; q/k norms reordered after
            norms[ours] = dense(rot=None)
            tensors[ours] = (norms[ours] if rot is None else rot(norms[ours])).to(dtype)
        else:
            tensors.later(ours, dense)
        # a quantized source's parts (rows of levels, per-group scales...) in HF row order
        def parts(read, gname=gname, heads=heads, rot=rot):
            x = read(g, gname)
            g.release(gname)
            x = tuple(unpermute(t, heads) for t in x) if heads else x
            return x if rot is None else tuple(rot(t) for t in x)
        # experts: E * N rows (linear.experts); latent attention's per-head k_b, v_b: H * N rows (mla.py)
        flat = len(info.shape) == 2 or ours.endswith(("_exps", ".wk_b", ".wv_b"))
        if info.type_name in INT4_TYPES and flat:
            q4.later(ours, lambda parts=parts: parts(q4_parts))
        elif info.type_name in INT8_TYPES or (info.type_name == "MXFP4" and flat):
            q8.add(ours)
            if info.type_name in EXACT_INT8_TYPES and flat:     # (MXFP4's levels are integers too)
                q8p.later(ours, lambda parts=parts: parts(q8_parts))
    if arch.fused or arch.fused_mlp or arch.linear_attn:
        for d in (tensors, q4, q8p):
            split_fused(d, cfg)
        split = fused_rows(cfg)
        q8 = {f"{n.rsplit('.', 1)[0]}.{ours}" for n in q8
              for ours, _, _ in split.get(n.rsplit(".", 1)[-1], (None, ()))[1]} | \
            {n for n in q8 if n.rsplit(".", 1)[-1] not in split}
    return LoadedWeights(cfg, tensors, fingerprint(cfg, norms), q4, frozenset(q8), q8p)


def load(path: str, dtype: torch.dtype, device: str) -> LoadedWeights:
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise ModelLoadError(f"{path}: a model directory needs config.json, *.safetensors, tokenizer.json")
        return load_hf_dir(path, dtype, device)
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: no such model file")
    try:
        return load_gguf(path, dtype, device)
    except GGUFError as e:
        raise ModelLoadError(str(e)) from None
