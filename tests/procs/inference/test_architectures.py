"""Each supported architecture against transformers (the reference): a tiny random-weight model
saved as a Hugging Face dir, and the same weights written as an F32 GGUF the way llama.cpp's
converter writes them, must load into ricordo's model and give transformers' logits.

Checked per architecture, in f32: the logits after every prompt token (max abs difference
below LOGIT_TOL), 64 greedy tokens through the KV session's decode path equal to transformers'
greedy tokens (step by step with its own KV cache), the GGUF loading to the HF dir's logits,
and one fingerprint for both files. Run with -s to see the measured differences.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from procs.inference.archs import ModelLoadError, gguf_rope, hf_rope, llama3_factors  # noqa: E402
from procs.inference.loader import fingerprint, load  # noqa: E402
from procs.inference import native  # noqa: E402
from procs.inference.model import Llama  # noqa: E402
from procs.inference.kvsession import KVSession  # noqa: E402
from common import kvfile as kf  # noqa: E402

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 320, 64, 128, 2, 4, 2, 16
PROMPT, GREEDY, MAX_POS = 40, 64, 128
# f32 logits are O(1-10) here; measured max abs differences are ~1e-6 (HF dir) and the GGUF
# matches the HF dir to ~1e-6 as well (its tensors are the same f32 values).
LOGIT_TOL = 1e-3

COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
              num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
              max_position_embeddings=MAX_POS, rms_norm_eps=1e-6, bos_token_id=None,
              eos_token_id=None, pad_token_id=None)
# original_max_position_embeddings=64 with theta 50000 and D=16 puts one frequency in each
# llama3 regime (kept, interpolated, divided), so the scaling matters at every position.
LLAMA3 = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# YaRN stretching 32 trained positions to MAX_POS: with theta 10000 and D=16 the ramp runs over
# dims 0..2, so one frequency is kept, one blended, six divided by 4, and positions 32+ (most
# of the prompt and all the greedy tokens) lie past the original context
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}

PHI_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "original_max_position_embeddings": 32,
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5], "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]}

# Ministral 3's YaRN and query scale (16384 trained positions and factor 16, scaled down): q
# times 1 + 0.1 ln(1 + floor(pos / 16)), so the prompt and the greedy tokens cross 6 steps of it
MINISTRAL3 = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 16,
              "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}

# gpt-oss's YaRN (factor 32 over 4096 positions, scaled down): truncate false ends the ramp
# at dim 1.41, not 2
GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 32}

CASES = {   # name: (transformers config class, its arguments, GGUF architecture)
    "llama": ("LlamaConfig", dict(rope_theta=10000.0, tie_word_embeddings=False), "llama"),
    "llama3": ("LlamaConfig", dict(rope_parameters=LLAMA3, tie_word_embeddings=True), "llama"),
    "mistral": ("MistralConfig", dict(rope_theta=1e6, sliding_window=None, tie_word_embeddings=False),
                "llama"),
    "qwen2": ("Qwen2Config", dict(rope_theta=1e6, tie_word_embeddings=True), "qwen2"),
    # head_dim 32 != hidden/heads: q/k/v/o shapes must come from head_dim
    "qwen3": ("Qwen3Config", dict(rope_theta=1e6, tie_word_embeddings=False, head_dim=32), "qwen3"),
    # a window of 8 over a 40-token prompt, five sliding layers and a global one (pattern 6), two RoPE
    # bases, (1 + w) norms, GeGLU, scaled embeddings; query_pre_attn_scalar as llama.cpp assumes it
    # Qwen3 attention, four SiLU experts per layer, two chosen per token and renormalized
    "qwen3moe": ("Qwen3MoeConfig", dict(num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=48, norm_topk_prob=True, rope_theta=1e6,
                                        tie_word_embeddings=False), "qwen3moe"),
    "yarn": ("Qwen2Config", dict(rope_parameters=YARN, tie_word_embeddings=True), "qwen2"),
    # fused qkv and gate_up, every layer over a sliding window of 8
    "phi3": ("Phi3Config", dict(rope_theta=10000.0, sliding_window=8, tie_word_embeddings=False), "phi3"),
    # Phi-4 mini's RoPE: 12 of 16 dims rotate, LongRoPE trained at 32 positions (the prompt is
    # longer: transformers and a context of MAX_POS both take the long factors) with its
    # attention factor (sqrt(1 + ln 4 / ln 32))
    "phi4mini": ("Phi3Config", dict(rope_parameters=PHI_LONGROPE, original_max_position_embeddings=32,
                                    tie_word_embeddings=True), "phi3"),
    # biases everywhere, a sink logit per head, every other layer over a window of 8, YaRN
    # unrounded (truncate false), four experts with biases, two chosen, clamped SwiGLU
    # (_hf_model widens the gates so that the clamps bite)
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64,
                                     sliding_window=8, rope_parameters=GPT_OSS_YARN, tie_word_embeddings=False),
                "gpt-oss"),
    # GLM-4.5: half of each head rotates, q/k/v biases and q/k norms (GLM-4.5 355B's), layer 0
    # dense, then eight experts chosen by sigmoid score plus bias within the better of two
    # groups, renormalized, times 2.5, beside a shared expert
    "glm4moe": ("Glm4MoeConfig", dict(num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2,
                                      moe_intermediate_size=64, first_k_dense_replace=1, n_shared_experts=1,
                                      routed_scaling_factor=2.5, n_group=2, topk_group=1, norm_topk_prob=True,
                                      attention_bias=True, use_qk_norm=True, tie_word_embeddings=False,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                       "partial_rotary_factor": 0.5}),
                "glm4moe"),
    # GLM-4 0414: sandwich norms, q/k/v biases, fused gate_up, half of each head rotating in
    # adjacent pairs
    "glm4": ("Glm4Config", dict(attention_bias=True, tie_word_embeddings=False,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                 "partial_rotary_factor": 0.5}), "glm4"),
    # Seed-OSS: Llama with q/k/v biases (no output bias, as released)
    "seed_oss": ("SeedOssConfig", dict(attention_bias=True, attention_out_bias=False, rope_theta=1e7,
                                       tie_word_embeddings=False), "seed_oss"),
    # SmolLM3: layer 3 of 4 without RoPE
    "smollm3": ("SmolLM3Config", dict(num_hidden_layers=4, rope_theta=1e6, tie_word_embeddings=True), "smollm3"),
    # Ministral 3 / Devstral Small 2: Llama with YaRN and the query scale
    "ministral3": ("Ministral3Config", dict(rope_parameters=MINISTRAL3, tie_word_embeddings=False), "mistral3"),
    "gemma3": ("Gemma3TextConfig", dict(num_hidden_layers=6, sliding_window=8,
                                        query_pre_attn_scalar=HEAD_DIM, tie_word_embeddings=True,
                                        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                         "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 10000.0}}),
               "gemma3"),
}

# their experts decode with torch's ops (the native decoder declines a mixture of experts)
MOE = ("qwen3moe", "gpt_oss", "glm4moe")


def _hf_model(name: str):
    cls, extra, _ = CASES[name]
    cfg = getattr(transformers, cls)(**{**COMMON, **extra})
    cfg._attn_implementation = "eager"
    torch.manual_seed(sum(map(ord, name)))
    m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():   # transformers zeroes biases and sets norms to 1: randomize all
        for pname, p in m.named_parameters():
            if "norm" in pname:   # Gemma scales by (1 + w): 0.3 * randn keeps it near 1 too
                p.copy_((0 if name == "gemma3" else 1) + 0.3 * torch.randn_like(p))
            elif pname.endswith("gate_up_proj"):   # gpt-oss: gates and ups past its clamps (+-7)
                p.normal_(0.0, 0.6)
            elif pname.endswith("sinks"):          # sinks that take a real share of the softmax
                p.normal_(1.0, 1.0)
            else:
                p.normal_(0.0, 0.15)
        for bname, b in m.named_buffers():
            if bname.endswith("e_score_correction_bias"):   # GLM: biases that change the choice
                b.normal_(0.0, 0.2)
    return m


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf LlamaModel.permute (Q and K rows, Llama family)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llamacpp_rope_freqs(rp: dict, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf's Llama 3.1 rope_freqs, computed as it does (f32 frequencies)."""
    base = rp["rope_theta"]
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
    old = rp["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _write_gguf(m, path: str, arch: str, qtype=None, experts_qtype=None) -> None:
    """As llama.cpp's converter writes it; `qtype` (a GGMLQuantizationType the gguf package
    can quantize) stores every 2-D weight quantized, norms and biases in F32;
    `experts_qtype` the stacked experts' weights."""
    c = m.config
    head_dim = c.head_dim
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(c.num_hidden_layers + (arch == "glm4moe"))     # GLM's MTP layer counts
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rp = c.rope_parameters
    rp = rp.get("full_attention", rp)
    rot = int(head_dim * rp.get("partial_rotary_factor", 1.0))
    w.add_rope_dimension_count(rot)
    if rp.get("rope_type") == "longrope":   # what convert_hf_to_gguf writes for Phi-3's LongRoPE
        orig = rp["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(orig)
        scale = c.max_position_embeddings / orig
        w.add_rope_scaling_attn_factors(1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(orig)))
        w.add_tensor("rope_factors_long.weight", np.array(rp["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rp["short_factor"], dtype=np.float32))
    w.add_rope_freq_base(float(rp["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    gemma = arch == "gemma3"
    if gemma or (arch == "phi3" and getattr(c, "sliding_window", None)):   # what llama.cpp's converter writes (Gemma:
        w.add_sliding_window(c.sliding_window)            # it reads the pattern (6) and local base itself)
    if rp.get("rope_type") == "yarn":   # what convert_hf_to_gguf writes for a yarn config
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
        for key, add in (("attention_factor", w.add_rope_scaling_yarn_attn_factor),
                         ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
            if rp.get(key) is not None:
                add(rp[key])
    if arch == "mistral3":   # the converter's Ministral3Model
        w.add_rope_scaling_yarn_log_mul(rp["mscale_all_dim"])
        w.add_attn_temperature_scale(rp["llama_4_scaling_beta"])
    state = m.state_dict()
    if arch == "gpt-oss":   # as the converter's GptOssModel: gate and up apart, [E, rows, cols]
        w.add_expert_count(c.num_local_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.intermediate_size)
        w.add_sliding_window(c.sliding_window)
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            gu, b = state.pop(p + "mlp.experts.gate_up_proj"), state.pop(p + "mlp.experts.gate_up_proj_bias")
            state[p + "mlp.experts.gate_proj.weight"] = gu[:, :, 0::2].transpose(1, 2)
            state[p + "mlp.experts.up_proj.weight"] = gu[:, :, 1::2].transpose(1, 2)
            state[p + "mlp.experts.down_proj.weight"] = state.pop(p + "mlp.experts.down_proj").transpose(1, 2)
            state[p + "mlp.experts.gate_proj.bias"], state[p + "mlp.experts.up_proj.bias"] = b[:, 0::2], b[:, 1::2]
            state[p + "mlp.experts.down_proj.bias"] = state.pop(p + "mlp.experts.down_proj_bias")
            state[p + "self_attn.sinks.weight"] = state.pop(p + "self_attn.sinks")
    if arch == "glm4moe":    # the converter's Glm4MoeModel (the groups: as for DeepSeek's)
        w.add_expert_shared_count(c.n_shared_experts)
        w.add_leading_dense_block_count(c.first_k_dense_replace)
        w.add_expert_weights_scale(c.routed_scaling_factor)
        w.add_expert_weights_norm(c.norm_topk_prob)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_group_count(c.n_group)
        w.add_expert_group_used_count(c.topk_group)
        w.add_nextn_predict_layers(1)
        for i in range(c.first_k_dense_replace, c.num_hidden_layers):
            p = f"model.layers.{i}.mlp."
            state[p + "gate.e_score_correction.bias"] = state.pop(p + "gate.e_score_correction_bias")
        # an MTP layer after the others (block_count counts it), which llama.cpp does not run
        last = f"model.layers.{c.num_hidden_layers - 1}."
        state.update({k.replace(last, f"model.layers.{c.num_hidden_layers}."): v.clone()
                      for k, v in list(state.items()) if k.startswith(last)})
        state[f"model.layers.{c.num_hidden_layers}.eh_proj.weight"] = torch.randn(c.hidden_size, 2 * c.hidden_size)
    if arch in ("qwen3moe", "glm4moe"):   # the converter's stacked experts: [E, rows, cols], gate and up apart
        n = c.num_experts if arch == "qwen3moe" else c.n_routed_experts
        w.add_expert_count(n)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        for i in range(getattr(c, "first_k_dense_replace", 0), c.num_hidden_layers + (arch == "glm4moe")):
            p = f"model.layers.{i}.mlp.experts."
            state[p + "gate_proj.weight"], state[p + "up_proj.weight"] = state.pop(p + "gate_up_proj").chunk(2, dim=1)
            state[p + "down_proj.weight"] = state.pop(p + "down_proj")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[{"glm4moe": "GLM4_MOE"}.get(arch, arch.upper().replace("-", "_"))],
                                     c.num_hidden_layers + 1)
    if rp.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llamacpp_rope_freqs(rp, head_dim))
    for hf_name, t in state.items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        a = t.numpy().astype(np.float32)
        if gemma and hf_name.endswith("norm.weight"):   # the converter folds Gemma's (1 + w)
            a = a + 1
        if arch in ("llama", "smollm3", "mistral3") and ("q_proj" in hf_name or "k_proj" in hf_name):   # LlamaModel's permute
            a = _permute(a, c.num_attention_heads if "q_proj" in hf_name else c.num_key_value_heads)
        gname = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        # weights only: llama.cpp's quantizer keeps biases (gpt-oss's experts' are 2-D) in F32
        q = None if not gname.endswith(".weight") else experts_qtype if a.ndim == 3 else qtype if a.ndim == 2 else None
        if q is not None:
            w.add_tensor(gname, gguf.quants.quantize(np.ascontiguousarray(a), q), raw_dtype=q)
        else:
            w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """build(name) -> (name, transformers model, HF dir path, GGUF path), made once."""
    made = {}

    def get(name: str):
        if name not in made:
            m = _hf_model(name)
            d = tmp_path_factory.mktemp(name)
            m.save_pretrained(d / "hf")
            _write_gguf(m, str(d / "tiny.gguf"), CASES[name][2])
            made[name] = name, m, str(d / "hf"), str(d / "tiny.gguf")
        return made[name]
    return get


@pytest.fixture(scope="module", params=list(CASES))
def case(request, build):
    return build(request.param)


def _prompt(name: str) -> list[int]:
    g = torch.Generator().manual_seed(len(name))
    return torch.randint(0, VOCAB, (PROMPT,), generator=g).tolist()


_REFERENCES = {}


def _reference(m, ids: list[int]):
    """_transformers' answer, computed once per model and prompt."""
    key = (id(m), tuple(ids))
    if key not in _REFERENCES:
        _REFERENCES[key] = _transformers(m, ids)
    return _REFERENCES[key]


@torch.inference_mode()
def _transformers(m, ids: list[int]):
    """transformers: logits after every prompt token, then GREEDY greedy tokens, each the
    argmax of a full forward over the sequence so far (no cache API to track across versions)."""
    logits = m(torch.tensor([ids]), use_cache=False).logits[0].float()
    seq, toks = list(ids), []
    nxt = int(logits[-1].argmax())
    for _ in range(GREEDY):
        toks.append(nxt)
        seq.append(nxt)
        nxt = int(m(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax())
    return logits, toks


def _ours(path: str, ids: list[int], kernels: str = "native"):
    """Prefill, then greedy decode with the server's native decode (native.Decoder; torch's
    path for a model it does not take, as qwen3moe) or with torch's ops only."""
    model = Llama(load(path, torch.float32, "cpu"), MAX_POS, kernels=native.load() if kernels == "native" else None)
    s = KVSession(model, MAX_POS, 16)        # chunks of 16: the prompt crosses two boundaries
    got = s.prefill(ids, logits_at=range(1, len(ids) + 1))
    logits = torch.stack([got[n] for n in range(1, len(ids) + 1)])
    toks = []
    for _ in range(GREEDY):
        toks.append(int(s.logits.argmax()))
        s.decode(toks[-1])
    return model, logits, toks


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_parity_with_transformers(case, kernels):
    name, m, hf_dir, gguf_path = case
    ids = _prompt(name)
    ref_logits, ref_toks = _reference(m, ids)
    model, logits, toks = _ours(hf_dir, ids, kernels)
    gmodel, glogits, gtoks = _ours(gguf_path, ids, kernels)
    assert (model.decoder is not None) == (kernels == "native" and name not in MOE)
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


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "qwen3moe", "gemma3", "gpt_oss", "glm4moe", "glm4", "ministral3"])
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
