"""RoPE: its frequency scaling as each format states it (Llama 3.1, linear, YaRN, LongRoPE's
attention factor: per-frequency divisors and an attention factor, from a config.json or GGUF
metadata), and the rotary tables the model fills from them (model.Llama.ensure_rope).
"""
from __future__ import annotations

import math

import torch


class ModelLoadError(ValueError):
    """A model the loader cannot take (re-exported by archs.py and loader.py: one error type
    for every load failure; defined here, the first module of the loader's imports)."""


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


def yarn_factors(theta: float, head_dim: int, factor: float, original_ctx: float, beta_fast: float = 32.0,
                 beta_slow: float = 1.0, truncate: bool = True) -> tuple[float, ...]:
    """YaRN's per-frequency divisors: frequency i turns theta^(-2i/D) * original_ctx / 2pi times
    over the original context; dims turning more than beta_fast times keep their frequency,
    fewer than beta_slow are divided by factor, and a linear ramp over the dim index blends the
    two between (the bounds rounded outwards unless truncate is off), as transformers'
    _compute_yarn_parameters and ggml's rope_yarn_corr_dims place them."""
    def dim_of(turns: float) -> float:
        return head_dim * math.log(original_ctx / (turns * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001     # transformers' guard against a zero-width ramp
    out = []
    for i in range(head_dim // 2):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)     # 0: kept, 1: divided by factor
        out.append(1.0 / (ramp / factor + (1.0 - ramp)))
    return tuple(out)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor for a context extended `factor` times (0.1 ln(s) + 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def hf_rope(c: dict, head_dim: int, where: str) -> tuple[float, tuple[float, ...], float]:
    """(theta, divisors or (), attention factor) from a config.json. Current transformers saves
    the rope base and scaling in `rope_parameters`; older configs keep a top-level `rope_theta`
    and an optional `rope_scaling`. Precedence follows transformers' standardize_rope_params."""
    rp = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in rp.values()):
        raise ModelLoadError(f"{where}: per-layer-type RoPE parameters are not supported")
    theta = rp.get("rope_theta", c.get("rope_theta"))
    theta = 10000.0 if theta is None else float(theta)
    if any(float(x.get("partial_rotary_factor") or 1.0) != 1.0 for x in (rp, c)):
        raise ModelLoadError(f"{where}: partial rotary embeddings are not supported")
    kind = rp.get("rope_type", rp.get("type", "default")) or "default"
    if kind == "default":
        return theta, (), 1.0
    if kind == "linear":
        return theta, (float(rp["factor"]),) * (head_dim // 2), 1.0
    # a top-level original_max_position_embeddings wins, as in transformers
    orig = float(c.get("original_max_position_embeddings") or rp.get("original_max_position_embeddings")
                 or c.get("max_position_embeddings", 8192))
    if kind == "llama3":
        return theta, llama3_factors(theta, head_dim, float(rp.get("factor", 8.0)),
                                     float(rp.get("low_freq_factor", 1.0)),
                                     float(rp.get("high_freq_factor", 4.0)), orig), 1.0
    if kind == "yarn":
        factor = rp.get("factor")
        factor = float(c["max_position_embeddings"]) / orig if factor is None else float(factor)
        attn = rp.get("attention_factor")
        if attn is None:   # mscale / mscale_all_dim (DeepSeek's) only when both are set
            m, m_all = rp.get("mscale"), rp.get("mscale_all_dim")
            attn = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)
        return theta, yarn_factors(theta, head_dim, factor, orig, float(rp.get("beta_fast") or 32),
                                   float(rp.get("beta_slow") or 1), bool(rp.get("truncate", True))), float(attn)
    raise ModelLoadError(f"{where}: unsupported RoPE scaling {kind!r} (default, linear, llama3, yarn)")


def longrope_attn(factor: float, orig: int) -> float:
    """LongRoPE's default attention factor for a context `factor` times the trained one."""
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))


def gguf_rope(meta: dict, prefix: str, head_dim: int, rope_freqs, where: str, truncate: bool = True,
              log_mul: bool = False, mla: bool = False) -> tuple[float, tuple[float, ...], float]:
    """(theta, divisors or (), attention factor) from GGUF metadata and the optional rope_freqs
    tensor, which llama.cpp's converter writes for Llama 3.1 scaling (the divisors themselves).
    YaRN as the converter writes it from a config: rope.scaling.factor, original_context_length,
    and yarn_beta_fast / yarn_beta_slow / yarn_attn_factor when the config sets them (a config's
    attention_factor replaces the 0.1 ln(factor) + 1 default, as in transformers); the
    converter writes no truncate flag and ggml always rounds the ramp's bounds (truncate: False
    for gpt-oss, whose config says so and whose reference does not round). log_mul (Ministral
    3): yarn_log_multiplier is the config's mscale_all_dim (llama.cpp's mistral3 converter
    writes it so, mscale 1), and the attention factor their ratio, as transformers has it. mla
    (deepseek2): yarn_log_multiplier is 0.1 mscale_all_dim, which scales the softmax
    (attn_configs.gguf_mla), and the rotary tables are unscaled: mscale equals mscale_all_dim
    in every DeepSeek release (the converter writes no mscale), so transformers' ratio is 1."""
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
    scale = float(meta.get(prefix + "rope.scaling.factor", 1.0))
    attn = 1.0
    if kind == "linear":
        factors = [f * scale for f in factors]
    elif kind == "yarn":
        key = prefix + "rope.scaling."
        mul = float(meta.get(key + "yarn_log_multiplier", 0.0))
        if float(meta.get(key + "yarn_ext_factor", 1.0)) != 1.0 or (mul and not (log_mul or mla)):
            raise ModelLoadError(f"{where}: YaRN with an extrapolation factor or log multiplier is not supported")
        if key + "original_context_length" not in meta:
            raise ModelLoadError(f"{where}: YaRN scaling without rope.scaling.original_context_length")
        yarn = yarn_factors(theta, head_dim, scale, float(meta[key + "original_context_length"]),
                            float(meta.get(key + "yarn_beta_fast", 32.0)), float(meta.get(key + "yarn_beta_slow", 1.0)),
                            truncate)
        factors = [f * y for f, y in zip(factors, yarn)]
        attn = float(meta.get(key + "yarn_attn_factor", yarn_mscale(scale)))
        if mla:
            attn = 1.0
        elif mul:
            attn = yarn_mscale(scale) / yarn_mscale(scale, mul)
    elif kind != "none":
        raise ModelLoadError(f"{where}: unsupported RoPE scaling {kind!r} (none, linear, yarn, rope_freqs)")
    return theta, (() if all(f == 1.0 for f in factors) else tuple(factors)), attn


def rotary(c, theta: float, factors, start: int, n: int, attn_factor: float, dtype, device):
    """Rows start..start+n-1 of a rotary table pair (cos, sin), each [n, D] in the HF
    half-split layout, for ModelConfig c: base theta, per-frequency divisors `factors`
    (() unscaled), YaRN's / LongRoPE's attention factor."""
    rot = c.rope_dims or c.head_dim
    inv = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    if factors:   # RoPE scaling: per-frequency divisors (weights.ModelConfig)
        inv = inv / torch.tensor(factors, dtype=torch.float64)
    # partial rotary: the pass-through pairs (after the loader's row permutation) turn at
    # frequency 0 and are not scaled (cos 1, sin 0: exact)
    scale = torch.full((c.head_dim // 2,), float(attn_factor), dtype=torch.float64)
    scale[rot // 2:] = 1.0
    inv = torch.cat([inv, inv.new_zeros(c.head_dim // 2 - rot // 2)])
    ang = torch.outer(torch.arange(start, start + n, dtype=torch.float64), inv)   # [n, D/2]
    cos, sin = ang.cos() * scale, ang.sin() * scale    # each half of the table once (it repeats)
    # sin with rotate-half's sign folded in: x*cos + roll(x, D/2)*sin equals
    # x*cos + cat(-x2, x1)*sin exactly (a sign flip is exact), in fewer ops
    # YaRN's attention factor scales both tables, as transformers does: q.k gains its square
    return (torch.cat([cos, cos], dim=-1).to(device, dtype),
            torch.cat([-sin, sin], dim=-1).to(device, dtype))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] rotated by rotary's half-split tables (sin carries rotate-half's sign)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def specs(c, max_context: int) -> tuple[list[tuple[float, tuple, float]], bool]:
    """(the rotary tables a model of ModelConfig c needs, as (theta, divisors, attention
    factor) each; whether LongRoPE's long factors were taken). The first table is the global
    layers'; a second one is for windowed layers with their own base (Gemma 3, unscaled) or
    for layers without RoPE (SmolLM3: every frequency divided to 0, cos 1 and sin 0).
    LongRoPE takes its long factors for a context above the trained one, as llama.cpp picks
    them (once, by the context)."""
    long = bool(c.rope_factors_long) and max_context > c.rope_long_from
    out = [(c.rope_theta, c.rope_factors_long if long else c.rope_factors, c.rope_attn_factor)]
    if c.rope_theta_local:
        out.append((c.rope_theta_local, (), 1.0))
    elif c.no_rope:
        out.append((c.rope_theta, (math.inf,) * ((c.rope_dims or c.head_dim) // 2), 1.0))
    return out, long


def q_scale(c, max_context: int, device):
    """Ministral 3's query scale per position, f32 [max_context]: 1 + beta ln(1 + floor(pos /
    floor)) (transformers' get_llama_4_attn_scale); None where the model has none (all 1)."""
    if not c.q_scale_beta:
        return None
    p = torch.arange(max_context, dtype=torch.float64)
    return (1 + c.q_scale_beta * torch.log1p(torch.floor(p / c.q_scale_floor))).float().to(device)
