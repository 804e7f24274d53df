"""Quantized experts held as the file holds them (linear.experts): a mixture of experts whose
expert tensors are Q4_0, Q4_1, Q8_0, Q5_0 or Q5_1 keeps one native pack per expert, of about
the file's bytes (a dense copy would be 3.6-7x that), and answers as the same file's
experts dequantized to dense tensors (torch's path, no kernels) do: within the int8
activations' tolerance where the kernels multiply int8 (Q4, Q8), to f32 rounding where they
do not (Q5_0's 5-bit groups), within a share of the file's own quantization error where the
groups are requantized (Q5_1). A second load maps every expert's pack from the pack cache.
The whole-step native decoder runs these experts (kernels/moe.c): a batch's rows are each
sequence's row alone, bit for bit; it takes gpt-oss's (biases, its clamped SwiGLU, beside
attention sinks and an output bias) and GLM-4.5's (sigmoid scores chosen with a bias within
groups) as torch's step computes them."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from procs.inference import linear as linear_mod
from procs.inference import native
from procs.inference.kvsession import KVSession
from procs.inference.steps import decode_many
from procs.inference.loader import load
from procs.inference.model import Llama
from procs.inference.native import MAT_Q4, MAT_Q5, MAT_Q8
from procs.inference.packcache import PackCache
from tests.procs.inference.tiny_models import (CASES, MAX_POS, PROMPT, _hf_model, _prompt, _write_gguf,  # noqa: F401
                                               batched_steps, build)

gguf = pytest.importorskip("gguf")
from gguf.constants import GGMLQuantizationType as T  # noqa: E402

KINDS = {T.Q4_0: MAT_Q4, T.Q4_1: MAT_Q4, T.Q8_0: MAT_Q8, T.Q5_0: MAT_Q5, T.Q5_1: MAT_Q8}
# int8 activations into the experts (Q4, Q8: the kernels' integer products, as llama.cpp's,
# in decode and, for an expert's few rows, in prefill): rows measured 0.04-0.25 from the dense
# experts' logits (|logits| ~5; medians 0.07-0.08), against 1e-5 where the activations stay
# f32 (Q5_0), but for a row whose token's choice of experts they flip (one of 48 seen, 1.6):
# that moves it by a step, so a few rows may be past the tolerance. The values themselves are
# checked exactly.
MOE_ACT_TOL = 0.25
EXACT_TOL = 1e-3
REQUANT_SHARE = 1.0    # test_quant_files.py's for routed models


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """qwen3moe (expert rows of 64: whole quant blocks) with its experts in each type, the rest F32."""
    m = _hf_model("qwen3moe", moe_intermediate_size=64)
    d = tmp_path_factory.mktemp("moe")
    out = {}
    for q in (None, *KINDS):
        out[q] = str(d / f"{q.name if q else 'F32'}.gguf")
        _write_gguf(m, out[q], CASES["qwen3moe"][2], experts_qtype=q)
    return out


def answer(model) -> torch.Tensor:
    """Logits after every prompt token (prefill in chunks of 16), then after 8 decode steps of fixed tokens."""
    ids = _prompt("qwen3moe")
    s = KVSession(model, MAX_POS, 16)
    got = s.prefill(ids, logits_at=range(1, PROMPT + 1))
    rows = [got[n] for n in range(1, PROMPT + 1)]
    rows += [s.decode(t) for t in ids[:8]]
    return torch.stack(rows).float()


def expert_bytes(path: str) -> int:
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if "_exps" in t.name)


@pytest.mark.parametrize("qtype", list(KINDS), ids=[q.name for q in KINDS])
def test_quantized_experts_are_held_as_the_file_holds_them(files, tmp_path, monkeypatch, qtype):
    path = files[qtype]
    kernels = native.load()
    assert kernels is not None, "the native kernels did not build"
    cache = PackCache(str(tmp_path / "packs"))
    model = Llama(load(path, torch.float32, "cpu"), MAX_POS, kernels=kernels, cache=cache)
    ref_model = Llama(load(path, torch.float32, "cpu"), MAX_POS)          # torch's path: dense experts
    held = 0
    for ly, ref_ly in zip(model.layers, ref_model.layers):
        assert ly.moe.packed and len(ly.moe.gate_up) == len(ly.moe.down) == model.cfg.n_experts
        for e, lin in enumerate((*ly.moe.gate_up, *ly.moe.down)):
            assert lin.mat.kind == KINDS[qtype] and lin._w is None      # the pack is the only copy
            held += lin.mat.w.nbytes + lin.mat.s.nbytes
            if qtype != T.Q5_1:    # the file's values exactly (Q5_1's are requantized)
                dense = (ref_ly.moe.gate_up if e < len(ly.moe.gate_up) else ref_ly.moe.down)[e % len(ly.moe.down)]
                assert torch.equal(lin.weight(torch.float32), dense)
    dense_bytes = sum(4 * int(np.prod(t.shape)) for t in gguf.GGUFReader(path).tensors if "_exps" in t.name)
    print(f"\n[{qtype.name}] experts held in {held} bytes; the file's {expert_bytes(path)}, dense f32 {dense_bytes}")
    assert held <= (1.45 if qtype == T.Q5_1 else 1.12) * expert_bytes(path) and held < dense_bytes / 3

    ours, ref = answer(model), answer(ref_model)
    rows = (ours - ref).abs().max(dim=-1).values                          # per prefill or decode row
    print(f"[{qtype.name}] logits vs dense experts: median row {rows.median().item():.3g}, "
          f"max {rows.max().item():.3g}, rows past {MOE_ACT_TOL}: {int((rows > MOE_ACT_TOL).sum())} of {len(rows)}")
    if qtype == T.Q5_0:            # 5-bit groups, f32 activations: the dense experts' sums
        assert rows.max() < EXACT_TOL
    elif qtype == T.Q5_1:          # requantized to int8 groups: against the file's own error
        d_quant = (ref - answer(Llama(load(files[None], torch.float32, "cpu"), MAX_POS))).abs().max().item()
        assert rows.max() < REQUANT_SHARE * d_quant
    else:                          # int8 activations; a token whose expert choice they flip moves by a step
        assert rows.median() < MOE_ACT_TOL / 2 and (rows > MOE_ACT_TOL).sum() <= len(rows) // 16

    cache.save()

    def boom(*a, **k):
        raise AssertionError("packed an expert the cache holds")
    monkeypatch.setattr(linear_mod, "fuse", boom)      # what linear.experts packs with
    again = Llama(load(path, torch.float32, "cpu"), MAX_POS, kernels=kernels, cache=PackCache(str(tmp_path / "packs")))
    assert torch.equal(answer(again), ours)


def test_the_native_step_batches_experts_as_each_sequence_alone(files):
    """Three sessions at different lengths decode in one step of decode.c (each expert read
    once for the rows that chose it): each row equals that session decoding alone, bit for
    bit, and is within the int8 activations' tolerance of torch's step on dense experts."""
    path = files[T.Q4_0]
    model = Llama(load(path, torch.float32, "cpu"), MAX_POS, kernels=native.load())
    ref = Llama(load(path, torch.float32, "cpu"), MAX_POS)
    assert model.decoder is not None and model.layers[0].moe.packed
    ids = _prompt("qwen3moe")
    runs = {}
    for name, m in (("native", model), ("torch", ref)):
        together = [KVSession(m, MAX_POS, 16) for _ in range(3)]
        alone = [KVSession(m, MAX_POS, 16) for _ in range(3)]
        for i, (a, b) in enumerate(zip(together, alone)):
            a.prefill(ids[:10 + 9 * i])
            b.prefill(ids[:10 + 9 * i])
        rows = []
        for step in range(4):
            toks = [ids[(5 * i + step) % len(ids)] for i in range(3)]
            batch = decode_many(together, toks)
            for s, t, row in zip(alone, toks, batch):
                one = s.decode(t)
                if name == "native":
                    assert torch.equal(one, row), step
            rows.append(torch.stack(list(batch)))
        runs[name] = torch.stack(rows)
    rows = (runs["native"] - runs["torch"]).abs().max(dim=-1).values.flatten()
    print(f"\nbatched native step vs torch's on dense experts: rows {[round(v, 3) for v in rows.tolist()]}")
    assert rows.median() < MOE_ACT_TOL / 2 and (rows > MOE_ACT_TOL).sum() <= 1      # (a flip: see MOE_ACT_TOL)


def test_experts_of_mixed_types_are_requantized_not_dense():
    """gate in 4 bits, up in another quantized type (a Q4_K_M file's mix): the fused expert
    is int8 groups of the dequantized values (as fuse() packs a mixed layer), not a dense copy."""
    from procs.inference.linear import experts
    E, N, K = 3, 32, 64
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (E * N, K), dtype=torch.uint8, generator=g)
    scale, mn = torch.rand(E * N, K // 32, generator=g) * 0.1, -torch.rand(E * N, K // 32, generator=g)
    gate = (q.float() * scale.repeat_interleave(32, 1) + mn.repeat_interleave(32, 1)).view(E, N, K)
    up = torch.randn(E, N, K, generator=g)
    t = {"norm": torch.ones(K), "gate": gate, "up": up}
    lins = experts(["gate", "up"], E, t, {"gate": (q, scale, mn)}, {"up"}, True, native.load())
    for e, lin in enumerate(lins):
        assert lin.mat.kind == MAT_Q8 and lin._w is None
        want = torch.cat([gate[e], up[e]])
        step = want.abs().view(2 * N, K // 32, 32).amax(-1).repeat_interleave(32, 1) / 127
        # half an int8 step, and the f16 scale's rounding (127 levels x 2^-11 of a step)
        assert ((lin.weight(torch.float32) - want).abs() <= 0.6 * step).all()


def test_mxfp4_experts_are_exact_five_bit_groups(tmp_path):
    """gpt-oss's MXFP4 experts (GGUF): e2m1 values doubled are integers in [-12, 12] and the
    block's power of two halved is an f16, so each expert is a pack of 5-bit groups holding
    the file's values exactly (1.29x the file's 4.25 bits, not a dense copy), and the model
    answers as on dense experts to f32 rounding (5-bit groups multiply f32 activations)."""
    m = _hf_model("gpt_oss")
    path = str(tmp_path / "mxfp4.gguf")
    _write_gguf(m, path, CASES["gpt_oss"][2], experts_qtype=T.MXFP4)
    model = Llama(load(path, torch.float32, "cpu"), MAX_POS, kernels=native.load())
    ref_model = Llama(load(path, torch.float32, "cpu"), MAX_POS)
    held = 0
    for ly, ref_ly in zip(model.layers, ref_model.layers):
        assert ly.moe.packed
        for lin, dense in zip((*ly.moe.gate_up, *ly.moe.down), (*ref_ly.moe.gate_up, *ref_ly.moe.down)):
            assert lin.mat.kind == MAT_Q5 and lin._w is None
            assert torch.equal(lin.weight(torch.float32), dense)
            held += lin.mat.w.nbytes + lin.mat.s.nbytes
    print(f"\n[MXFP4] experts held in {held} bytes; the file's {expert_bytes(path)}")
    assert held <= 1.35 * expert_bytes(path)
    ids = _prompt("gpt_oss")
    got = [KVSession(x, MAX_POS, 16).prefill(ids, logits_at=[PROMPT])[PROMPT] for x in (model, ref_model)]
    assert (got[0] - got[1]).abs().max() < EXACT_TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["gpt_oss", "glm4moe"])
def test_the_whole_step_takes_gpt_oss_and_glm(build, name, dtype):
    """decode.c's whole step against torch's step on the same packed weights: gpt-oss (sinks,
    the output bias, windows of 8 at positions past them, router and expert biases, the clamped
    SwiGLU) and GLM-4.5 (sigmoid scores plus a bias, within the better of two groups, times
    2.5, a shared expert). Three sessions in one batched step: the logits agree to rounding
    (bf16: the whole step keeps f32 activations where torch's rounds each op, and a near tie of
    two experts may then choose the other), a row equals
    its sequence alone bit for bit, and the parts are read (no sinks, no biases: other logits)."""
    _, _, _, gguf_path = build(name)
    kernels = native.load()
    assert kernels is not None, "the native kernels did not build"
    models = {}
    for path in ("whole", "torch"):
        model = models[path] = Llama(load(gguf_path, dtype, "cpu"), MAX_POS, kernels=kernels)
        assert model.decoder is not None and all(ly.moe.packed for ly in model.layers if ly.moe)
        if path == "torch":
            model.decoder = None
    ids = _prompt(name)
    runs = {path: batched_steps(model, ids, alone_equal=path == "whole")[0] for path, model in models.items()}
    ref, ours = runs["torch"], runs["whole"]
    scale = ref.abs().max().item()
    tol = 1e-4 if dtype == torch.float32 else 0.1
    rows = (ours - ref).abs().amax(dim=-1).flatten()      # per (step, sequence)
    print(f"\n[{name} {dtype}] whole step vs torch's, rows: {[round(r, 3) for r in rows.tolist()]} of {scale:.3g}")
    bound = tol * max(1.0, scale)
    if dtype == torch.float32:
        assert rows.max() < bound
    else:   # a near tie of two experts' scores may go the other way once rounded (GLM: 1 row of 15 seen)
        assert rows.median() < bound / 2 and (rows > bound).sum() <= 1
    whole = models["whole"]
    s = KVSession(whole, MAX_POS, 16)
    s.prefill(ids[:30])
    base = s.decode(ids[30])
    parts = [ly.sinks for ly in whole.layers if ly.sinks is not None] + \
        [t for ly in whole.layers if ly.moe for t in (ly.moe.router_b, ly.moe.score_bias, ly.moe.gate_up_b)
         if t is not None]
    assert parts
    keep = [t.clone() for t in parts]
    for t in parts:          # the decoder's f32 copies of these: rebuilt on the zeroed tensors
        t.zero_()
    whole.decoder = kernels.decoder(whole)
    s2 = KVSession(whole, MAX_POS, 16)
    s2.prefill(ids[:30])
    changed = s2.decode(ids[30])
    for t, k in zip(parts, keep):
        t.copy_(k)
    assert (changed - base).abs().max() > 0.05     # one path both times: any difference is theirs
