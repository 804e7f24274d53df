"""Choosing device, dtype and threads, and building the model from settings."""
from __future__ import annotations

import os
import time

import torch

from common.config import Settings
from common.models import context_size, resolve, trained_of
from procs.inference import native
from procs.inference.cpu import bf16_native, bf16_products_fast, has_flag
from procs.inference.loader import load
from procs.inference.model import Llama
from procs.inference.packcache import PackCache, cache_file

DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32, "f16": torch.float16}
# --prefill-math -> Llama's prefill_f32 (None: the CPU's rule, cpu.bf16_products_fast)
PREFILL_F32 = {"auto": None, "f32": True, "bf16": False}


def native_prefill(s: Settings, dtype: torch.dtype, sinks: bool = False) -> bool:
    """Whether prefill's attention runs in kernels/prefill.c rather than torch's. auto: except
    in bf16 on AMX, where SDPA's GEMMs run on oneDNN's tiles (bench/bench_prefill.py, 2-core
    AMX Xeon: native at 0.79x / 0.61x / 0.40x SDPA's prefill rate at 512 / 2048 / 8000 tokens),
    unless the model has attention sinks (gpt-oss): SDPA takes none, and torch's ops instead
    (torch_attention.sink_attention) took 4.4x the kernel's time at 8,000 tokens, 12.8x on
    128-token windows, on that machine."""
    if s.prefill_attention == "auto":
        return sinks or not (dtype == torch.bfloat16 and has_flag("amx_bf16"))
    return s.prefill_attention == "native"


def pick_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def pick_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") or bf16_native() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r} (auto, bf16, f32, f16)")
    return DTYPES[name]


def describe() -> str:
    """The device and dtype the environment's settings pick (what `make test` runs in)."""
    device = pick_device(os.environ.get("RICORDO_DEVICE", "auto"))
    dtype = os.environ.get("RICORDO_DTYPE", "auto")
    picked = str(pick_dtype(dtype, device)).replace("torch.", "")
    if picked == "bfloat16" and device == "cpu":
        math = os.environ.get("RICORDO_PREFILL_MATH", "auto")
        f32 = PREFILL_F32[math]
        f32 = not bf16_products_fast() if f32 is None else f32
        picked += f", prefill's products in {'f32' if f32 else 'bf16'} (RICORDO_PREFILL_MATH={math})"
    return f"ricordo compute dtype: {picked} on {device} (RICORDO_DTYPE={dtype}; f32 or bf16 choose)"


def explain(s: Settings, model) -> str:
    """Why this dtype and which decode path, for the log line at start."""
    dev = model.device.type
    if s.dtype != "auto":
        why = f"--dtype {s.dtype}"
    elif dev == "cuda":
        why = "auto: CUDA computes in bf16"
    elif bf16_native():
        why = "auto: this CPU has native bf16 (avx512_bf16/amx_bf16)"
    else:
        why = "auto: this CPU has no native bf16 (its bf16 GEMMs are emulated), so f32"
    if model.decoder is not None:
        kinds = sorted({native.KIND_NAMES[x.mat.kind] for ly in model.layers
                        for x in (ly.wqkv, ly.wo, ly.wgu, ly.wd, *(ly.moe.gate_up + ly.moe.down if ly.moe else ()))
                        if x is not None})
        path = f"decode: one native call per token on {'+'.join(kinds)} weights, f32 activations"
    elif dev == "cpu":
        path = "decode: torch's ops (--decode-kernels torch, or the kernels did not build)"
    else:
        path = "decode: torch's ops on the device"
    att = "native" + (" with sinks" if model.sinks else "") if model.prefill_attend is not None else \
        "torch's ops with sinks" if model.sinks else "torch's SDPA"
    math = ""
    if model.dtype == torch.bfloat16 and dev == "cpu":
        how = f"--prefill-math {s.prefill_math}" if s.prefill_math != "auto" else \
            "auto: this CPU's bf16 products outrun its f32 FMAs" if bf16_products_fast() else \
            "auto: this CPU's bf16 products are no faster than its f32 FMAs"
        math = f"; prefill multiplies in {'f32' if model.mm_dtype == torch.float32 else 'bf16'} ({how})"
    return f"{str(model.dtype).replace('torch.', '')} ({why}); {path}; prefill attention: {att}{math}"


def _trim_heap() -> None:
    """Give the load's freed transients (f32 dequantized tensors, the unfused weights) back
    to the system: glibc keeps them in the heap otherwise (977 -> 594 MB resident for the
    default model)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def build(s: Settings) -> tuple[Llama, int, float]:
    """(model, context size, load seconds)."""
    if s.threads > 0:
        torch.set_num_threads(s.threads)
    device = pick_device(s.device)
    dtype = pick_dtype(s.dtype, device)
    t0 = time.perf_counter()
    path = resolve(s.model, s.models_path())
    w = load(path, dtype, device)
    c = w.config
    if s.deterministic and c.linear_layers:    # their blocked prefill's rows depend on where chunks begin
        raise ValueError("--deterministic is not supported for models with linear-attention layers "
                         "(Qwen3-Next, Qwen3.5)")     # a GGUF's fields, as the renderer reads them from the file (an HF dir's may differ)
    ctx = context_size(path, s.ctx_size, trained=trained_of(c.max_context, c.kv_layers, c.n_kv_heads, c.head_dim, c.kv_tensors)
                       if os.path.isfile(path) else None)
    kernels = native.load() if s.decode_kernels == "native" and device == "cpu" else None
    packed = s.decode_weights == "packed"
    cache = None
    if kernels is not None and s.packed_cache_path() and os.path.isfile(path):
        cache = PackCache(cache_file(s.packed_cache_path(), path, dtype, packed))
    model = Llama(w, max(ctx, 1), packed=packed, kernels=kernels, cache=cache,
                  native_prefill=native_prefill(s, dtype, w.sinks), cuda_graphs=s.cuda_graphs,
                  prefill_f32=PREFILL_F32[s.prefill_math])
    del w
    _trim_heap()
    secs = time.perf_counter() - t0
    if cache is not None:    # the first start's one-off write, not counted as load
        cache.save()
    return model, ctx, secs
