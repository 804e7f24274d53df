"""The architectures the loader takes, each a small description of what it adds to the Llama
decoder, and RoPE's frequency scaling as each format states it.

forward() never asks which architecture it runs: an architecture is the set of tensors the
loader fills (biases, q/k norms), and RoPE scaling is a per-frequency divisor that the model
folds into its rotary table once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


class ModelLoadError(ValueError):
    """A model the loader cannot take (re-exported by procs/inference/loader.py)."""


@dataclass(frozen=True)
class Arch:
    name: str                        # the fingerprint's prefix: one name per distinct math
    qkv_bias: bool = False           # q/k/v projections carry biases (Qwen2)
    qk_norm: bool = False            # RMSNorm over each head of q and of k, before RoPE (Qwen3)
    # llama.cpp's converter permutes Q/K rows for its adjacent-pair RoPE only for the Llama
    # family; Qwen GGUFs use NeoX RoPE, the Hugging Face half-split layout, unpermuted.
    gguf_permuted_qk: bool = True


# HF model_type and GGUF general.architecture use these same names.
ARCHS = {
    "llama": Arch("llama"),
    "mistral": Arch("llama"),        # Mistral 7B v0.1-v0.3 is Llama with GQA: same math
    "qwen2": Arch("qwen2", qkv_bias=True, gguf_permuted_qk=False),
    "qwen3": Arch("qwen3", qk_norm=True, gguf_permuted_qk=False),
}

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
}
# Tensors of the layers that change the math, which an architecture without them must not
# silently drop (a Llama with attention_bias, say): present but unused is a load error.
MATH_EXTRAS = {"self_attn.o_proj.bias", "attn_output.bias", "mlp.gate_proj.bias", "mlp.up_proj.bias",
               "mlp.down_proj.bias", "ffn_gate.bias", "ffn_up.bias", "ffn_down.bias"}


def arch_of(name: str, where: str) -> Arch:
    if name not in ARCHS:
        raise ModelLoadError(f"{where}: unsupported architecture {name!r} (supported: {', '.join(ARCHS)})")
    return ARCHS[name]


def layer_names(arch: Arch) -> list[str]:
    """Our per-layer tensor names this architecture needs, all of them required."""
    names = ["attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down"]
    if arch.qkv_bias:
        names += ["bq", "bk", "bv"]
    if arch.qk_norm:
        names += ["q_norm", "k_norm"]
    return names


def unused_math(arch: Arch, present: set[str], fmt: int) -> list[str]:
    """Per-layer tensors present (suffixes as in LAYER_TENSORS[..][fmt]) that change the math
    but that this architecture would not read."""
    used = {LAYER_TENSORS[n][fmt] for n in layer_names(arch)}
    known = {v[fmt] for v in LAYER_TENSORS.values()} | MATH_EXTRAS
    return sorted(s for s in present if s in known and s not in used)


# ------------------------------------------------------------------ RoPE

def llama3_factors(theta: float, head_dim: int, factor: float, low: float, high: float,
                   original_ctx: float) -> tuple[float, ...]:
    """Llama 3.1's per-frequency divisors (llama.cpp's rope_freqs convention:
    inv_freq[i] = theta^(-2i/D) / f[i]): wavelengths shorter than original_ctx/high keep
    their frequency, longer than original_ctx/low are divided by factor, and those between
    are interpolated, as transformers' _compute_llama3_parameters does."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original_ctx / high:
            out.append(1.0)
        elif wavelen > original_ctx / low:
            out.append(float(factor))
        else:
            smooth = (original_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(out)


def hf_rope(c: dict, head_dim: int, where: str) -> tuple[float, tuple[float, ...]]:
    """(theta, divisors or ()) from a config.json. Current transformers saves the rope base
    and scaling in `rope_parameters`; older configs keep a top-level `rope_theta` and an
    optional `rope_scaling`. Precedence follows transformers' standardize_rope_params."""
    rp = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in rp.values()):
        raise ModelLoadError(f"{where}: per-layer-type RoPE parameters are not supported")
    theta = rp.get("rope_theta", c.get("rope_theta"))
    theta = 10000.0 if theta is None else float(theta)
    if float(rp.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise ModelLoadError(f"{where}: partial rotary embeddings are not supported")
    kind = rp.get("rope_type", rp.get("type", "default")) or "default"
    if kind == "default":
        return theta, ()
    if kind == "linear":
        return theta, (float(rp["factor"]),) * (head_dim // 2)
    if kind == "llama3":
        # a top-level original_max_position_embeddings wins, as in transformers
        orig = c.get("original_max_position_embeddings") or rp.get("original_max_position_embeddings") \
            or c.get("max_position_embeddings", 8192)
        return theta, llama3_factors(theta, head_dim, float(rp.get("factor", 8.0)),
                                     float(rp.get("low_freq_factor", 1.0)),
                                     float(rp.get("high_freq_factor", 4.0)), float(orig))
    raise ModelLoadError(f"{where}: unsupported RoPE scaling {kind!r} (default, linear, llama3)")


def gguf_rope(meta: dict, prefix: str, head_dim: int, rope_freqs, where: str) -> tuple[float, tuple[float, ...]]:
    """(theta, divisors or ()) from GGUF metadata and the optional rope_freqs tensor, which
    llama.cpp's converter writes for Llama 3.1 scaling (the divisors themselves)."""
    theta = float(meta.get(prefix + "rope.freq_base", 10000.0))
    dims = int(meta.get(prefix + "rope.dimension_count", head_dim))
    if dims != head_dim:
        raise ModelLoadError(f"{where}: partial rotary embeddings ({dims} of {head_dim}) are not supported")
    factors = [1.0] * (head_dim // 2)
    if rope_freqs is not None:
        if len(rope_freqs) != head_dim // 2:
            raise ModelLoadError(f"{where}: rope_freqs has {len(rope_freqs)} entries, not {head_dim // 2}")
        factors = [float(f) for f in rope_freqs]
    kind = str(meta.get(prefix + "rope.scaling.type", "none"))
    if kind == "linear":
        scale = float(meta.get(prefix + "rope.scaling.factor", 1.0))
        factors = [f * scale for f in factors]
    elif kind != "none":
        raise ModelLoadError(f"{where}: unsupported RoPE scaling {kind!r} (none, linear, rope_freqs)")
    return theta, (() if all(f == 1.0 for f in factors) else tuple(factors))
