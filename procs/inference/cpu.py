"""What the CPU is: /proc/cpuinfo's flags and vendor (read once a process), and which
arithmetic pays on it (bf16_native: the rule behind --dtype auto; bf16_products_fast: the
rule behind --prefill-math auto;
f32_gemms_split: whether prefill's f32 GEMMs run in blocks of output features)."""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def cpu_flags() -> str:
    """The flags line of /proc/cpuinfo ("" where there is none); read once a process."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return ""


@functools.lru_cache(maxsize=None)
def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD; "" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("vendor_id")), "")
    except OSError:
        return ""


def has_flag(name: str) -> bool:
    """Whether /proc/cpuinfo lists the flag, as a whole word (avx512f is not avx512fp16)."""
    return name in cpu_flags().split()


def bf16_native() -> bool:
    """Whether the CPU has bf16 instructions (avx512_bf16 or AMX), so that --dtype auto computes
    in bf16 (elsewhere torch emulates bf16 GEMMs, and f32 is faster)."""
    return has_flag("avx512_bf16") or has_flag("amx_bf16")


def bf16_products_fast() -> bool:
    """Whether the CPU's bf16 dot products outrun its f32 FMAs, so that bf16 GEMMs and the
    attention kernels' pairs pay: AMX tiles, or avx512_bf16 on AMD (Zen 4/5). Not Intel's
    avx512_bf16 without AMX (Cooper Lake; a Sapphire Rapids whose AMX its VM hides): on 2 cores
    of such a Xeon (avx512_bf16 avx512_fp16, no amx flag) oneDNN's bf16 GEMM ran at 166-195
    GFLOP/s against MKL's f32 at 230-360 (512 x 896 x 4864 and five other prefill shapes), and
    the prefill kernel's bf16 pairs at about 0.6x its f32 products (SmolLM2 at 8,000 tokens:
    prefill 260-290 tok/s in bf16, 415 with both widened to f32, 425 in f32)."""
    return has_flag("amx_bf16") or (has_flag("avx512_bf16") and cpu_vendor() == "AuthenticAMD")


@functools.lru_cache(maxsize=None)
def f32_gemms_split() -> bool:
    """Whether f32 GEMMs with a short inner dimension run faster in blocks of output features
    (linear.dense). On 2 cores of an AVX2-only AMD EPYC, MKL's sgemm of 512 rows x K=576 x
    N=3072 ran at 63 GFLOP/s whole and 102 in blocks of 384. On 2 cores of an Intel Xeon with
    AVX-512 the blocks lose: 512 x 896 x 9728 339 whole against 309 in blocks, 512 x 896 x
    1152 302 against 275, and a Qwen2.5-0.5B prefill of 512 tokens 1.07x faster whole
    (SmolLM2 at 2,048: 1.10x). Blocks, then, except on an Intel CPU with AVX-512 (an AMD one
    with it, Zen 4/5, is unmeasured and keeps them)."""
    return not (has_flag("avx512f") and cpu_vendor() == "GenuineIntel")
