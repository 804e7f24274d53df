"""Each supported architecture against transformers (the reference): a tiny random-weight model
saved as a Hugging Face dir, and the same weights written as an F32 GGUF the way llama.cpp's
converter writes them, must load into ricordo's model and give transformers' logits.

Checked per architecture, in f32: the logits after every prompt token (max abs difference
below LOGIT_TOL), 64 greedy tokens through the KV session's decode path equal to transformers'
greedy tokens (step by step with its own KV cache), the GGUF loading to the HF dir's logits,
and one fingerprint for both files. Run with -s to see the measured differences. The tiny
models, their files and the references: tiny_models.py.
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from procs.inference.archs import ModelLoadError, hf_rope, llama3_factors  # noqa: E402
from procs.inference.loader import load  # noqa: E402
from procs.inference.weights import fingerprint  # noqa: E402
from procs.inference import native  # noqa: E402
from procs.inference.model import Llama  # noqa: E402
from procs.inference.kvsession import KVSession  # noqa: E402
from common import kvfile as kf  # noqa: E402
from tests.procs.inference.tiny_models import (LLAMA3, LOGIT_TOL, MAX_POS, PHI_LONGROPE, PROMPT,  # noqa: E402,F401
                                               VOCAB, _llamacpp_rope_freqs, _ours, _prompt, _reference,
                                               build, case)


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_parity_with_transformers(case, kernels):
    name, m, hf_dir, gguf_path = case
    ids = _prompt(name)
    ref_logits, ref_toks = _reference(m, ids)
    model, logits, toks = _ours(hf_dir, ids, kernels)
    gmodel, glogits, gtoks = _ours(gguf_path, ids, kernels)
    assert (model.decoder is not None) == (kernels == "native")    # every architecture's whole step
    d_hf = (logits - ref_logits).abs().max().item()
    d_gguf = (glogits - logits).abs().max().item()
    print(f"\n[{name}] |logits| max {ref_logits.abs().max().item():.3g}; HF dir vs transformers "
          f"{d_hf:.3g}, GGUF vs HF dir {d_gguf:.3g} (tolerance {LOGIT_TOL:g})")
    assert d_hf < LOGIT_TOL and d_gguf < LOGIT_TOL
    assert toks == ref_toks
    assert gtoks == ref_toks
    assert len(set(ref_toks)) > 3, "a degenerate continuation would test little"
    # one config whichever file: GGUF stores eps and the rope divisors in f32
    same = dict(quant_bits=16, norm_eps=model.cfg.norm_eps, rope_factors=model.cfg.rope_factors,
                rope_attn_factor=model.cfg.rope_attn_factor)
    assert gmodel.cfg.rope_attn_factor == pytest.approx(model.cfg.rope_attn_factor, rel=1e-6)
    assert model.cfg == dataclasses.replace(gmodel.cfg, **same)
    np.testing.assert_allclose(gmodel.cfg.rope_factors, model.cfg.rope_factors, rtol=1e-6)
    assert model.fingerprint == gmodel.fingerprint   # one model, whichever file it came from


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "qwen3moe", "gemma3", "gpt_oss", "glm4moe", "glm4", "ministral3",
                                  "glm4_moe_lite", "deepseek_v2"])
def test_exact_mode_holds_with_biases_and_qk_norms(build, name):
    """Exact mode's promise (bit-identical prefill rows however a prompt is split between a
    restored prefix and the prefill) holds with the row-wise ops these architectures add."""
    _, _, hf_dir, _ = build(name)
    model = Llama(load(hf_dir, torch.float32, "cpu"), MAX_POS)
    ids = _prompt(name)
    whole = KVSession(model, MAX_POS, 16, exact=True)
    want = whole.prefill(ids, logits_at=range(17, PROMPT + 1))
    resumed = KVSession(model, MAX_POS, 16, exact=True)
    toks, k, v = whole.export(16)
    resumed.import_(toks, None, k, v)
    got = resumed.prefill(ids[16:], logits_at=range(17, PROMPT + 1))
    for n in range(17, PROMPT + 1):
        assert torch.equal(got[n], want[n]), n


def test_llama3_scaling_matters(build):
    """Loading llama3 without its scaling would give other logits (the test can fail)."""
    name, m, hf_dir, _ = build("llama3")
    w = load(hf_dir, torch.float32, "cpu")
    assert w.config.rope_theta == 50000.0 and len(set(w.config.rope_factors)) == 3
    plain = Llama(dataclasses.replace(w, config=dataclasses.replace(w.config, rope_factors=())), MAX_POS)
    scaled = Llama(load(hf_dir, torch.float32, "cpu"), MAX_POS)
    ids = torch.tensor(_prompt(name))
    a, b = (KVSession(x, MAX_POS, 64).prefill(ids.tolist(), logits_at=[PROMPT])[PROMPT]
            for x in (plain, scaled))
    assert (a - b).abs().max().item() > 0.05


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_ministral3_query_scale_matters_past_its_floor_only(build, kernels):
    """Without its query scale Ministral 3 gives other logits past the 16 trained positions
    and the same ones before them (the scale is exactly 1 there), prefill and decode alike;
    llama.cpp's GGUF keys read to the config's values."""
    name, _, hf_dir, gguf_path = build("ministral3")
    w = load(gguf_path, torch.float32, "cpu")
    assert (w.config.q_scale_beta, w.config.q_scale_floor) == (pytest.approx(0.1), 16)
    assert w.config.rope_attn_factor == 1.0           # mscale == mscale_all_dim
    kern = native.load() if kernels == "native" else None
    off = dataclasses.replace(w, config=dataclasses.replace(w.config, q_scale_beta=0.0, q_scale_floor=0))
    ids = _prompt(name)
    runs = []
    for weights in (load(hf_dir, torch.float32, "cpu"), off):
        model = Llama(weights, MAX_POS, kernels=kern)
        assert (model.decoder is not None) == (kernels == "native")
        s = KVSession(model, MAX_POS, 64)
        got = s.prefill(ids[:12], logits_at=[12])[12]
        for t in ids[12:PROMPT]:                      # decoded one by one, across the floor
            s.decode(t)
        runs.append((got, s.logits.clone()))
    (early, late), (early_off, late_off) = runs
    assert torch.equal(early, early_off)
    assert (late - late_off).abs().max().item() > 0.05


@pytest.mark.parametrize("change", [dict(windows=()), dict(rope_theta_local=0.0), dict(attn_scale=0.1),
                                    dict(embed_scale=0.0), dict(act="silu")])
def test_gemma3_parts_matter(build, change):
    """Each Gemma 3 setting changes the logits (the parity test would catch it missing); the
    window matters because the 40-token prompt is 5 windows long."""
    name, m, hf_dir, _ = build("gemma3")
    w = load(hf_dir, torch.float32, "cpu")
    assert w.config.windows == (8, 8, 8, 8, 8, 0) and w.config.rope_theta_local == 10000.0
    ids = _prompt(name)
    a, b = (KVSession(Llama(x, MAX_POS), MAX_POS, 64).prefill(ids, logits_at=[PROMPT])[PROMPT]
            for x in (load(hf_dir, torch.float32, "cpu"),
                      dataclasses.replace(w, config=dataclasses.replace(w.config, **change))))
    assert (a - b).abs().max().item() > 0.05


def test_gemma3_config_layouts():
    """transformers 5's per-layer-type rope_parameters and the older flat config read alike;
    query_pre_attn_scalar sets the attention scale (the 27B's is not head_dim)."""
    from procs.inference.archs import hf_gemma3
    base = dict(num_hidden_layers=12, hidden_size=5376, sliding_window=1024, query_pre_attn_scalar=168)
    new = {**base, "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    old = {**base, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    a, b = hf_gemma3(new, 128, "x"), hf_gemma3(old, 128, "x")
    assert a == b
    assert a["rope_factors"] == (8.0,) * 64 and a["rope_theta"] == 1e6 and a["rope_theta_local"] == 1e4
    assert a["windows"] == (1024,) * 5 + (0,) + (1024,) * 5 + (0,)
    assert a["attn_scale"] == 168 ** -0.5 and a["embed_scale"] == 5376 ** 0.5
    with pytest.raises(ModelLoadError, match="sliding-window layers"):
        hf_gemma3({**new, "rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}}, 128, "x")


# ------------------------------------------------------------------ config reading and fingerprint

def test_rope_base_from_either_config_layout():
    """transformers 5 saves rope_parameters; older configs keep a top-level rope_theta and an
    optional rope_scaling. Both give the same base and divisors."""
    new = {"rope_parameters": {**LLAMA3}, "max_position_embeddings": 128}
    old = {"rope_theta": 50000.0, "max_position_embeddings": 128,
           "rope_scaling": {k: v for k, v in LLAMA3.items() if k != "rope_theta"}}
    assert hf_rope(new, 16, "x") == hf_rope(old, 16, "x")
    assert hf_rope({"rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}, 16, "x") == (5e5, (), 1.0)
    assert hf_rope({"rope_theta": 5e5, "rope_scaling": None}, 16, "x") == (5e5, (), 1.0)
    assert hf_rope({}, 16, "x") == (10000.0, (), 1.0)
    theta, f, _ = hf_rope(new, 16, "x")
    assert f == llama3_factors(50000.0, 16, 8.0, 1.0, 4.0, 64)
    np.testing.assert_allclose(f, _llamacpp_rope_freqs(LLAMA3, 16), rtol=1e-6)
    for bad in ({"rope_type": "dynamic", "factor": 2.0}, {"rope_type": "longrope", "factor": 2.0}):
        with pytest.raises(ModelLoadError):
            hf_rope({"rope_parameters": bad}, 16, "x")


def test_fingerprint_names_architecture_and_rope_scaling(build):
    name, _, hf_dir, _ = build("llama")
    w = load(hf_dir, torch.float32, "cpu")
    norms = {k: v for k, v in w.tensors.items() if k.endswith("norm")}
    fp = fingerprint(w.config, norms)
    assert fp == w.fingerprint
    others = {fingerprint(dataclasses.replace(w.config, **kw), norms) for kw in (
        dict(arch="qwen2"), dict(arch="qwen3"), dict(rope_factors=(1.0,) * 7 + (8.0,)),
        dict(rope_factors=(2.0,) * 8), dict(rope_theta=20000.0), dict(q_scale_beta=0.1, q_scale_floor=16))}
    assert fp not in others and len(others) == 6
    # what stays out: quantization and context; eps is hashed at GGUF's f32 precision
    assert fingerprint(dataclasses.replace(w.config, quant_bits=4, max_context=64), norms) == fp
    assert fingerprint(dataclasses.replace(w.config, norm_eps=float(np.float32(1e-6))), norms) == fp


def _linked_dir(hf_dir: str, tmp_path) -> tuple:
    """(a dir linking an HF dir's files but its config.json, that config) to load patched."""
    d = tmp_path / "linked"
    d.mkdir()
    for f in os.listdir(hf_dir):
        if f != "config.json":
            os.symlink(os.path.join(hf_dir, f), d / f)
    with open(os.path.join(hf_dir, "config.json")) as f:
        return d, json.load(f)


def test_unsupported_layouts_are_load_errors(build, tmp_path):
    """Tensors that change the math but that the architecture would not read, and attention
    the model does not run, fail the load instead of loading a different model."""
    d, c = _linked_dir(build("qwen2")[2], tmp_path)
    for patch in ({"model_type": "llama"},                    # q/k/v biases a llama would drop
                  {"use_sliding_window": True},
                  {"model_type": "gemma"}):
        (d / "config.json").write_text(json.dumps({**c, **patch}))
        with pytest.raises(ModelLoadError):
            load(str(d), torch.float32, "cpu")
    (d / "config.json").write_text(json.dumps({k: v for k, v in c.items() if k != "num_attention_heads"}))
    with pytest.raises(ModelLoadError, match="config.json has no num_attention_heads"):
        load(str(d), torch.float32, "cpu")


def _multimodal(name: str, m, d) -> str:
    """A multimodal checkpoint (transformers' ConditionalGeneration class, a tiny vision tower)
    whose language model is m's weights, saved under d; its config.json's text_config keeps
    only the keys that differ from the text config class's defaults, as Gemma 3 4B's does."""
    vision = (transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=2, image_size=32, patch_size=16)
              if name == "gemma3" else
              transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, image_size=32, patch_size=16, head_dim=16))
    cls = transformers.Gemma3ForConditionalGeneration if name == "gemma3" else transformers.Mistral3ForConditionalGeneration
    cfg = (transformers.Gemma3Config(text_config=m.config, vision_config=vision, mm_tokens_per_image=4)
           if name == "gemma3" else transformers.Mistral3Config(text_config=m.config, vision_config=vision,
                                                                image_token_index=VOCAB - 1,
                                                                tie_word_embeddings=m.config.tie_word_embeddings))
    mm = cls(cfg).eval()
    with torch.no_grad():
        mm.model.language_model.load_state_dict(m.model.state_dict())
        mm.lm_head.weight.copy_(m.lm_head.weight)
    mm.save_pretrained(d)
    c = json.loads((d / "config.json").read_text())
    defaults = type(m.config)().to_dict()
    c["text_config"] = {k: v for k, v in c["text_config"].items() if k == "model_type" or v != defaults.get(k)}
    (d / "config.json").write_text(json.dumps(c))
    return str(d)


@pytest.mark.parametrize("name", ["gemma3", "ministral3"])
def test_multimodal_checkpoint_loads_its_language_model(build, tmp_path, name):
    """Gemma 3 4B+, Mistral Small 3.1+ and Ministral 3 come as image-text checkpoints: their
    language model loads (text_config, with transformers' defaults for what it leaves out;
    tensors under language_model.), to the text model's config, fingerprint and logits."""
    _, m, hf_dir, _ = build(name)
    mm_dir = _multimodal(name, m, tmp_path / "mm")
    c = json.loads(open(f"{mm_dir}/config.json").read())
    assert "rms_norm_eps" not in c["text_config"] or name != "gemma3"       # left to the default
    text, mm = load(hf_dir, torch.float32, "cpu"), load(mm_dir, torch.float32, "cpu")
    assert mm.config == text.config and mm.fingerprint == text.fingerprint
    ids = _prompt(name)
    a, b = (KVSession(Llama(w, MAX_POS), MAX_POS, 64).prefill(ids, logits_at=[PROMPT])[PROMPT]
            for w in (load(hf_dir, torch.float32, "cpu"), mm))
    assert torch.equal(a, b)
    assert (a - _reference(m, ids)[0][-1]).abs().max().item() < LOGIT_TOL


def test_gemma3_defaults_are_transformers(build):
    """The defaults a Gemma 3 text_config leaves out are Gemma3TextConfig's."""
    from procs.inference.arch_configs import HF_DEFAULTS
    d = transformers.Gemma3TextConfig().to_dict()
    assert HF_DEFAULTS["gemma3_text"] == {k: d[k] for k in HF_DEFAULTS["gemma3_text"]}


def test_longrope_takes_the_short_factors_in_a_trained_length_context(build):
    """A context within the trained 32 positions takes the short factors, as transformers
    does for a sequence that short; the two choices are different models to the cache
    (fingerprints)."""
    name, m, hf_dir, gguf_path = build("phi4mini")
    ids = _prompt(name)[:30]
    with torch.no_grad():
        want = m(torch.tensor([ids]), use_cache=False).logits[0].float()
    for path in (hf_dir, gguf_path):
        w = load(path, torch.float32, "cpu")
        short = Llama(w, 32, kernels=native.load())
        s = KVSession(short, 32, 16)
        got = s.prefill(ids, logits_at=range(1, len(ids) + 1))
        diff = (torch.stack([got[n] for n in range(1, len(ids) + 1)]) - want).abs().max().item()
        assert diff < LOGIT_TOL, (path, diff)
        assert short.fingerprint != Llama(load(path, torch.float32, "cpu"), MAX_POS).fingerprint


def test_phi3_rope_layouts_not_supported_are_load_errors(build, tmp_path):
    """LongRoPE factors whose count is not half the rotated dims, and another scaling, fail
    the load."""
    d, c = _linked_dir(build("phi4mini")[2], tmp_path)
    for rp, says in (({**PHI_LONGROPE, "short_factor": [1.0] * 8}, "LongRoPE factors"),
                     ({**PHI_LONGROPE, "rope_type": "yarn", "factor": 4.0}, "unsupported RoPE scaling")):
        (d / "config.json").write_text(json.dumps({**c, "rope_parameters": rp}))
        with pytest.raises(ModelLoadError, match=says):
            load(str(d), torch.float32, "cpu")


# ------------------------------------------------------------------ checkpoints per architecture

def _saved(path: str, tmp_path, text_model):
    """A model of the GGUF, a Disk over tmp_path/kv and a session of the prompt saved whole."""
    from tests.procs.inference.test_disk import Harness
    model = Llama(load(path, torch.float32, "cpu"), MAX_POS, kernels=native.load())
    h = Harness(model, text_model, tmp_path)
    s = KVSession(model, MAX_POS, 16)
    ids = _prompt(path)
    s.prefill(ids)
    assert h.disk.save(s, len(ids), s.logits, kf.SHUTDOWN)
    return model, h, s, h.saved[-1]


def test_checkpoint_round_trip(case, tmp_path, text_model):
    """save -> file -> restore into a fresh session: same logits, and 8 greedy steps on
    from it equal to the session that never left memory, bit for bit."""
    name, _, _, gguf_path = case
    model, h, live, sha = _saved(gguf_path, tmp_path, text_model)
    try:
        fresh = KVSession(model, MAX_POS, 16)
        assert h.disk.restore(fresh, sha) == len(live.tokens) and fresh.tokens == live.tokens
        assert torch.equal(fresh.logits, live.logits)
        for _ in range(8):
            t = int(live.logits.argmax())
            assert int(fresh.logits.argmax()) == t
            a, b = live.decode(t), fresh.decode(t)
            assert torch.equal(a, b), name
    finally:
        h.close()


@pytest.mark.parametrize("a,b", [("llama", "llama3"), ("llama", "qwen2"), ("qwen2", "yarn"), ("llama", "mistral"),
                                 ("yarn", "ministral3")])
def test_checkpoint_of_another_architecture_is_refused(build, tmp_path, text_model, a, b):
    """A sound file of one architecture or rope scaling never restores into another (same
    K/V geometry: only the fingerprint tells them apart)."""
    from procs.inference.disk import RestoreError
    from tests.procs.inference.test_disk import Harness
    _, _, _, path_a = build(a)
    _, _, _, path_b = build(b)
    _, ha, _, sha = _saved(path_a, tmp_path / "a", text_model)
    ha.close()
    other = Llama(load(path_b, torch.float32, "cpu"), MAX_POS, kernels=native.load())
    hb = Harness(other, text_model, tmp_path / "a")          # the same cache directory
    try:
        with pytest.raises(RestoreError) as e:
            hb.disk.restore(KVSession(other, MAX_POS, 16), sha)
        assert str(e.value) == "fingerprint mismatch"
    finally:
        hb.close()


def test_every_process_counts_the_same_kv_bytes(case):
    """The renderer sizes the context from the file's fields (common/models._trained), the
    inference process from the model it loaded; both must give one figure, that of the rows a
    session really keeps (in f32): else they size different contexts on a machine whose
    memory caps it (latent attention keeps one tensor of rows, a hybrid rows for its
    full-attention layers only, a multi-token prediction layer none). The recurrent state
    is not counted."""
    from common import models
    name, _, hf_dir, gguf_path = case
    for path in (hf_dir, gguf_path):
        c = load(path, torch.float32, "cpu").config
        s = KVSession(Llama(load(path, torch.float32, "cpu"), MAX_POS), MAX_POS, 16)
        s.reserve(16)
        rows = (s.nbytes - (0 if s.state is None else s.state.nbytes * (1 + len(s.marks)))) // s.k.shape[2]
        want = models.trained_of(c.max_context, c.kv_layers, c.n_kv_heads, c.head_dim, c.kv_tensors)
        assert models._trained(path)[1] == want[1] == rows, (name, path)
