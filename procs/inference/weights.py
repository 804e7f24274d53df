"""What a load yields: the model's configuration (ModelConfig), its tensors (LoadedWeights),
and the fingerprint that names the model in every checkpoint. procs/inference/loader.py reads
GGUF files into them, procs/inference/hf_load.py Hugging Face safetensors dirs."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import numpy as np
import torch



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

    @property
    def kv_tensors(self) -> int:
        """The row tensors a session keeps: K and V, or K alone for latent attention, whose V
        rows are its K rows (mla.py)."""
        return 1 if self.kv_lora else 2

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

    @property
    def sinks(self) -> bool:
        """Whether the attention has gpt-oss's sinks (a learned logit per head); names only,
        so a Lazy dict makes no tensor."""
        return any(n.endswith(".sinks") for n in self.tensors)


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

