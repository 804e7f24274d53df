"""Multi-head latent attention (procs/inference/mla.py; GLM-4.7-Flash and DeepSeek-V2/V3,
whose GGUFs say deepseek2) beyond the parity, exact-mode and checkpoint tests of test_architectures.py (whose
tiny model "glm4_moe_lite" and its GGUF, written as llama.cpp's converter writes one, these
reuse): the cache holds the latent once, each part of the math matters, and the released configs
of GLM-4.7-Flash and DeepSeek-V2-Lite read as their GGUFs' metadata do.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from procs.inference import native
from procs.inference.archs import ModelLoadError, gguf_mla, hf_mla
from procs.inference.kvsession import KVSession
from procs.inference.loader import load
from procs.inference.model import Llama
from procs.inference.packs import MAT_F32, MAT_Q4, MAT_Q8
from tests.procs.inference.tiny_models import (CASES, MAX_POS, PROMPT, VOCAB, _hf_model, _prompt,  # noqa: F401
                                               _write_gguf, build, last_logits)

NAME = "glm4_moe_lite"


def _last_logits(w) -> torch.Tensor:
    return last_logits(w, NAME)


def test_the_cache_holds_one_latent_row_per_token(build):
    """K rows are [c, k_pe]: one head of kv_lora + rope dims, whatever the head count. V rows
    are the K rows, one tensor: the session's bytes are its K rows' alone, through prefill,
    growth, decode (the native step writes no second copy, nor zeros over k_pe) and a copy."""
    _, m, _, gguf_path = build(NAME)
    model = Llama(load(gguf_path, torch.float32, "cpu"), MAX_POS, kernels=native.load())
    c, hc = model.cfg, m.config
    assert (c.n_kv_heads, c.head_dim, c.kv_tensors) == (1, hc.kv_lora_rank + hc.qk_rope_head_dim, 1)
    s = KVSession(model, MAX_POS, 16)
    s.prefill(_prompt(NAME))
    for _ in range(3):            # past the first reserve: the rows grow, still one tensor
        s.decode(int(s.logits.argmax()))
    t = KVSession(model, MAX_POS, 16)
    t.copy_prefix(s, len(s) - 1)
    for x in (s, t):
        assert x.v is x.k and x.nbytes == x.k.numel() * x.k.element_size() > 0
    k = s.k[:, :, :len(s)]
    assert k.shape == (c.n_layers, 1, PROMPT + 3, c.head_dim)
    assert k[..., c.kv_lora:].abs().min() > 0          # the rotary keys, decode's rows too
    assert torch.equal(t.k[:, :, :len(t)], s.k[:, :, :len(t)])
    # the unabsorbed cache would hold a key (nope + rope) and a value per head
    per_head = hc.num_attention_heads * (hc.qk_nope_head_dim + hc.qk_rope_head_dim + hc.v_head_dim)
    print(f"\ncached values per token and layer: {c.head_dim} (latent) against {per_head} (per head)")


def test_a_checkpoint_with_zero_rotary_values_restores_the_same(build):
    """Checkpoints written before the one tensor hold V rows [c, 0]: importing one reads the
    K rows alone, so the session decodes as the session it came from (the zeros written over
    K's k_pe would move the logits)."""
    _, _, _, gguf_path = build(NAME)
    model = Llama(load(gguf_path, torch.float32, "cpu"), MAX_POS, kernels=native.load())
    s = KVSession(model, MAX_POS, 16)
    s.prefill(_prompt(NAME))
    tokens, k, v = s.export()
    assert torch.equal(k, v)
    old = v.clone()
    old[..., model.cfg.kv_lora:] = 0
    r = KVSession(model, MAX_POS, 16)
    r.import_(tokens, s.logits, k, old)
    tok = int(s.logits.argmax())
    want = s.decode(tok)
    assert torch.equal(r.decode(tok), want)
    broken = KVSession(model, MAX_POS, 16)
    broken.import_(tokens, s.logits, old, old)
    assert (broken.decode(tok) - want).abs().max().item() > 1e-3


@pytest.mark.parametrize("change", ["interleave", "kv_a_norm", "q_a_norm", "scale", "uk", "score_bias"])
def test_each_part_matters(build, tmp_path, change):
    """Dropping one part moves the last prompt token's logits far past the parity tolerance:
    the rotary rows' reorder (a config saying they are not interleaved), each norm, the
    unabsorbed softmax scale, the key's half of kv_b, the router's score bias."""
    _, _, hf_dir, _ = build(NAME)
    base = _last_logits(load(hf_dir, torch.float32, "cpu"))
    if change == "interleave":
        other_dir = tmp_path / "hf"
        other_dir.mkdir()
        cfg = json.loads((Path(hf_dir) / "config.json").read_text())
        (other_dir / "config.json").write_text(json.dumps({**cfg, "rope_interleave": False}))
        (other_dir / "model.safetensors").symlink_to(Path(hf_dir) / "model.safetensors")
        other = load(str(other_dir), torch.float32, "cpu")
    else:
        w = load(hf_dir, torch.float32, "cpu")
        t = dict(w.tensors)
        ends = {"kv_a_norm": "kv_a_norm", "q_a_norm": "q_a_norm", "uk": "wkv_b", "score_bias": "router_sb"}
        for k in [k for k in t if change in ends and k.endswith(ends[change])]:
            if change == "uk":     # the rows of kv_b that make keys (nope of each head's nope + v)
                H, nope = w.config.n_heads, w.config.qk_nope
                kv = t[k].clone().view(H, -1, t[k].shape[-1])
                kv[:, :nope] = kv[:, :nope].flip(-1)
                t[k] = kv.view(t[k].shape)
            else:
                t[k] = torch.ones_like(t[k]) if change.endswith("norm") else torch.zeros_like(t[k])
        cfg = dataclasses.replace(w.config, attn_scale=w.config.head_dim ** -0.5) if change == "scale" else w.config
        other = dataclasses.replace(w, tensors=t, config=cfg)
    assert (base - _last_logits(other)).abs().max().item() > 0.05, change


# GLM-4.7-Flash's config.json as released (zai-org/GLM-4.7-Flash), the fields the loader reads
FLASH = dict(model_type="glm4_moe_lite", hidden_size=2048, num_attention_heads=20, num_key_value_heads=20,
             q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
             rope_theta=1000000, rope_scaling=None, n_routed_experts=64, num_experts_per_tok=4, n_shared_experts=1,
             first_k_dense_replace=1, routed_scaling_factor=1.8, norm_topk_prob=True, topk_method="noaux_tc",
             n_group=1, topk_group=1, num_nextn_predict_layers=1, num_hidden_layers=47, vocab_size=154880,
             max_position_embeddings=202752, intermediate_size=10240, moe_intermediate_size=1536, rms_norm_eps=1e-5)
# its GGUF's metadata as llama.cpp's converter (DeepseekV2Model) writes it: MQA over the
# 576-dim latent row, the unabsorbed head in key_length_mla, no MTP layer
P = "deepseek2."
FLASH_GGUF = {P + "attention.head_count": 20, P + "attention.head_count_kv": 1, P + "attention.q_lora_rank": 768,
              P + "attention.kv_lora_rank": 512, P + "attention.key_length": 576, P + "attention.value_length": 512,
              P + "attention.key_length_mla": 256, P + "attention.value_length_mla": 256,
              P + "rope.dimension_count": 64, P + "leading_dense_block_count": 1, P + "expert_count": 64,
              P + "expert_used_count": 4, P + "expert_shared_count": 1, P + "expert_feed_forward_length": 1536,
              P + "expert_weights_scale": 1.7999999523162842, P + "expert_weights_norm": True,
              P + "expert_group_count": 1, P + "expert_group_used_count": 1, P + "expert_gating_func": 2}


def test_released_config_and_its_gguf_read_as_one_model():
    got = hf_mla(FLASH, "flash")
    assert (got["head_dim"], got["n_kv_heads"], got["kv_lora"], got["q_lora"]) == (576, 1, 512, 768)
    assert (got["qk_nope"], got["v_head_dim"], got["rope_dims"], got["rope_theta"]) == (192, 256, 64, 1e6)
    assert got["attn_scale"] == 256 ** -0.5 and got["rope_factors"] == ()
    assert (got["n_experts"], got["n_experts_used"], got["ffn_dim"], got["dense_layers"]) == (64, 4, 1536, 1)
    assert (got["moe_gating"], got["moe_norm_topk"], got["moe_groups"]) == ("sigmoid", True, 1)
    g = gguf_mla(FLASH_GGUF, P, "flash.gguf", score_bias=True)
    assert {k: g[k] for k in g} == {k: got[k] for k in g}
    # a first conversion without the gating key: sigmoid, as the score bias says
    no_key = {k: v for k, v in FLASH_GGUF.items() if not k.endswith("gating_func")}
    assert gguf_mla(no_key, P, "x", score_bias=True)["moe_gating"] == "sigmoid"
    assert gguf_mla(no_key, P, "x", score_bias=False)["moe_gating"] == "softmax"


# DeepSeek-V2-Lite-Chat's config.json as released (deepseek-ai), and what the converter writes
LITE = dict(model_type="deepseek_v2", hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
            q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            rope_theta=10000, rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                            "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
            n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1,
            routed_scaling_factor=1.0, norm_topk_prob=False, topk_method="greedy", scoring_func="softmax",
            n_group=1, topk_group=1, num_hidden_layers=27, vocab_size=102400, moe_intermediate_size=1408,
            intermediate_size=10944, max_position_embeddings=163840, rms_norm_eps=1e-6)
LITE_GGUF = {**{k: v for k, v in FLASH_GGUF.items() if "q_lora" not in k and "weights_norm" not in k},
             P + "attention.head_count": 16, P + "attention.key_length_mla": 192, P + "attention.value_length_mla": 128,
             P + "expert_used_count": 6, P + "expert_shared_count": 2, P + "expert_feed_forward_length": 1408,
             P + "expert_weights_scale": 1.0, P + "expert_gating_func": 1, P + "rope.scaling.type": "yarn",
             P + "rope.scaling.factor": 40.0, P + "rope.scaling.original_context_length": 4096,
             P + "rope.scaling.yarn_log_multiplier": 0.07069999724626541}


def test_deepseek_v2_lite_reads_as_one_model_from_either_file():
    """YaRN: the softmax scale times mscale_all_dim's factor squared (the converter's 0.1 m,
    in f32, either way), the rotary tables unscaled (mscale = mscale_all_dim); softmax over
    the experts, not renormalized."""
    got = hf_mla(LITE, "lite")
    assert got["attn_scale"] == pytest.approx(192 ** -0.5 * (1 + 0.0707 * math.log(40)) ** 2, rel=1e-7)
    assert got["rope_attn_factor"] == 1.0 and len(got["rope_factors"]) == 32
    assert (got["moe_gating"], got["moe_norm_topk"], got["q_lora"], got["v_head_dim"]) == ("softmax", False, 0, 128)
    g = gguf_mla(LITE_GGUF, P, "lite.gguf", score_bias=False)
    assert {k: g[k] for k in g} == {k: got[k] for k in g}


def test_layouts_not_supported_are_load_errors():
    with pytest.raises(ModelLoadError, match="group-limited"):    # DeepSeek-V2 (236B)'s routing
        hf_mla({**LITE, "topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3}, "x")
    with pytest.raises(ModelLoadError, match="shared expert"):
        gguf_mla({**FLASH_GGUF, P + "expert_shared_count": 0}, P, "x", True)
    with pytest.raises(ModelLoadError, match="kv_lora_rank"):
        hf_mla({k: v for k, v in FLASH.items() if k != "kv_lora_rank"}, "x")


def test_batched_decode_equals_each_sequence_alone(build):
    """Two sequences at different positions decoded in one step (the server's batch) give
    each one's logits as when decoded alone."""
    _, _, _, gguf_path = build(NAME)
    model = Llama(load(gguf_path, torch.float32, "cpu"), MAX_POS)
    ids = _prompt(NAME)
    a, b = KVSession(model, MAX_POS, 16), KVSession(model, MAX_POS, 16)
    a.prefill(ids[:30])
    b.prefill(ids[5:])
    ta, tb = int(a.logits.argmax()), int(b.logits.argmax())
    both = model.decode_batch([ta, tb], [30, len(ids) - 5], [(a.k, a.v), (b.k, b.v)])
    alone = [a.decode(ta), b.decode(tb)]
    for x, y in zip(both, alone):
        assert (x - y.flatten()).abs().max().item() < 1e-4


# GLM-4.7-Flash's head layout, narrower: 20 query heads (more than one of the attention
# kernel's query groups) on one latent K/V head of 96 + 32 = 128 dims (a multiple of 64: the
# bf16 pairs on CPUs with avx512_bf16), with a query rank; DeepSeek-V2-Lite's without one.
# Every per-head matrix has rows of a multiple of 32, so a quantized file's stay groups.
WIDE = dict(hidden_size=160, num_attention_heads=20, num_key_value_heads=20, kv_lora_rank=96, head_dim=32,
            qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=512)
Q_LORA = {"glm4_moe_lite": 64, "deepseek_v2": None}
@pytest.fixture(scope="module", params=[("glm4_moe_lite", None), ("deepseek_v2", None), ("glm4_moe_lite", "Q4_0"),
                                        ("deepseek_v2", "Q8_0")], ids=lambda p: f"{p[0]}-{p[1] or 'f32'}")
def wide(request, tmp_path_factory):
    import gguf
    name, qtype = request.param
    path = str(tmp_path_factory.mktemp("wide") / "wide.gguf")
    _write_gguf(_hf_model(name, **WIDE, q_lora_rank=Q_LORA[name]), path, CASES[name][2],
                qtype=getattr(gguf.GGMLQuantizationType, qtype) if qtype else None)
    return path, qtype


def test_native_step_is_torch_step(wide):
    """The whole-step native decoder (decode.c's mla_layer: projections, the absorbed query,
    RoPE on the rotary columns, the K/V rows, attention over the latent head, the expansion)
    against torch's step on the same weights and products (f32), past one attention chunk of
    128 rows: the same logits, step after step, and the same K/V rows written. A quantized file's per-head matrices stay its groups (views of one pack per
    layer, mla.heads), each head's values those of the file's tensor."""
    path, qtype = wide
    ctx, n = 200, 150
    mine = Llama(load(path, torch.float32, "cpu"), ctx, kernels=native.load())
    theirs = Llama(load(path, torch.float32, "cpu"), ctx, kernels=native.load())
    theirs.decoder = None        # torch's step around the same kernels' products
    assert mine.decoder is not None
    kinds = {lin.mat.kind for ly in mine.layers for lin in ly.mla.uk + ly.mla.uv}
    assert kinds == ({MAT_Q4} if qtype == "Q4_0" else {MAT_Q8} if qtype == "Q8_0" else {MAT_F32}), kinds
    dense = Llama(load(path, torch.float32, "cpu"), ctx)       # no kernels: the file's values as dense rows
    for ly, dl in zip(mine.layers, dense.layers):
        for lin, d in zip(ly.mla.uk + ly.mla.uv, dl.mla.uk + dl.mla.uv):
            assert torch.equal(lin.weight(torch.float32), d.w)
    ids = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(3)).tolist()
    sa, sb = KVSession(mine, ctx, 64), KVSession(theirs, ctx, 64)
    sa.prefill(ids)
    sb.prefill(ids)
    worst = 0.0
    for _ in range(8):
        tok = int(sb.logits.argmax())
        worst = max(worst, (sa.decode(tok) - sb.decode(tok)).abs().max().item())
    # f32 rounding; with int8 activations (qdot.c) a rounding's last bit moves an activation
    # by one step of its group's int8 scale now and then, and the logits (|logits| ~6) of that
    # step and the next (and the K/V rows they write, ~1 in size) by up to ~0.16 on the AVX2 and
    # portable builds (on most steps the two are bit for bit alike; test_moe_packs'
    # MOE_ACT_TOL); a head read from the wrong rows moves them by whole units
    tol, kv_tol = (1e-3, 1e-4) if qtype is None else (0.25, 0.25)
    assert worst < tol, worst
    new = slice(n, n + 8)
    assert sa.v is sa.k and sb.v is sb.k
    assert (sa.k[:, :, new] - sb.k[:, :, new]).abs().max().item() < kv_tol
    assert sa.k[:, :, new, :mine.cfg.kv_lora].abs().amax(dim=-1).min().item() > 0
    print(f"\n{path}: worst logit difference {worst:.2g}")


def test_native_batch_is_each_sequence_alone(wide):
    """bf16, as the server decodes on this CPU: three sequences in one native step, the second
    sharing the first's 128-row prefix (read once for both), each row the bits of that
    sequence decoded alone."""
    ctx = 200
    model = Llama(load(wide[0], torch.bfloat16, "cpu"), ctx, kernels=native.load())
    assert model.decoder is not None
    ids = torch.randint(0, VOCAB, (170,), generator=torch.Generator().manual_seed(4)).tolist()
    a, b, c = (KVSession(model, ctx, 64) for _ in range(3))
    a.prefill(ids[:150])
    b.copy_prefix(a, 128)
    b.prefill(ids[150:170])
    c.prefill(ids[100:140])
    toks, pos = [7, 8, 9], [150, 148, 40]
    both = model.decoder.batch(torch.tensor(toks), pos, [(s.k, s.v) for s in (a, b, c)],
                               share=[(0, 0), (0, 128), (2, 0)])
    alone = [model.decoder.batch(torch.tensor([t]), [p], [(s.k, s.v)]) for t, p, s in zip(toks, pos, (a, b, c))]
    for i in range(3):
        assert torch.equal(both[i], alone[i][0]), i
