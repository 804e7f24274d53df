"""gpt-oss beyond the parity of tests/procs/inference/test_architectures.py (whose tiny random
model and GGUF these reuse): each part of its math matters to the logits (so the parity test
would catch it missing), its experts load from MXFP4 (the released checkpoints' format, in
either file) to transformers' logits on the same values, and the attention with sinks (torch's
ops, and the native kernels' decode and prefill) equals the eager reference on shapes the tiny
model does not reach.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from procs.inference import native
from procs.inference.archs import hf_gpt_oss
from procs.inference.gguf_tensors import mxfp4_rows
from procs.inference.hf_files import read_safetensors
from procs.inference.kvsession import KVSession
from procs.inference.loader import load
from procs.inference.model import Llama
from procs.inference.torch_attention import causal_mask, sink_attention
from tests.procs.inference.tiny_models import (LOGIT_TOL, _prompt, _write_gguf, build, gguf,  # noqa: F401
                                               last_logits)

NAME = "gpt_oss"


def _last_logits(w) -> torch.Tensor:
    return last_logits(w, NAME)


def _zeroed(w, suffix: str):
    t = dict(w.tensors)
    for k in [k for k in t if k.endswith(suffix)]:
        t[k] = torch.zeros_like(t[k])
    return dataclasses.replace(w, tensors=t)


@pytest.mark.parametrize("change", ["sinks", "bo", "router_b", "gate_exps_b", "windows", "clamp", "truncate"])
def test_each_part_matters(build, change):
    """Dropping one part (a sink, a bias, the windows, the clamps, YaRN's unrounded ramp)
    moves the last prompt token's logits: the clamps bite at this model's scale, and the
    40-token prompt is five windows long."""
    _, _, hf_dir, _ = build(NAME)
    w = load(hf_dir, torch.float32, "cpu")
    assert w.config.windows == (8, 0) and w.config.act == "swiglu_oai" and w.config.swiglu_limit == 7.0
    if change == "windows":
        other = dataclasses.replace(w, config=dataclasses.replace(w.config, windows=()))
    elif change == "clamp":
        other = dataclasses.replace(w, config=dataclasses.replace(w.config, swiglu_limit=1e9))
    elif change == "truncate":   # the ramp's bounds rounded, as for other YaRN models
        with open(f"{hf_dir}/config.json") as f:
            c = json.load(f)
        c["rope_parameters"]["truncate"] = True
        rounded = hf_gpt_oss(c, c["head_dim"], "x")["rope_factors"]
        assert rounded != w.config.rope_factors
        other = dataclasses.replace(w, config=dataclasses.replace(w.config, rope_factors=rounded))
    else:
        other = _zeroed(w, change)
    a, b = _last_logits(load(hf_dir, torch.float32, "cpu")), _last_logits(other)
    assert (a - b).abs().max().item() > 0.05, change


def _to_hf_mxfp4(q: np.ndarray, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF MXFP4 blocks of a [E, rows, cols] tensor (17 bytes: scale, 16 bytes of values 0-15
    low and 16-31 high) as the released HF layout: blocks [E, rows, G, 16] (values 2i low,
    2i+1 high) and scales [E, rows, G]."""
    b = q.reshape(-1, 17)
    lo, hi = b[:, 1:] & 0x0F, b[:, 1:] >> 4
    nib = np.concatenate([lo, hi], axis=1)                        # value j's nibble, j = 0..31
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
    E = q.shape[0]
    return (torch.from_numpy(packed.reshape(E, rows, -1, 16).copy()),
            torch.from_numpy(b[:, 0].reshape(E, rows, -1).copy()))


def test_mxfp4_experts_from_either_file(build, tmp_path):
    """Experts quantized to MXFP4: the GGUF (type MXFP4) and the HF dir (*_blocks / *_scales,
    as the released checkpoints hold them) load to transformers' logits on the dequantized
    values, and to one another's."""
    from safetensors.torch import save_file
    _, m, hf_dir, _ = build(NAME)
    c = m.config
    m = type(m)(c).eval()
    m.load_state_dict(build(NAME)[1].state_dict())
    sd = {k: v.clone() for k, v in read_safetensors(f"{hf_dir}/model.safetensors").items()}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts."
        for name in ("gate_up_proj", "down_proj"):
            w = sd.pop(p + name).transpose(1, 2).contiguous()             # [E, out, in]
            q = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.MXFP4)
            blocks, scales = _to_hf_mxfp4(q, w.shape[1])
            sd[p + name + "_blocks"], sd[p + name + "_scales"] = blocks, scales
            deq = mxfp4_rows(blocks, scales)
            np.testing.assert_array_equal(deq.numpy(), gguf.quants.dequantize(q, gguf.GGMLQuantizationType.MXFP4))
            with torch.no_grad():   # transformers on the same values
                getattr(m.model.layers[i].mlp.experts, name).copy_(deq.transpose(1, 2))
    d = tmp_path / "hf"
    d.mkdir()
    save_file(sd, str(d / "model.safetensors"))
    (d / "config.json").write_text(open(f"{hf_dir}/config.json").read())
    qpath = str(tmp_path / "mxfp4.gguf")
    _write_gguf(m, qpath, "gpt-oss", experts_qtype=gguf.GGMLQuantizationType.MXFP4)
    ids = _prompt(NAME)
    with torch.no_grad():
        want = m(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
    got = [_last_logits(load(path, torch.float32, "cpu")) for path in (str(d), qpath)]
    print(f"\nMXFP4 experts: HF dir vs transformers {(got[0] - want).abs().max().item():.3g}, "
          f"GGUF vs HF dir {(got[1] - got[0]).abs().max().item():.3g}")
    assert (got[0] - want).abs().max().item() < LOGIT_TOL
    assert (got[1] - got[0]).abs().max().item() < LOGIT_TOL
    assert (got[0] - _last_logits(load(hf_dir, torch.float32, "cpu"))).abs().max().item() > 1e-3  # it was quantized
    # with the native kernels, either file's experts become the same exact 5-bit groups (the
    # HF blocks never expanded to dense tensors): the same packs, the same logits, bit for bit
    kernels = native.load()
    packed = [Llama(load(path, torch.float32, "cpu"), 256, kernels=kernels) for path in (str(d), qpath)]
    for ly_hf, ly_gguf in zip(*(m.layers for m in packed)):
        for a, b in zip((*ly_hf.moe.gate_up, *ly_hf.moe.down), (*ly_gguf.moe.gate_up, *ly_gguf.moe.down)):
            assert a.mat.kind == b.mat.kind == native.MAT_Q5 and a._w is None
            assert torch.equal(a.mat.w, b.mat.w) and torch.equal(a.mat.s, b.mat.s)
    hf_logits, gguf_logits = (KVSession(m, 256, 16).prefill(ids, logits_at=[len(ids)])[len(ids)] for m in packed)
    assert torch.equal(hf_logits, gguf_logits)


def _eager(q, k, v, mask, scale, sinks):
    """transformers' eager attention with sinks: the sink as one more column of the softmax."""
    T, H, D = q.shape
    KV = k.shape[0]
    kk, vv = (x.repeat_interleave(H // KV, dim=0).float() for x in (k, v))
    s = torch.einsum("thd,hsd->hts", q.float(), kk) * scale + mask
    s = torch.cat([s, sinks.view(H, 1, 1).expand(H, T, 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :-1]
    return torch.einsum("hts,hsd->thd", p, vv).reshape(T, H * D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 16])
def test_sink_attention_equals_the_eager_reference(dtype, window, monkeypatch):
    """Across the query blocks it splits a long call into (a small block bound here), with
    a window, grouped heads and sinks large enough to take most of the weight."""
    import procs.inference.torch_attention as ta
    monkeypatch.setattr(ta, "SINK_BLOCK", 8 * 100 * 7)   # 7 query rows a block at 100 keys
    g = torch.Generator().manual_seed(3)
    T, S, H, KV, D = 37, 100, 8, 2, 32
    q, k, v = (torch.randn(*shape, generator=g).to(dtype) for shape in ((T, H, D), (KV, S, D), (KV, S, D)))
    sinks = torch.randn(H, generator=g) * 3
    mask = causal_mask(torch.arange(S - T, S).unsqueeze(1), torch.arange(S), window, torch.float32)
    got = sink_attention(q, k, v, mask.to(dtype), D ** -0.5, sinks).float()
    want = _eager(q, k, v, mask, D ** -0.5, sinks)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (got - want).abs().max().item() < tol
    assert (want - _eager(q, k, v, mask, D ** -0.5, sinks - 30)).abs().max().item() > 0.05   # sinks matter
    # one decode row, no mask: the last query's row
    one = sink_attention(q[-1:], k, v, None if not window else mask[-1:].to(dtype), D ** -0.5, sinks).float()
    assert (one - want[-1:]).abs().max().item() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 40])
def test_native_attention_with_sinks_equals_the_eager_reference(dtype, window):
    """The kernels' decode attention (keys past one 128-row chunk, so its partials combine with
    the sink) and prefill attention (rows resumed at a position, blocks of 64 keys), grouped
    heads, a window or none, sinks that take most of the weight for some heads: the eager
    reference's values; without the sinks they would differ."""
    kernels = native.load()
    assert kernels is not None, "the native kernels did not build"
    g = torch.Generator().manual_seed(5)
    T, S, H, KV, D = 37, 300, 8, 2, 64
    pos = S - T
    q, k, v = (torch.randn(*shape, generator=g).to(dtype) for shape in ((T, H, D), (KV, S, D), (KV, S, D)))
    sinks = torch.randn(H, generator=g) * 3
    scale = D ** -0.5
    mask = causal_mask(torch.arange(pos, S).unsqueeze(1), torch.arange(S), window, torch.float32)
    want = _eager(q, k, v, mask, scale, sinks)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    got = kernels.prefill(q, k, v, pos, window, scale, sinks=sinks).float()
    assert (got - want).abs().max().item() < tol
    first = max(0, S - window) if window else 0
    one = kernels.attention(q[-1], k[:, first:], v[:, first:], scale, sinks=sinks).float()
    assert (one - want[-1:]).abs().max().item() < tol
    plain = kernels.attention(q[-1], k[:, first:], v[:, first:], scale).float()
    assert (plain - one).abs().max().item() > 0.05          # the sinks took their share
    assert (kernels.prefill(q, k, v, pos, window, scale).float() - got).abs().max().item() > 0.05
