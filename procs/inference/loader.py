"""Load a Llama-family checkpoint (GGUF, or a Hugging Face safetensors dir) into torch.

The architectures (Llama, Mistral, Qwen2, Qwen3, Qwen3 MoE, Phi-3, Gemma 3, gpt-oss, GLM,
GLM-4.7-Flash's latent attention, Qwen3-Next's and Qwen3.5's linear attention among others)
are described in procs/inference/archs.py.
Format quirks live here, never in forward(): Llama-family GGUFs store Q/K rows permuted for
llama.cpp's adjacent-pair RoPE, and we un-permute them to the Hugging Face half-split layout
the model uses; quantized tensors are dequantized once, into the compute dtype.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from common.gguf_file import GGUFError, GGUFFile
from procs.inference.gguf_tensors import (EXACT_INT8_TYPES, INT4_TYPES, INT8_TYPES, Lazy, dequant, dequant_to,
                                          mxfp4_levels, mxfp4_rows, q4_parts, q8_parts)
from procs.inference.hf_files import gpt_oss_experts, read_safetensors, text_tensors
from procs.inference.rows import (ROTATED, grouped_rows, mla_rows, rotary_perm, rotary_rows, split_fused,
                                  tile_v_heads, unpermute)
from procs.inference.archs import (ModelLoadError, arch_of, check_unused, fused_rows, gguf_gemma3, gguf_glm4moe,
                                   gguf_hybrid, gguf_mla, gguf_gpt_oss, gguf_moe, gguf_phi3, gguf_q_scale, gguf_rope,
                                   gguf_variant, hf_gemma3, hf_glm4moe, hf_gpt_oss, hf_hybrid, hf_mla, hf_moe,
                                   hf_partial_rope, hf_phi3, hf_q_scale, hf_rope, hf_text_config, hf_variant,
                                   layer_names, nope_layers, tensor_name, unused_math)

QUANT_BITS = {"F32": 32, "F16": 16, "BF16": 16, "Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5,
              "Q5_1": 5, "Q2_K": 2, "Q3_K": 3, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6, "MXFP4": 4}


@dataclass(frozen=True)
class ModelConfig:
    n_layers: int
    dim: int
    ffn_dim: int                           # the MLP's width; with experts, each expert's
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    norm_eps: float
    max_context: int
    tied_embeddings: bool
    quant_bits: int
    arch: str = "llama"                    # archs.Arch.name: which tensors the layers carry
    # RoPE scaling as per-frequency divisors, inv_freq[i] = theta^(-2i/D) / rope_factors[i]
    # (llama.cpp's rope_freqs convention); () when unscaled
    rope_factors: tuple[float, ...] = ()
    # Fields below keep their defaults for the Llama family (the fingerprint leaves defaults out)
    act: str = "silu"                      # archs.Arch.act
    embed_scale: float = 0.0               # embeddings times this (0: not scaled)
    attn_scale: float = 0.0                # attention logits times this (0: 1/sqrt(head_dim))
    windows: tuple[int, ...] = ()          # per layer: sliding window in tokens, 0 global; () all global
    rope_theta_local: float = 0.0          # RoPE base of the windowed layers (0: rope_theta)
    # YaRN: cos and sin times this (so attention logits times its square); 1.0 otherwise
    rope_attn_factor: float = 1.0
    # mixture of experts (archs.Arch.moe): every layer routes each token to n_experts_used of
    # n_experts SiLU-gated MLPs by softmax over the router's logits, the chosen weights
    # renormalized to sum to 1 when moe_norm_topk
    n_experts: int = 0
    n_experts_used: int = 0
    moe_norm_topk: bool = False
    # partial rotary embeddings: the first rope_dims of each head rotate (0: all); the loader
    # permutes Q and K rows so that they pair as rotate-half pairs of the whole head
    rope_dims: int = 0
    # LongRoPE: these factors replace rope_factors for a context above rope_long_from
    rope_factors_long: tuple[float, ...] = ()
    rope_long_from: int = 0
    # gpt-oss's expert activation (act "swiglu_oai"): gate clamped above at limit, up to
    # [-limit, limit], out = gate * sigmoid(alpha * gate) * (up + 1)
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0
    # GLM-4.5's router (procs/inference/moe.py): "sigmoid" scores plus a per-expert bias pick
    # the experts, within the best moe_groups_used of moe_groups groups; their weights times
    # moe_scale. The first dense_layers layers have one dense MLP instead of experts.
    moe_gating: str = "softmax"
    moe_scale: float = 1.0
    moe_groups: int = 1
    moe_groups_used: int = 1
    dense_layers: int = 0
    # SmolLM3: per layer, whether it skips RoPE (NoPE); () when every layer rotates
    no_rope: tuple[bool, ...] = ()
    # Ministral 3 / Devstral 2 (Llama 4's attention temperature): q, after RoPE, times
    # 1 + q_scale_beta * ln(1 + floor(pos / q_scale_floor)); exactly 1 below q_scale_floor
    q_scale_beta: float = 0.0
    q_scale_floor: int = 0
    # multi-head latent attention (procs/inference/mla.py): K/V rows are one head of kv_lora +
    # rope_dims (head_dim, n_kv_heads 1); q_lora: the query's low rank (0: one projection)
    kv_lora: int = 0
    q_lora: int = 0
    qk_nope: int = 0
    v_head_dim: int = 0
    # Gated DeltaNet (gdn.py; Qwen3-Next, Qwen3.5): per layer whether it is linear attention
    # (() none), the convolution's width, the key and value heads and their dims, and the
    # value heads' order (tiled: llama.cpp's qwen35, whose value head h reads key head h % nk;
    # else grouped, h // (nv / nk)). The other layers attend, and only they hold K/V rows.
    linear_layers: tuple[bool, ...] = ()
    ssm_conv: int = 0
    ssm_k_heads: int = 0
    ssm_v_heads: int = 0
    ssm_k_dim: int = 0
    ssm_v_dim: int = 0
    ssm_tiled: bool = False

    @property
    def kv_layers(self) -> int:
        """The layers that hold K/V rows (all but the linear-attention ones)."""
        return self.n_layers - sum(self.linear_layers)

    def is_linear(self, i: int) -> bool:
        """Whether layer i is a Gated DeltaNet."""
        return bool(self.linear_layers) and self.linear_layers[i]


@dataclass
class LoadedWeights:
    config: ModelConfig
    tensors: dict[str, torch.Tensor]   # HF names, compute dtype
    fingerprint: bytes                 # 16 bytes: architecture + dims + weight identity
    # 4-bit source weights kept as (q uint8 [N, K], scale f32 [N, K/32], min f32 [N, K/32])
    # with w = q * scale + min, for the decode kernels (see model.Linear)
    q4: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
    q8: frozenset = frozenset()        # names whose source is quantized otherwise (gguf_tensors.INT8_TYPES)
    # Q8_0 / Q5_0 source weights exactly: (q int8 [N, K], scale f16 [N, K/32]), w = q * scale
    q8_parts: dict[str, tuple[torch.Tensor, torch.Tensor]] = None


def fingerprint(cfg: ModelConfig, norms: dict[str, torch.Tensor]) -> bytes:
    """16 bytes naming the model, not its quantization: the architecture, the geometry, the
    RoPE scaling, plus the RMSNorm weights, which every GGUF quantization keeps in F32 and a
    safetensors dir holds exactly, so Q4 and Q8 files (and the HF original) of one model
    agree, and two fine-tunes of one shape do not.

    An unscaled Llama GGUF hashes the same bytes as before architectures were described
    (the arch name was always the prefix), so its checkpoints stay valid. norm_eps is hashed
    at f32 precision, as GGUF stores it (an HF dir's 1e-5 hashed as itself before, so its
    fingerprint never equalled its GGUF's); rope factors and YaRN's attention factor to 6
    significant digits, as a GGUF's f32 values and a config's f64 computation of the same
    scaling agree to that. Fields at their defaults stay out, so adding one changes no
    existing model's fingerprint."""
    skip = ("quant_bits", "max_context", "arch", "rope_factors", "rope_factors_long")
    dflt = ModelConfig(**{f: getattr(cfg, f) for f in _REQUIRED})
    dims = {k: v for k, v in asdict(cfg).items()
            if k not in skip and (k in _REQUIRED or v != getattr(dflt, k))}
    dims["norm_eps"] = float(np.float32(cfg.norm_eps))
    if "rope_attn_factor" in dims:
        dims["rope_attn_factor"] = float(f"{cfg.rope_attn_factor:.6g}")
    h = hashlib.blake2b(digest_size=16)
    h.update(cfg.arch.encode() + b"\0" + json.dumps(dims, sort_keys=True).encode())
    if cfg.rope_factors:
        h.update(b"rope_factors\0" + ",".join(f"{f:.6g}" for f in cfg.rope_factors).encode())
    if cfg.rope_factors_long:
        h.update(b"rope_factors_long\0" + ",".join(f"{f:.6g}" for f in cfg.rope_factors_long).encode())
    for name in sorted(norms):   # as stored (f32), before any cast to the compute dtype
        h.update(name.encode() + norms[name].cpu().numpy().tobytes())
    return h.digest()


_REQUIRED = ("n_layers", "dim", "ffn_dim", "n_heads", "n_kv_heads", "head_dim", "vocab_size",
             "rope_theta", "norm_eps", "max_context", "tied_embeddings", "quant_bits")


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
        flat = len(info.shape) == 2 or ours.endswith("_exps")     # experts: E * N rows (linear.experts)
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
    # (lazy only for MXFP4 experts: a Lazy's unmade values read as None through items())
    tensors, q8p, norms = (Lazy(), Lazy(), {}) if mx else ({}, {}, {})
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
