"""Load a Llama-family checkpoint (GGUF, or a Hugging Face safetensors dir) into torch.

The architectures (Llama, Mistral, Qwen2, Qwen3, Qwen3 MoE, Gemma 3) are described in procs/inference/archs.py.
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
import struct
from dataclasses import asdict, dataclass

import numpy as np
import torch

from common.gguf_file import GGUFError, GGUFFile
from procs.inference.archs import (ModelLoadError, arch_of, gguf_gemma3, gguf_moe, gguf_rope, hf_gemma3,
                                   hf_moe, hf_rope, layer_names, tensor_name, unused_math)

QUANT_BITS = {"F32": 32, "F16": 16, "BF16": 16, "Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5,
              "Q5_1": 5, "Q2_K": 2, "Q3_K": 3, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6}


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


@dataclass
class LoadedWeights:
    config: ModelConfig
    tensors: dict[str, torch.Tensor]   # HF names, compute dtype
    fingerprint: bytes                 # 16 bytes: architecture + dims + weight identity
    # 4-bit source weights kept as (q uint8 [N, K], scale f32 [N, K/32], min f32 [N, K/32])
    # with w = q * scale + min, for the decode kernels (see model.Linear)
    q4: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
    q8: frozenset = frozenset()        # names whose source is quantized otherwise (INT8_TYPES)
    # Q8_0 source weights as they are stored: (q int8 [N, K], scale f16 [N, K/32]), w = q * scale
    q8_parts: dict[str, tuple[torch.Tensor, torch.Tensor]] = None


# ggml types read by the decode kernels as int4 groups of 32 (their own levels, scales and
# mins: exact), and the other quantized types, which decode reads as int8 per row (approximate:
# a requantization of the dequantized weight, as fine as the source's 5-8 bits or finer)
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
INT8_TYPES = ("Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q5_K", "Q6_K")


def _q4_parts(g: GGUFFile, name: str):
    """(q uint8 [N, K], scale f32 [N, K/32], min f32 [N, K/32]) with w = q * scale + min,
    exactly the tensor's values, for a type in INT4_TYPES."""
    info = g.tensors[name]
    n, k = info.shape[1], info.shape[0]
    if info.type_name == "Q4_K":
        return _q4k_parts(g.raw(name), n, k)
    blocks = torch.from_numpy(g.raw(name).copy()).view(-1, 20 if info.type_name == "Q4_1" else 18)
    d = blocks[:, 0:2].contiguous().view(torch.float16).float().view(n, k // 32)
    off = 4 if info.type_name == "Q4_1" else 2
    qs = blocks[:, off:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1).reshape(n, k)
    if info.type_name == "Q4_1":
        mn = blocks[:, 2:4].contiguous().view(torch.float16).float().view(n, k // 32)
    else:
        mn = -8.0 * d
    return q, d, mn


def _q4k_parts(raw: np.ndarray, n: int, k: int):
    """Q4_K super-blocks (256 values: f16 d and dmin, twelve bytes of 6-bit scales and mins
    for eight sub-blocks of 32, 128 bytes of nibbles) as groups of 32: value =
    q * (d * scale_j) - dmin * min_j, ggml's dequantize_row_q4_K."""
    b = raw.reshape(-1, 144)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, qs = b[:, 4:16], b[:, 16:]
    s = np.empty((b.shape[0], 8), np.uint8)
    m = np.empty((b.shape[0], 8), np.uint8)
    s[:, :4], m[:, :4] = sc[:, :4] & 63, sc[:, 4:8] & 63
    s[:, 4:] = (sc[:, 8:12] & 0xF) | ((sc[:, 0:4] >> 6) << 4)
    m[:, 4:] = (sc[:, 8:12] >> 4) | ((sc[:, 4:8] >> 6) << 4)
    q = qs.reshape(-1, 4, 32)      # 64 values per 32 bytes: low nibbles, then high nibbles
    q = np.stack([q & 0xF, q >> 4], axis=2).reshape(n, k)
    scale = (d * s).reshape(n, k // 32)
    mn = -(dmin * m).reshape(n, k // 32)
    return torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(mn)


ROW_BLOCK = 16384


def _dequant_to(g: GGUFFile, name: str, dtype: torch.dtype) -> torch.Tensor:
    """_dequant's tensor in dtype. A large matrix (an embedding of 262,144 rows) is done in
    blocks of rows written into the result, so the load holds one block in f32, not the whole
    tensor twice over (Gemma 3 270M: 0.7 GB of f32 per copy)."""
    info = g.tensors[name]
    shape = tuple(reversed(info.shape))
    if len(shape) != 2 or shape[0] <= ROW_BLOCK:
        return _dequant(g, name).to(dtype)
    raw = g.raw(name)
    per_row = raw.size // shape[0]
    out = torch.empty(shape, dtype=dtype)
    for a in range(0, shape[0], ROW_BLOCK):
        b = min(a + ROW_BLOCK, shape[0])
        out[a:b] = _dequant(g, name, raw[a * per_row:b * per_row], (b - a, shape[1]))
    return out


def _dequant(g: GGUFFile, name: str, raw=None, shape=None) -> torch.Tensor:
    """Tensor in float32, shape in torch order ([rows, row_len]); raw and shape: a block of
    whole rows of it instead."""
    info = g.tensors[name]
    shape = shape or tuple(reversed(info.shape))
    raw = torch.from_numpy((g.raw(name) if raw is None else raw).copy())
    t = info.type_name
    if t == "F32":
        return raw.view(torch.float32).reshape(shape)
    if t == "F16":
        return raw.view(torch.float16).float().reshape(shape)
    if t == "BF16":
        return raw.view(torch.bfloat16).float().reshape(shape)
    if t in ("Q4_0", "Q4_1", "Q8_0"):
        bb = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[t]
        blocks = raw.view(-1, bb)
        d = blocks[:, 0:2].contiguous().view(torch.float16).float()           # [nb, 1]
        if t == "Q8_0":
            q = blocks[:, 2:].contiguous().view(torch.int8).float()          # [nb, 32]
            return (q * d).reshape(shape)
        off = 4 if t == "Q4_1" else 2
        qs = blocks[:, off:]                                                  # [nb, 16]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=1).float()                   # [nb, 32]
        if t == "Q4_1":
            m = blocks[:, 2:4].contiguous().view(torch.float16).float()
            return (q * d + m).reshape(shape)
        return ((q - 8) * d).reshape(shape)
    from gguf.quants import dequantize   # K-quants and the rest: slower, but correct
    from gguf.constants import GGMLQuantizationType
    arr = dequantize(raw.numpy().reshape(shape[0], -1), GGMLQuantizationType(info.type_id))
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(shape)


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # [heads * head_dim, dim]: GGUF interleaves rotary pairs; HF keeps halves apart.
    out, inp = w.shape
    return w.reshape(n_heads, out // n_heads // 2, 2, inp).transpose(1, 2).reshape(out, inp)


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
    skip = ("quant_bits", "max_context", "arch", "rope_factors")
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
    for name in sorted(norms):   # as stored (f32), before any cast to the compute dtype
        h.update(name.encode() + norms[name].cpu().numpy().tobytes())
    return h.digest()


_REQUIRED = ("n_layers", "dim", "ffn_dim", "n_heads", "n_kv_heads", "head_dim", "vocab_size",
             "rope_theta", "norm_eps", "max_context", "tied_embeddings", "quant_bits")


def load_gguf(path: str, dtype: torch.dtype, device: str) -> LoadedWeights:
    g = GGUFFile(path)
    arch = arch_of(g.arch(), path)
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
    rf = _dequant(g, "rope_freqs.weight").tolist() if "rope_freqs.weight" in g.tensors else None
    theta, factors, attn = gguf_rope(m, p, head_dim, rf, path)
    extra = gguf_moe(m, p, path) if arch.moe else dict(ffn_dim=int(m[p + "feed_forward_length"]))
    if arch.name == "gemma3":
        extra.update(gguf_gemma3(m, p, int(m[p + "block_count"]), dim, n_heads, head_dim))
    cfg = ModelConfig(
        n_layers=int(m[p + "block_count"]), dim=dim,
        n_heads=n_heads, n_kv_heads=int(m.get(p + "attention.head_count_kv", n_heads)),
        head_dim=head_dim, vocab_size=int(emb.shape[1]), rope_theta=theta,
        norm_eps=float(m[p + "attention.layer_norm_rms_epsilon"]),
        max_context=int(m.get(p + "context_length", 4096)),
        tied_embeddings="output.weight" not in g.tensors, quant_bits=QUANT_BITS.get(main_type, 0),
        arch=arch.name, rope_factors=factors, rope_attn_factor=attn, act=arch.act, **extra)
    _check_unused(arch, g.tensors, r"blk\.\d+\.", 1, path)
    names = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head"}
    for i in range(cfg.n_layers):
        for ours in layer_names(arch):
            names[f"blk.{i}.{tensor_name(arch, ours, 1)}"] = f"layers.{i}.{ours}"
    # rows of Q per query head, of K per key/value head, when permuted (no permuted
    # architecture has q/k biases: archs.layer_names)
    permuted = {"wq": cfg.n_heads, "wk": cfg.n_kv_heads} if arch.gguf_permuted_qk else {}
    tensors, q4, q8, q8p, norms = Lazy(), Lazy(), set(), Lazy(), {}
    for gname, ours in names.items():
        if gname not in g.tensors:
            if ours == "lm_head":
                continue
            raise ModelLoadError(f"{path}: missing tensor {gname}")
        info = g.tensors[gname]
        if ours.endswith("_exps") and info.shape[-1] != cfg.n_experts:
            raise ModelLoadError(f"{path}: {gname} holds {info.shape[-1]} experts, not {cfg.n_experts}")
        heads = permuted.get(ours.rsplit(".", 1)[-1])

        def dense(gname=gname, heads=heads, to=torch.float32 if ours.endswith("norm") else dtype):
            w = _dequant_to(g, gname, to)          # norms in f32: they are fingerprinted
            g.release(gname)
            return (_unpermute(w, heads) if heads else w).to(device=device)
        if ours.endswith("norm"):
            norms[ours] = dense()
            tensors[ours] = norms[ours].to(dtype)
        else:
            tensors.later(ours, dense)
        if info.type_name in INT4_TYPES and len(info.shape) == 2:
            def parts(gname=gname, heads=heads):
                x = _q4_parts(g, gname)
                g.release(gname)
                return tuple(_unpermute(t, heads) for t in x) if heads else x
            q4.later(ours, parts)
        elif info.type_name in INT8_TYPES:
            q8.add(ours)
            if info.type_name == "Q8_0" and len(info.shape) == 2 and not heads:
                q8p.later(ours, lambda gname=gname: _q8_parts(g, gname))
    return LoadedWeights(cfg, tensors, fingerprint(cfg, norms), q4, frozenset(q8), q8p)


def _q8_parts(g: GGUFFile, name: str):
    """(q int8 [N, K], scale f16 [N, K/32]) of a Q8_0 tensor: its blocks of 32 as stored."""
    info = g.tensors[name]
    n, k = info.shape[1], info.shape[0]
    blocks = torch.from_numpy(g.raw(name).copy()).view(-1, 34)
    g.release(name)
    return (blocks[:, 2:].contiguous().view(torch.int8).view(n, k),
            blocks[:, 0:2].contiguous().view(torch.float16).view(n, k // 32))


class Lazy(dict):
    """A dict whose values may be made when first read (later(name, make)): a model built
    from a GGUF dequantizes one layer's tensors at a time and drops them once packed, so a
    load never holds every weight dense at once. Membership and iteration see every name."""

    def __init__(self):
        super().__init__()
        self._make = {}

    def later(self, name: str, make) -> None:
        self._make[name] = make
        super().__setitem__(name, None)

    def __getitem__(self, name):
        make = self._make.pop(name, None)
        if make is not None:
            super().__setitem__(name, make())
        return super().__getitem__(name)

    def get(self, name, default=None):
        return self[name] if name in self else default

    def __delitem__(self, name):
        self._make.pop(name, None)
        super().__delitem__(name)

    def items(self):
        return ((k, self[k]) for k in list(self.keys()))

    def values(self):
        return (self[k] for k in list(self.keys()))

    def pop(self, name, *default):
        if name not in self:
            if default:
                return default[0]
            raise KeyError(name)
        v = self[name]
        del self[name]
        return v


def _read_safetensors(path: str) -> dict[str, torch.Tensor]:
    dt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    out = {}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        base = 8 + n
        data = np.memmap(path, dtype=np.uint8, mode="r")
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            if meta["dtype"] not in dt:
                raise ModelLoadError(f"{path}: tensor {name} has unsupported dtype {meta['dtype']}")
            a, b = meta["data_offsets"]
            buf = torch.from_numpy(np.array(data[base + a:base + b]))
            out[name] = buf.view(dt[meta["dtype"]]).reshape(meta["shape"])
    return out


def load_hf_dir(path: str, dtype: torch.dtype, device: str) -> LoadedWeights:
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    arch = arch_of(str(c.get("model_type")), path)
    if c.get("use_sliding_window"):
        raise ModelLoadError(f"{path}: sliding-window attention is not supported")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files")
    st = {}
    for fp in files:
        st.update(_read_safetensors(fp))
    n_heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // n_heads
    if arch.name == "gemma3":
        extra = hf_gemma3(c, head_dim, path)
        if c.get("final_logit_softcapping") or c.get("attn_logit_softcapping"):
            raise ModelLoadError(f"{path}: logit soft-capping is not supported")
    else:
        extra = dict(zip(("rope_theta", "rope_factors", "rope_attn_factor"), hf_rope(c, head_dim, path)))
    extra.update(hf_moe(c, path) if arch.moe else dict(ffn_dim=c["intermediate_size"]))
    cfg = ModelConfig(
        n_layers=c["num_hidden_layers"], dim=c["hidden_size"],
        n_heads=n_heads, n_kv_heads=c.get("num_key_value_heads", n_heads),
        head_dim=head_dim, vocab_size=c["vocab_size"],
        norm_eps=float(c["rms_norm_eps"]), max_context=int(c.get("max_position_embeddings", 4096)),
        tied_embeddings="lm_head.weight" not in st, quant_bits=16, arch=arch.name, act=arch.act, **extra)
    _check_unused(arch, st, r"model\.layers\.\d+\.", 0, path)
    names = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm",
             "lm_head.weight": "lm_head"}
    for i in range(cfg.n_layers):
        for ours in layer_names(arch):
            names[f"model.layers.{i}.{tensor_name(arch, ours, 0)}"] = f"layers.{i}.{ours}"
    tensors, norms = {}, {}
    for hf, ours in names.items():
        if "{e}" in hf:   # one tensor per expert: stacked as a GGUF stores them, [E, rows, cols]
            hf = [hf.format(e=e) for e in range(cfg.n_experts)]
        missing = [n for n in (hf if isinstance(hf, list) else [hf]) if n not in st]
        if missing:
            if ours == "lm_head":
                continue
            raise ModelLoadError(f"{path}: missing tensor {missing[0]}")
        w = torch.stack([st[n] for n in hf]) if isinstance(hf, list) else st[hf]
        if ours.endswith("norm"):   # as a GGUF stores it: Gemma's (1 + w) folded in
            w = w.float() + arch.hf_norm_offset
            norms[ours] = w
        tensors[ours] = w.to(device=device, dtype=dtype)
    return LoadedWeights(cfg, tensors, fingerprint(cfg, norms), {})


def _check_unused(arch, names, layer_prefix: str, fmt: int, path: str) -> None:
    present = {re.sub("^" + layer_prefix, "", n) for n in names if re.match(layer_prefix, n)}
    extra = unused_math(arch, present, fmt)
    if extra:
        raise ModelLoadError(f"{path}: tensors {extra} are not part of architecture {arch.name!r}")


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
