"""Prefill's native attention (kernels/prefill.c through native_attention.PrefillAttention): causal and
sliding-window attention of T rows at positions pos..pos+T-1 against the cache, equal to SDPA
on the same values for every head layout and head dim (GQA, vector tails), from f32 and bf16
caches; a row never sees a later key or an unwritten row; and each row's bits do not depend on
how the prompt was split into calls. The AVX2 and portable builds run the same checks in a
subprocess (RICORDO_KERNEL_MARCH)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from procs.inference import native
from procs.inference.model import _mask
from procs.inference.native_attention import PrefillAttention

# (H, KV, D): SmolLM2, Gemma 3, Qwen2.5-0.5B, no GQA, head dims with a vector tail, G = 16
LAYOUTS = ((9, 3, 64), (4, 1, 256), (14, 2, 64), (8, 8, 128), (4, 2, 80), (6, 2, 24), (16, 1, 128))
# (pos, T, window): one row, partial blocks, a chunk after a chunk, windows across blocks
CALLS = ((0, 1, 0), (0, 77, 0), (100, 300, 0), (512, 512, 0), (0, 600, 512), (700, 200, 512), (1000, 40, 100))


def kernel() -> PrefillAttention:
    k = native.load()
    assert k is not None, "the native kernels did not build"
    return k.prefill


def case(H, KV, D, pos, T, dtype, seed=0):
    """q [T, H, D] and a cache [KV, cap, D] whose rows past pos + T are NaN (never written)."""
    g = torch.Generator().manual_seed(seed)
    cap = pos + T + 50
    kc, vc = (torch.randn(KV, cap, D, generator=g).to(dtype) for _ in range(2))
    kc[:, pos + T:] = float("nan")
    vc[:, pos + T:] = float("nan")
    return torch.randn(T, H, D, generator=g).to(dtype), kc, vc


def reference(q, kc, vc, pos, window, scale, dtype=torch.float32):
    """SDPA on the same values, in f32 (or in dtype: torch's own kernel in bf16)."""
    T = q.shape[0]
    S = pos + T
    m = _mask(torch.arange(pos, S).unsqueeze(1), torch.arange(S), window, dtype)
    o = F.scaled_dot_product_attention(q.to(dtype).transpose(0, 1).unsqueeze(0), kc[None, :, :S].to(dtype),
                                       vc[None, :, :S].to(dtype), attn_mask=m, enable_gqa=True, scale=scale)
    return o[0].transpose(0, 1).reshape(T, -1)


def check_matches_sdpa(pa) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        for H, KV, D in LAYOUTS:
            for pos, T, window in CALLS:
                q, kc, vc = case(H, KV, D, pos, T, dtype)
                got = pa(q, kc, vc, pos, window, D ** -0.5)
                want = reference(q, kc, vc, pos, window, D ** -0.5)
                assert got.dtype == dtype and got.shape == (T, H * D)
                err = (got.float() - want).abs()
                if dtype == torch.float32:      # the summation order only
                    assert err.max().item() < 1e-5, (H, KV, D, pos, T, window, err.max().item())
                else:   # bf16 weights and output: as close as torch's own bf16 attention
                    peer = (reference(q, kc, vc, pos, window, D ** -0.5, torch.bfloat16).float() - want).abs()
                    assert err.max().item() <= 2 ** -7 * want.abs().max().item(), (H, KV, D, pos, T, window)
                    assert err.mean().item() <= 1.25 * peer.mean().item() + 1e-7, \
                        (H, KV, D, pos, T, window, err.mean().item(), peer.mean().item())


def check_rows_do_not_depend_on_the_split(pa) -> None:
    for dtype, pairs in ((torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)):
        for H, KV, D, window in ((9, 3, 64, 0), (4, 1, 256, 100), (4, 2, 80, 0)):
            pos, T = 37, 400
            q, kc, vc = case(H, KV, D, pos, T, dtype, seed=1)
            whole = pa(q, kc, vc, pos, window, D ** -0.5, pairs)
            for cuts in ((1,), (31, 32, 33), (63, 64, 65, 190), (128, 256)):
                edges = [0, *cuts, T]
                parts = [pa(q[a:b], kc, vc, pos + a, window, D ** -0.5, pairs) for a, b in zip(edges, edges[1:])]
                assert torch.equal(torch.cat(parts), whole), (dtype, pairs, H, KV, D, window, cuts)


def check_widened_bf16_is_the_f32_kernel(pa) -> None:
    """pairs=False (--prefill-math f32): bf16 K/V widened, then the f32 kernel's products: the
    bits of the f32 kernel on the same values (q is widened either way)."""
    for H, KV, D in LAYOUTS:
        for pos, T, window in CALLS[1:4] + CALLS[5:]:
            q, kc, vc = case(H, KV, D, pos, T, torch.bfloat16, seed=3)
            got = pa(q, kc, vc, pos, window, D ** -0.5, False)
            want = pa(q, kc.float(), vc.float(), pos, window, D ** -0.5)
            assert got.dtype == torch.bfloat16 and torch.equal(got, want), (H, KV, D, pos, T, window)


def check_no_row_sees_a_later_key(pa) -> None:
    H, KV, D, pos, T = 9, 3, 64, 200, 150
    q, kc, vc = case(H, KV, D, pos, T, torch.float32, seed=2)
    before = pa(q, kc, vc, pos, 0, D ** -0.5)
    kc[:, pos + T - 1] = 1e4          # the last row's key and value: only the last row sees them
    vc[:, pos + T - 1] = -1e4
    after = pa(q, kc, vc, pos, 0, D ** -0.5)
    assert torch.equal(after[:-1], before[:-1])
    assert not torch.equal(after[-1], before[-1])


def check_all() -> None:
    pa = kernel()
    check_matches_sdpa(pa)
    check_rows_do_not_depend_on_the_split(pa)
    check_widened_bf16_is_the_f32_kernel(pa)
    check_no_row_sees_a_later_key(pa)


def test_matches_sdpa_for_every_layout_dtype_and_window():
    check_matches_sdpa(kernel())


def test_rows_do_not_depend_on_the_split():
    check_rows_do_not_depend_on_the_split(kernel())


def test_widened_bf16_is_the_f32_kernel():
    check_widened_bf16_is_the_f32_kernel(kernel())


def test_no_row_sees_a_later_key():
    check_no_row_sees_a_later_key(kernel())


def test_a_shape_past_the_kernel_is_refused():
    q, kc, vc = case(34, 2, 64, 0, 8, torch.float32)    # 17 query heads per K/V head
    with pytest.raises(ValueError):
        kernel()(q, kc, vc, 0, 0, 0.125)


@pytest.mark.parametrize("march", ["haswell", "x86-64"])
def test_each_kernel_build_gives_the_same_attention(march):
    """The AVX2 and portable builds (this CPU's own build runs above)."""
    env = dict(os.environ, RICORDO_KERNEL_MARCH=march)
    code = "from tests.procs.inference import test_prefill_attention as t; t.check_all(); print('ok')"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout + p.stderr


def test_the_model_prefills_alike_with_either_attention(model_path):
    """The default model's logits at every row of a 1,100-token prompt in three chunks: in f32,
    native attention gives SDPA's to 1e-3; in bf16, they are as far from the f32 logits as
    SDPA's in bf16 are (the same rounding, no more) and pick the same top token as often."""
    from procs.inference.loader import load
    from procs.inference.model import Llama
    ids = torch.tensor([5 + (j * 29) % 3000 for j in range(1100)])

    def logits(dtype: torch.dtype, nat: bool) -> torch.Tensor:
        # dense weights: the packed output projection rounds its input to int8 (qdot.c), a
        # step that a 1e-6 difference in a hidden row may cross
        m = Llama(load(model_path, dtype, "cpu"), 2048, packed=False, kernels=native.load(), native_prefill=nat)
        assert (m.prefill_attend is not None) == nat
        c = m.cfg
        kc = torch.zeros(c.n_layers, c.n_kv_heads, 1152, c.head_dim, dtype=dtype)
        vc = torch.zeros_like(kc)
        return torch.cat([m.forward(ids[p:p + 512], p, kc, vc, list(range(len(ids[p:p + 512]))))
                          for p in range(0, len(ids), 512)]).float()
    exact = logits(torch.float32, False)
    assert (logits(torch.float32, True) - exact).abs().max().item() < 1e-3
    ours, peer = logits(torch.bfloat16, True), logits(torch.bfloat16, False)
    err, peer_err = ((x - exact).abs().mean().item() for x in (ours, peer))
    assert err <= 1.2 * peer_err, (err, peer_err)
    top, peer_top = ((x.argmax(1) == exact.argmax(1)).float().mean().item() for x in (ours, peer))
    assert top >= peer_top - 0.03, (top, peer_top)
