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
from procs.inference.cpu import has_flag
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
# (20, 1, 576), (128, 1, 576): GLM-4.7-Flash's and DeepSeek-V3's latent attention (mla.py)
@pytest.mark.parametrize("H,KV,D", [(9, 3, 64), (16, 8, 128), (4, 1, 256), (8, 8, 80), (32, 2, 64), (20, 1, 576),
                                    (128, 1, 576)])
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


@pytest.mark.parametrize("H,KV,D", [(9, 3, 64), (16, 8, 128), (8, 1, 256), (20, 1, 576)])
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
    assert kernel.takes(1, 64) and kernel.takes(128, 576)
    assert not kernel.takes(129, 64) and not kernel.takes(4, 577)
    prefill = native.load().prefill
    assert prefill.takes(16, 256) and not prefill.takes(17, 64) and not prefill.takes(4, 257)
    with pytest.raises(ValueError, match="does not take"):        # the C side's own limits agree
        kernel(torch.randn(129, 64), torch.randn(1, 10, 64), torch.randn(1, 10, 64), 0.125)


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
    padded = -(-n // 16) * 16                                           # whole blocks of 16 rows
    assert p.kind == native.MAT_Q4 and p.w.numel() == padded * k // 2 and p.mat().n == n   # two values a byte
    s16, m16 = scale.half().double().repeat_interleave(32, 1), mn.half().double().repeat_interleave(32, 1)
    assert torch.equal(kernels.rows(p, torch.float32).double(), (q.double() * s16 + m16).float().double())
    assert torch.allclose(kernels.mat_vec(p, x).double(), q4_reference(q, scale, mn, x), atol=1e-4, rtol=1e-5)
    p = native.pack(w, int8=True)
    assert p.kind == native.MAT_Q8 and p.w.numel() == padded * k and p.mat().n == n
    wq = kernels.rows(p, torch.float32)
    step = (w.abs().view(n, k // 32, 32).amax(-1) / 127).half().float()   # per group, its f16 scale
    assert ((wq - w).abs() <= step.repeat_interleave(32, 1) * 0.5 + 1e-6).all()   # within half a step
    xstep = (x.view(-1, 32).abs().amax(1) / 127).repeat_interleave(32)
    # the weights' rounding and the activations' (int8 per group of 32), half a step each
    bound = (step.repeat_interleave(32, 1) * 0.5 * x.abs() + wq.abs() * xstep * 0.5).sum(1) * 1.01 + 1e-4
    err = (kernels.mat_vec(p, x) - w @ x).abs()
    assert (err <= bound).all() and err.max() > 0                       # requantized, not the f32 weight
    xg = x.view(-1, 32)
    xd = torch.round(xg * torch.where(xg.abs().amax(1) > 0, 127 / xg.abs().amax(1), 0)[:, None]) \
        * (xg.abs().amax(1) / 127)[:, None]                             # the dequantized activations
    assert torch.allclose(kernels.mat_vec(p, x).double(), wq.double() @ xd.view(-1).double(), atol=1e-4, rtol=1e-5)
    assert torch.equal(w, w0)                                           # the dense weight is left as it was


# ------------------------------------------------------------------ the whole step, real model

def q4_reference(q, scale, mn, x):
    """What the int4 kernel computes (qdot.c), in f64: x quantized per group of 32 to int8
    (step max|x|/127, round to even), the weights times that dequantized x."""
    n, k = q.shape
    xg = x.view(-1, 32)
    step = xg.abs().amax(1) / 127
    xq = torch.round(xg * torch.where(step > 0, 1 / step, 0)[:, None]).double()
    isum = (q.double().view(n, -1, 32) * xq).sum(-1)
    return (isum * scale.half().double() * step.double() + mn.half().double() * step.double() * xq.sum(1)).sum(1)


def test_int4_error_is_int8_activations_error():
    """The int4 kernel's only approximation is the int8 activations: against the exact
    product of the same weights it errs by at most half a step per value (|err| <= sum over
    the row of |w| * step/2), and on a realistic row (Gaussian weights around zero) its
    relative error is under 1 %."""
    kernels = native.load()
    g = torch.Generator().manual_seed(3)
    n, k = 256, 1536
    w = torch.randn(n, k, generator=g) * 0.02
    wg = w.view(n, k // 32, 32)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = (hi - lo) / 15
    q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).view(n, k)
    p = native.pack(None, (q, scale, lo))
    exact_w = q.double() * scale.half().double().repeat_interleave(32, 1) + lo.half().double().repeat_interleave(32, 1)
    x = torch.randn(k, generator=g)
    exact = exact_w @ x.double()
    got = kernels.mat_vec(p, x).double()
    step = (x.view(-1, 32).abs().amax(1) / 127).double().repeat_interleave(32)
    bound = (exact_w.abs() * step / 2).sum(1) * 1.001 + 1e-6
    err = (got - exact).abs()
    assert (err <= bound).all() and err.max() > 0
    assert (err.norm() / exact.norm()).item() < 0.01


_Q4_CHECK = r"""
import ctypes
import sys
import torch
from procs.inference import native
k = native.load()
g = torch.Generator().manual_seed(4)
out = []
packs = []
for n, K in ((960, 576), (33, 1536), (16, 32)):
    q = torch.randint(0, 16, (n, K), dtype=torch.uint8, generator=g)
    sc, mn = torch.rand(n, K // 32, generator=g) * 0.05, -torch.rand(n, K // 32, generator=g)
    packs.append(native.pack(None, (q, sc, mn)))
    w = torch.randn(n, K, generator=g)
    w[0, :32] = w[0, :32].abs().amax()                  # int8 levels +127 ...
    w[1, :32] = -w[1, :32].abs().amax()                 # ... and -127
    packs.append(native.pack(w, int8=True))
for p in packs:
    assert p.kind in (native.MAT_Q4, native.MAT_Q8)
    n, K = p.mat().n, p.mat().k
    x = torch.randn(6, K, generator=g)
    x[2, :32] = x[2, :32].abs().amax()                  # activations at +127 and -127 too
    x[3, :32] = -x[3, :32].abs().amax()
    x[1, :32] = 0                                       # a group of zeros: step 0
    one = torch.stack([k.mat_vec(p, r) for r in x])
    out += [one, k.rows(p, torch.float32), k.rows(p, torch.bfloat16).view(torch.int16)]   # prefill's values too
    y = torch.empty(6, n)                               # all six in one call: rows as alone
    f = k.lib.mat_mul
    f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long]
    assert f(ctypes.byref(p.mat()), 6, x.data_ptr(), K, y.data_ptr(), n) == 0
    assert torch.equal(y, one), (n, K)
torch.save(out, sys.argv[1])
print("ok")
"""


def test_int4_and_int8_rows_are_the_same_bits_on_every_path(tmp_path):
    """Integer dot products and one fixed order of float operations per row: the AVX-512
    (VNNI or not), AVX2 and portable builds give the same bits (and the same dequantized
    rows, f32 and bf16, for prefill), for int4 and int8 weights
    (at the ends of the int8 range: no saturation on any path), and a row of a batch equals
    the row alone (six rows: a pass of four, then two)."""
    import os
    import subprocess
    import sys
    results = {}
    marches = ["native", "haswell", "x86-64"]
    if has_flag("avx512bw"):  # AVX-512 without VNNI, where this CPU runs it
        marches.insert(1, "skylake-avx512")
    for march in marches:
        env = dict(os.environ, RICORDO_KERNEL_MARCH=march)
        out = tmp_path / f"{march}.pt"
        p = subprocess.run([sys.executable, "-c", _Q4_CHECK, str(out)], env=env, capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0 and p.stdout.strip() == "ok", march + p.stdout + p.stderr
        results[march] = torch.load(out)
    for march, got in results.items():
        for a, b in zip(got, results["native"]):
            assert torch.equal(a, b), march


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
k = native.load()
assert k is not None
g = torch.Generator().manual_seed(5)
for n, K in ((896, 896), (33, 96), (7, 64), (130, 4864)):
    q = torch.randint(-16, 16, (n, K), dtype=torch.int8, generator=g)
    q[0, :32], q[-1, -32:] = -16, 15                   # both ends of the range
    d = (torch.rand(n, K // 32, generator=g) * 0.02).to(torch.float16)
    p5, p8 = native.pack(None, q8=(q, d)), native.Packed(native.MAT_Q8, *native.q8_blocks(q, d), n=n)
    assert p5.kind == native.MAT_Q5 and p5.w.numel() == n * K * 5 // 8, (p5.kind, p5.w.shape)
    x = torch.randn(K, generator=g)
    w = q.float() * d.float().repeat_interleave(32, 1)
    assert torch.equal(k.rows(p5, torch.float32), w) and torch.equal(k.rows(p8, torch.float32), w)
    assert torch.allclose(k.mat_vec(p5, x).double(), w.double() @ x.double(), rtol=1e-5, atol=1e-4), (n, K)
    assert torch.equal(k.rows(p5, torch.bfloat16), k.rows(p8, torch.bfloat16))
wide = torch.randint(-17, 16, (8, 64), dtype=torch.int8, generator=g)
wide[0, 0] = -17                                       # a Q8_0 level past Q5_0's range
assert native.pack(None, q8=(wide, torch.ones(8, 2, dtype=torch.float16))).kind == native.MAT_Q8
print("ok")
"""


@pytest.mark.parametrize("march", ["native", "haswell", "x86-64"])
def test_q5_groups_are_the_int8_groups_values(march):
    """Levels that fit 5 bits (a Q5_0 source's) are kept as 5-bit groups (5.5 bits a value
    against int8's 8.5): the same values, bit for bit, as the int8 copy on every path
    (AVX-512, AVX2, portable), and products with f32 activations; a level past the range
    keeps int8."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, RICORDO_KERNEL_MARCH=march)
    p = subprocess.run([sys.executable, "-c", _Q5_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stdout + p.stderr
