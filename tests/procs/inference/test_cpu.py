"""The CPU rules (procs/inference/cpu.py) on the flag sets of the machines they were measured
on, and linear.dense taking the path its rule names."""
from __future__ import annotations

import pytest
import torch

from procs.inference import cpu, linear

MACHINES = {   # name: (vendor, flags), trimmed to what the rules read
    "xeon_amx": ("GenuineIntel", "avx2 avx512f avx512_bf16 amx_bf16 amx_tile"),
    "xeon_no_amx": ("GenuineIntel", "avx2 avx512f avx512_bf16 avx512_fp16 avx512_vnni"),
    "zen4": ("AuthenticAMD", "avx2 avx512f avx512_bf16 avx512_vnni"),
    "epyc_avx2": ("AuthenticAMD", "avx2 fma f16c"),
    "intel_avx2": ("GenuineIntel", "avx2 fma"),
}
#           bf16 native (--dtype auto), bf16 products fast, f32 GEMMs split
EXPECTED = {"xeon_amx": (True, True, False), "xeon_no_amx": (True, False, False), "zen4": (True, True, True),
            "epyc_avx2": (False, False, True), "intel_avx2": (False, False, True)}


@pytest.fixture
def machine(monkeypatch):
    def be(name: str):
        vendor, flags = MACHINES[name]
        monkeypatch.setattr(cpu, "cpu_flags", lambda: "flags\t\t: " + flags)
        monkeypatch.setattr(cpu, "cpu_vendor", lambda: vendor)
        cpu.f32_gemms_split.cache_clear()
    yield be
    cpu.f32_gemms_split.cache_clear()


@pytest.mark.parametrize("name", list(MACHINES))
def test_rules_per_machine(machine, name):
    machine(name)
    assert (cpu.bf16_native(), cpu.bf16_products_fast(), cpu.f32_gemms_split()) == EXPECTED[name]


@pytest.mark.parametrize("split", [True, False])
def test_dense_blocks_where_the_rule_says_and_agrees_with_one_gemm(monkeypatch, split):
    calls = []
    real = torch.nn.functional.linear
    monkeypatch.setattr(linear, "f32_gemms_split", lambda: split)
    monkeypatch.setattr(linear.F, "linear", lambda x, w: calls.append(w.shape[0]) or real(x, w))
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 576, generator=g), torch.randn(1536, 576, generator=g)
    got = linear.dense(x, w)
    assert calls == ([linear.SPLIT_N] * 4 if split else [1536])
    torch.testing.assert_close(got, real(x, w), rtol=1e-5, atol=1e-4)
    calls.clear()
    linear.dense(x.bfloat16(), w.bfloat16())    # only f32 GEMMs are ever split
    assert calls == [1536]


@pytest.mark.parametrize("name", list(MACHINES))
def test_prefill_attention_auto_keeps_the_kernel_for_sinks(machine, name):
    """auto: torch's SDPA only in bf16 on AMX, and never for a model with attention sinks
    (SDPA takes none; torch's own ops lose to the kernel there too); a named choice holds."""
    from common.config import Settings
    from procs.inference.runtime import native_prefill
    machine(name)
    amx = name == "xeon_amx"
    assert native_prefill(Settings(), torch.bfloat16) is not amx
    assert native_prefill(Settings(), torch.float32)
    assert native_prefill(Settings(), torch.bfloat16, sinks=True)
    assert not native_prefill(Settings(prefill_attention="sdpa"), torch.bfloat16, sinks=True)
    assert native_prefill(Settings(prefill_attention="native"), torch.bfloat16)
