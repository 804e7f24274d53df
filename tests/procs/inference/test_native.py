"""The native decode attention kernel (procs/inference/native.py) against SDPA, the kernel
prefill uses: shapes of every architecture here (GQA groups, head dims 64-256, an odd one),
key counts around its chunk size, strided head views of a real cache with a window's offset,
both K/V dtypes; its result does not depend on the thread count; a machine without a
compiler gets torch's kernel, not a failed start."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from procs.inference import native
from procs.inference.model import _decode_attention

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def kernel():
    k = native.decode_attention()
    if k is None:
        pytest.fail("the native kernel did not build here (gcc is on every machine of this project)")
    return k


def sdpa(q, k, v, scale):
    H, D = q.shape
    return F.scaled_dot_product_attention(q.float().view(1, H, 1, D), k.float().unsqueeze(0),
                                          v.float().unsqueeze(0), enable_gqa=True, scale=scale).view(1, H * D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,KV,D", [(9, 3, 64), (16, 8, 128), (4, 1, 256), (8, 8, 80), (32, 2, 64)])
@pytest.mark.parametrize("S", [1, 127, 128, 129, 777])
def test_against_sdpa(kernel, dtype, H, KV, D, S):
    g = torch.Generator().manual_seed(S * 31 + H)
    q = torch.randn(H, D, generator=g).to(dtype)
    # a cache [layers, KV, ctx, D] sliced as forward() slices it: heads strided, rows from ks;
    # every row outside the slice is NaN, so a read past it shows
    ks = 17
    kc = torch.full((2, KV, S + 40, D), float("nan")).to(dtype)
    vc = kc.clone()
    kc[1, :, ks:ks + S] = (torch.randn(KV, S, D, generator=g) * 2).to(dtype)
    vc[1, :, ks:ks + S] = torch.randn(KV, S, D, generator=g).to(dtype)
    k, v = kc[1, :, ks:ks + S], vc[1, :, ks:ks + S]
    scale = D ** -0.5
    got = kernel(q, k, v, scale)
    assert got.shape == (1, H * D) and got.dtype == dtype
    want = sdpa(q, k, v, scale)
    assert (got.float() - want).abs().max().item() <= TOL[dtype]
    # no further from the torch kernel it replaces than that kernel is from SDPA (torch's
    # rounds the probabilities to bf16 before the V product; this one keeps them in f32)
    old = _decode_attention(q, k, v, scale).float()
    assert (got.float() - old).abs().max().item() <= (old - want).abs().max().item() + TOL[dtype]


@pytest.mark.parametrize("H,KV,D", [(9, 3, 64), (16, 8, 128), (8, 1, 256)])
@pytest.mark.parametrize("S", [65, 1000, 3001])
def test_bf16_error_is_no_larger_than_torch_bf16_attention(kernel, H, KV, D, S):
    """bf16 caches: where the CPU has avx512_bf16 the products take bf16 pairs (q and the
    weights rounded to bf16, kernels/pairs.h); elsewhere f32 on widened rows. Either way the
    error against f32 attention on the same bf16 values is no larger than that of torch's own
    bf16 attention, on average and at worst. q comes in f32 (as the native decoder's does) and
    the result goes out in f32: torch rounds its output to bf16 too, which this one does not,
    so its error must stay well under torch's (here 0.35-0.55x on average)."""
    g = torch.Generator().manual_seed(S + D)
    q = torch.randn(H, D, generator=g).bfloat16()
    k = (torch.randn(KV, S, D, generator=g) * 2).bfloat16()
    v = torch.randn(KV, S, D, generator=g).bfloat16()
    scale = D ** -0.5
    want = sdpa(q, k, v, scale)
    theirs = F.scaled_dot_product_attention(q.view(1, H, 1, D), k.unsqueeze(0), v.unsqueeze(0), enable_gqa=True,
                                            scale=scale).view(1, H * D).float()
    mine = kernel(q.float(), k, v, scale)
    assert mine.dtype == torch.float32
    err, their_err = (mine - want).abs(), (theirs - want).abs()
    assert err.mean() <= 0.75 * their_err.mean(), (err.mean(), their_err.mean())
    assert err.max() <= their_err.max(), (err.max(), their_err.max())


def test_takes_only_the_shapes_it_holds(kernel):
    assert kernel.takes(1, 64) and kernel.takes(16, 256)
    assert not kernel.takes(17, 64) and not kernel.takes(4, 257)


def test_independent_of_thread_count(kernel):
    torch.manual_seed(1)
    q, k, v = torch.randn(9, 64), torch.randn(3, 3000, 64).bfloat16(), torch.randn(3, 3000, 64).bfloat16()
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(kernel(q, k, v, 0.125))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_rejects_rows_it_cannot_read(kernel):
    k = torch.randn(3, 50, 64).transpose(1, 2).contiguous().transpose(1, 2)   # rows not contiguous
    with pytest.raises(ValueError):
        kernel(torch.randn(9, 64), k, k, 0.125)


def test_no_compiler_falls_back_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(native, "CC", "/nonexistent/gcc")
    with caplog.at_level(logging.WARNING, logger="ricordo.native"):
        assert native.decode_attention(str(tmp_path)) is None
    assert "unavailable" in caplog.text
    assert not list((tmp_path / "kernels").glob("*.so"))   # nothing half-built left to load


# ------------------------------------------------------------------ matrix-vector kernels

@pytest.mark.parametrize("n,k", [(192, 576), (7, 100), (1000, 1536), (33, 2048)])
def test_mat_vec_each_kind(n, k):
    """Every packed kind against torch on the values it stands for: dense f32/bf16 (any k, a
    tail past the vector width), int4 groups (the source's levels; scale and min in f16),
    int8 groups (a requantization within half a step of each group's scale)."""
    kernels = native.load()
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(k, generator=g)
    w = torch.randn(n, k, generator=g)
    w0 = w.clone()
    for dtype, kind in ((torch.float32, native.MAT_F32), (torch.bfloat16, native.MAT_BF16)):
        p = native.pack(w.to(dtype))
        assert p.kind == kind and p.w.data_ptr() == p.w.data_ptr()
        want = w.to(dtype).double() @ x.double()
        assert torch.allclose(kernels.mat_vec(p, x).double(), want, atol=1e-4, rtol=1e-5)
    if k % 32:
        assert native.pack(w, int8=True).kind == native.MAT_F32     # no groups: stays dense
        return
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale, mn = torch.rand(n, k // 32, generator=g) * 0.1, -torch.rand(n, k // 32, generator=g)
    p = native.pack(w, (q, scale, mn))
    assert p.kind == native.MAT_Q4 and p.w.numel() == n * k // 2      # two values a byte
    s16, m16 = scale.half().double().repeat_interleave(32, 1), mn.half().double().repeat_interleave(32, 1)
    want = (q.double() * s16 + m16) @ x.double()
    assert torch.allclose(kernels.mat_vec(p, x).double(), want, atol=1e-3, rtol=1e-5)
    p = native.pack(w, int8=True)
    assert p.kind == native.MAT_Q8 and p.w.dtype == torch.int8
    step = w.abs().view(n, k // 32, 32).amax(-1) / 127                 # per group
    bound = (step.repeat_interleave(32, 1) * 0.5 * x.abs()).sum(1) * 1.01 + 1e-3
    err = (kernels.mat_vec(p, x) - w @ x).abs()
    assert (err <= bound).all() and err.max() > 0                       # requantized, not the f32 weight
    assert torch.equal(w, w0)                                           # the dense weight is left as it was


# ------------------------------------------------------------------ the whole step, real model

def test_native_step_is_torch_step(model_path):
    """The default model decoded by native.Decoder and by torch's ops, both on the dense f32
    weights: the same logits to f32 rounding, step after step (the K/V rows it writes are
    read back by the next steps)."""
    from procs.inference.loader import load
    from procs.inference.model import Llama
    from procs.inference.kvsession import KVSession
    a = Llama(load(model_path, torch.float32, "cpu"), 1024, packed=False, kernels=native.load())
    b = Llama(load(model_path, torch.float32, "cpu"), 1024, packed=False)
    assert a.decoder is not None and b.decoder is None
    ids = list(range(2000, 2000 + 700))          # past one chunk of attention's 128 rows
    sa, sb = KVSession(a, 1024, 512), KVSession(b, 1024, 512)
    sa.prefill(ids)
    sb.prefill(ids)
    worst = 0.0
    for i in range(12):
        tok = int(sb.logits.argmax())
        la, lb = sa.decode(tok), sb.decode(tok)
        worst = max(worst, (la - lb).abs().max().item())
    assert worst < 1e-3
    # the K/V rows the steps wrote: the same rows torch's step writes, and rows at all
    new = slice(len(ids), len(ids) + 12)
    for mine, theirs in ((sa.k, sb.k), (sa.v, sb.v)):
        assert (mine[:, :, new] - theirs[:, :, new]).abs().max().item() < 1e-4
        assert mine[:, :, new].abs().amax(dim=-1).min().item() > 0
    # the embedding table is untouched by the step (it writes into its own copy of the row)
    assert torch.equal(a.embed, b.embed)


def test_packs_past_f16_range_are_refused():
    """Scales, mins and int8 scales are stored in f16: a weight whose values do not fit is
    not packed (the dense weight, or None for parts alone), never packed as inf or NaN."""
    n, k = 4, 64
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scale, mn = torch.full((n, k // 32), 0.5), torch.zeros(n, k // 32)
    assert native.pack(None, (q, scale, mn)).kind == native.MAT_Q4
    for bad in (1e6, float("nan"), float("inf")):
        big = scale.clone()
        big[1, 1] = bad
        assert native.pack(None, (q, big, mn)) is None
    w = torch.randn(n, k)
    assert native.pack(w, int8=True).kind == native.MAT_Q8
    w[2, 5] = 1e9                                   # scale 1e9/127, past f16
    p = native.pack(w, int8=True)
    assert p.kind == native.MAT_F32 and p.w is not None


_Q5_CHECK = r"""
import sys
import torch
from procs.inference import native
exact = sys.argv[1] == "1"
k = native.load()
assert k is not None
g = torch.Generator().manual_seed(5)
for n, K in ((896, 896), (33, 96), (7, 64), (130, 4864)):
    q = torch.randint(-16, 16, (n, K), dtype=torch.int8, generator=g)
    q[0, :32], q[-1, -32:] = -16, 15                   # both ends of the range
    d = (torch.rand(n, K // 32, generator=g) * 0.02).to(torch.float16)
    p5, p8 = native.pack(None, q8=(q, d)), native.Packed(native.MAT_Q8, q, d)
    assert p5.kind == native.MAT_Q5 and p5.w.numel() == n * K * 5 // 8, (p5.kind, p5.w.shape)
    x = torch.randn(K, generator=g)
    y5, y8 = k.mat_vec(p5, x), k.mat_vec(p8, x)
    assert torch.equal(y5, y8) if exact else torch.allclose(y5, y8, rtol=1e-5, atol=1e-6), (n, K)
    assert torch.equal(k.rows(p5, torch.float32), q.float() * d.float().repeat_interleave(32, 1))
    assert torch.equal(k.rows(p5, torch.bfloat16), k.rows(p8, torch.bfloat16))
wide = torch.randint(-17, 16, (8, 64), dtype=torch.int8, generator=g)
wide[0, 0] = -17                                       # a Q8_0 level past Q5_0's range
assert native.pack(None, q8=(wide, torch.ones(8, 2, dtype=torch.float16))).kind == native.MAT_Q8
print("ok")
"""


@pytest.mark.parametrize("march", ["native", "haswell", "x86-64"])
def test_q5_groups_are_the_int8_groups_bit_for_bit(march):
    """Levels that fit 5 bits (a Q5_0 source's) are kept as 5-bit groups (5.5 bits a value
    against int8's 8.5): the same values, so every path (AVX-512, AVX2, portable) gives the
    int8 copy's results, bit for bit on the vector paths (the portable one's compiler may sum
    the two kinds' loops in different orders: to rounding there); a level past the range
    keeps int8."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, RICORDO_KERNEL_MARCH=march)
    p = subprocess.run([sys.executable, "-c", _Q5_CHECK, "0" if march == "x86-64" else "1"], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stdout + p.stderr
