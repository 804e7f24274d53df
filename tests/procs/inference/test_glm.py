"""GLM-4.5 (glm4moe) and GLM-4 0414 (glm4) beyond the parity of
tests/procs/inference/test_architectures.py (whose tiny random models and GGUFs these reuse):
each part of their math matters to the logits, so the parity test would catch it missing;
GLM-4.5's released configs read as transformers reads them; a GGUF's MTP layer is counted out
of the layers run.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from procs.inference import archs
from procs.inference.archs import ModelLoadError, gguf_glm4moe, hf_glm4moe
from procs.inference.loader import load
from tests.procs.inference.tiny_models import build, last_logits  # noqa: F401

NAME = "glm4moe"


def _last_logits(w, name: str = NAME) -> torch.Tensor:
    return last_logits(w, name)


@pytest.mark.parametrize("change", ["score_bias", "scale", "groups", "shared", "dense", "rope_dims", "bq", "q_norm"])
def test_each_part_matters(build, change):
    """Dropping one part moves the last prompt token's logits by more than the parity test's
    tolerance allows many times over."""
    _, _, hf_dir, _ = build(NAME)
    w = load(hf_dir, torch.float32, "cpu")
    c = w.config
    assert (c.moe_gating, c.moe_scale, c.moe_groups, c.moe_groups_used, c.dense_layers, c.rope_dims) == \
        ("sigmoid", 2.5, 2, 1, 1, 8)
    t = dict(w.tensors)
    if change == "score_bias":
        t = {k: torch.zeros_like(v) if k.endswith("router_sb") else v for k, v in t.items()}
    elif change == "shared":
        t = {k: torch.zeros_like(v) if k.endswith("_sh") else v for k, v in t.items()}
    elif change in ("bq", "q_norm"):
        t = {k: (torch.ones_like(v) if change == "q_norm" else torch.zeros_like(v)) if k.endswith(change) else v
             for k, v in t.items()}
    elif change == "dense":   # layer 0's dense MLP zeroed
        t = {k: torch.zeros_like(v) if k.startswith("layers.0.w_") else v for k, v in t.items()}
    fields = {"scale": dict(moe_scale=1.0), "groups": dict(moe_groups=1, moe_groups_used=1),
              "rope_dims": dict(rope_dims=0)}.get(change, {})
    other = dataclasses.replace(w, tensors=t, config=dataclasses.replace(c, **fields))
    a, b = _last_logits(load(hf_dir, torch.float32, "cpu")), _last_logits(other)
    assert (a - b).abs().max().item() > 0.05, change


# GLM-4.5-Air's config.json as released (zai-org/GLM-4.5-Air), the fields the loader reads
AIR = dict(model_type="glm4_moe", hidden_size=4096, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
           partial_rotary_factor=0.5, rope_theta=1000000, rope_scaling=None, attention_bias=True,
           use_qk_norm=False, n_routed_experts=128, num_experts_per_tok=8, moe_intermediate_size=1408,
           n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=1.0,
           n_group=1, topk_group=1, num_hidden_layers=46, num_nextn_predict_layers=1,
           max_position_embeddings=131072, intermediate_size=10944)


def test_released_config_reads_as_transformers_does():
    got = hf_glm4moe(AIR, 128, "air")
    assert got["rope_dims"] == 64 and got["rope_theta"] == 1e6 and got["rope_factors"] == ()
    assert (got["n_experts"], got["n_experts_used"], got["ffn_dim"], got["dense_layers"]) == (128, 8, 1408, 1)
    assert (got["moe_scale"], got["moe_groups"], got["moe_groups_used"], got["moe_norm_topk"]) == (1.0, 1, 1, True)
    # the same from a GGUF's metadata as llama.cpp's converter writes it
    p = "glm4moe."
    meta = {p + "expert_feed_forward_length": 1408, p + "expert_count": 128, p + "expert_used_count": 8,
            p + "expert_shared_count": 1, p + "leading_dense_block_count": 1, p + "expert_weights_scale": 1.0,
            p + "expert_weights_norm": True, p + "expert_gating_func": 2, p + "nextn_predict_layers": 1}
    g = gguf_glm4moe(meta, p, "air.gguf")
    assert {k: g[k] for k in g} == {k: got[k] for k in g}
    with pytest.raises(ModelLoadError, match="softmax"):
        gguf_glm4moe({**meta, p + "expert_gating_func": 1}, p, "x")
    with pytest.raises(ModelLoadError, match="shared"):
        hf_glm4moe({**AIR, "n_shared_experts": 0}, 128, "x")


def test_gguf_mtp_layer_is_not_run(build):
    """The tiny GGUF holds an MTP layer after its three (block_count 4, nextn_predict_layers 1):
    three layers load, as from the HF dir, which has none."""
    _, m, hf_dir, gguf_path = build(NAME)
    g = load(gguf_path, torch.float32, "cpu")
    assert g.config.n_layers == m.config.num_hidden_layers == load(hf_dir, torch.float32, "cpu").config.n_layers
    assert not any(k.startswith(f"layers.{g.config.n_layers}.") for k in g.tensors)


@pytest.mark.parametrize("change", ["interleaved", "rope_dims", "post_norms", "bq"])
def test_glm4_parts_matter(build, monkeypatch, change):
    """GLM-4 0414: its RoPE's adjacent pairs (read as half-split pairs instead), its partial
    rotation (all dims instead), its sandwich norms and its q biases each move the logits."""
    _, _, hf_dir, _ = build("glm4")
    w = load(hf_dir, torch.float32, "cpu")
    assert w.config.rope_dims == 8 and w.config.arch == "glm4"
    a = _last_logits(load(hf_dir, torch.float32, "cpu"), "glm4")
    if change == "interleaved":
        monkeypatch.setitem(archs.ARCHS, "glm4", dataclasses.replace(archs.ARCHS["glm4"], interleaved_rope=False))
        other = load(hf_dir, torch.float32, "cpu")
    elif change == "rope_dims":
        other = dataclasses.replace(w, config=dataclasses.replace(w.config, rope_dims=0))
    else:
        suffix = {"post_norms": ("post_attn_norm", "post_ffn_norm"), "bq": ("bq",)}[change]
        other = dataclasses.replace(w, tensors={k: (torch.ones_like(v) if change == "post_norms" else torch.zeros_like(v))
                                                if k.endswith(suffix) else v for k, v in w.tensors.items()})
    assert (a - _last_logits(other, "glm4")).abs().max().item() > 0.05, change
