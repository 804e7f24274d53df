"""Gated DeltaNet (procs/inference/gdn.py; Qwen3-Next and Qwen3.5, GGUFs qwen3next, qwen35 and
qwen35moe) beyond the parity and file-type tests of test_architectures.py and
test_quant_files.py, whose tiny models (qwen3_next, qwen3_5, qwen3_5_moe) and GGUFs, written
as llama.cpp's converter writes them, these reuse: the blocked prefill is the recurrence,
a prompt crossing blocks matches transformers, each part of the math matters, and a session
holds its state (K/V rows only for the attention layers).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from procs.inference import native
from procs.inference.gdn import BLOCK, delta_block, delta_step
from procs.inference.kvsession import MAX_MARKS, KVSession
from procs.inference.steps import decode_many
from procs.inference.loader import load
from procs.inference.model import Llama
from tests.procs.inference.tiny_models import (LOGIT_TOL, MAX_POS, VOCAB, _prompt, batched_steps, build,  # noqa: F401
                                               last_logits)


def _inputs(H=3, n=BLOCK, dk=8, dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(H, n, dk, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(H, n, dv, generator=g)
    decay = -torch.rand(H, n, generator=g) * 0.5            # log decays in (-0.5, 0]
    beta = torch.rand(H, n, generator=g)
    S = torch.randn(H, dk, dv, generator=g)
    return q, k, v, decay, beta, S


@pytest.mark.parametrize("n", [1, 7, BLOCK])
def test_a_block_is_the_recurrence(n):
    """The closed form over n tokens from a non-zero state gives the recurrence's outputs
    and final state (f32 rounding only)."""
    q, k, v, g, beta, S = _inputs(n=n)
    S1, S2 = S.clone(), S.clone()
    step = torch.stack([delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S1) for t in range(n)], dim=1)
    block = delta_block(q, k, v, g, beta, S2)
    assert (block - step).abs().max() < 1e-4
    assert (S2 - S1).abs().max() < 1e-4
    assert S1.abs().max() > 0.1                               # a state that carries something


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_a_prompt_across_blocks_matches_transformers(build, name):
    """A 150-token prompt prefilled in one call (blocks 0-64, 64-128, 128-150), and the same
    in chunks of 48 (blocks cut where chunks end), both match transformers' logits."""
    _, m, hf_dir, _ = build(name)
    ids = torch.randint(0, VOCAB, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        ref = m(torch.tensor([ids]), use_cache=False).logits[0].float()
    model = Llama(load(hf_dir, torch.float32, "cpu"), 256)
    for chunk in (256, 48):
        s = KVSession(model, 256, chunk)
        got = s.prefill(ids, logits_at=range(1, len(ids) + 1))
        ours = torch.stack([got[n] for n in range(1, len(ids) + 1)])
        assert (ours - ref).abs().max() < LOGIT_TOL, chunk


@pytest.mark.parametrize("change", ["tiled", "gate", "shared_gate", "conv", "decay"])
def test_each_part_matters(build, change):
    """Dropping or changing one part moves the last prompt token's logits far past the
    parity tolerance (10x at least): the value heads' order (grouped read as tiled), the attention's output
    gate, the shared expert's gate, the convolution's history, the decay."""
    name = "qwen3_5" if change in ("tiled", "conv", "decay") else "qwen3_next"
    _, _, hf_dir, _ = build(name)
    base = last_logits(load(hf_dir, torch.float32, "cpu"), name)
    w = load(hf_dir, torch.float32, "cpu")
    for i in range(w.config.n_layers):
        p = f"layers.{i}."
        if change == "gate" and p + "wg" in w.tensors:
            del w.tensors[p + "wg"]
        if change == "shared_gate" and p + "sh_gate" in w.tensors:
            del w.tensors[p + "sh_gate"]
        if change == "conv" and p + "ssm_conv" in w.tensors:   # the current token's weight only
            w.tensors[p + "ssm_conv"][:, :-1] = 0
        if change == "decay" and p + "ssm_a" in w.tensors:
            w.tensors[p + "ssm_a"] = torch.zeros_like(w.tensors[p + "ssm_a"])
    if change == "tiled":
        w.config = dataclasses.replace(w.config, ssm_tiled=False)
    diff = (last_logits(w, name) - base).abs().max().item()
    print(f"\n[{change}] max logit change {diff:.3g}")
    assert diff > 10 * LOGIT_TOL


def test_the_session_holds_a_state_and_attention_rows_only(build):
    """K/V rows for the one attention layer of four; a recurrent state for the others. The
    state is not rewound: the session can be cut to 0, to its length or to a mark (a copy of
    the state kept where a prefill was asked to), and there it holds what a session of that
    prefix alone holds; between marks, rewind() prefills from the mark below."""
    _, _, _, gguf_path = build("qwen3_next")
    model = Llama(load(gguf_path, torch.float32, "cpu"), MAX_POS)
    c = model.cfg
    assert c.linear_layers == (True, True, True, False) and c.kv_layers == 1
    s = KVSession(model, MAX_POS, 16)
    ids = _prompt("qwen3_next")
    n = len(ids)
    s.prefill(ids, marks=[24])
    assert s.k.shape[0] == 1 and s.state.ssm.shape == (3, c.ssm_v_heads, c.ssm_k_dim, c.ssm_v_dim)
    assert s.state.ssm.abs().max() > 0 and s.state.conv.abs().max() > 0
    assert s.kept_marks == (24,) and s.keep_from == 0
    assert [s.can_keep(k) for k in (0, 23, 24, 25, n)] == [True, False, True, False, True]
    assert s.can_export(24) and s.can_export(n) and not s.can_export(30)
    with pytest.raises(ValueError, match="recurrent state"):
        s.truncate(30)
    copy = KVSession(model, MAX_POS, 16)
    copy.copy_prefix(s, n)
    assert torch.equal(s.decode(5), copy.decode(5))
    s.truncate(24)                  # the mark's state: as a session of those 24 tokens alone
    alone = KVSession(model, MAX_POS, 16)
    alone.prefill(ids[:24])
    assert torch.equal(s.state.ssm, alone.state.ssm) and torch.equal(s.state.conv, alone.state.conv)
    assert torch.equal(s.prefill(ids[24:], logits_at=[n])[n], alone.prefill(ids[24:], logits_at=[n])[n])
    s.rewind(30)                    # from the mark at 24, 6 tokens again
    assert len(s) == 30 and (s.logits - KVSession(model, MAX_POS, 16).prefill(ids[:30], logits_at=[30])[30]
                             ).abs().max() < LOGIT_TOL
    for k in range(31, 31 + MAX_MARKS + 2):
        s.decode(ids[k % n])
        s.mark()
    assert len(s.marks) == MAX_MARKS and 24 not in s.marks
    s.truncate(0)
    assert not s.state.ssm.any() and not s.state.conv.any() and not s.marks


def test_deterministic_mode_is_refused(build):
    _, _, _, gguf_path = build("qwen3_5")
    model = Llama(load(gguf_path, torch.float32, "cpu"), MAX_POS)
    with pytest.raises(ValueError, match="deterministic"):
        KVSession(model, MAX_POS, 16, exact=True)


def test_batched_decode_equals_each_sequence_alone(build):
    """Three sessions at different lengths (each its own state) advance in one step of
    decode_many: each one's logits as it decodes alone, and their states stay their own."""
    _, _, _, gguf_path = build("qwen3_5_moe")
    model = Llama(load(gguf_path, torch.float32, "cpu"), MAX_POS)
    ids = _prompt("qwen3_5_moe")
    together = [KVSession(model, MAX_POS, 16) for _ in range(3)]
    alone = [KVSession(model, MAX_POS, 16) for _ in range(3)]
    for i, (a, b) in enumerate(zip(together, alone)):
        a.prefill(ids[:20 + 7 * i])
        b.prefill(ids[:20 + 7 * i])
    for step in range(4):
        toks = [int(s.logits.argmax()) for s in together]
        rows = decode_many(together, toks)
        for s, t, row in zip(alone, toks, rows):
            assert (s.decode(t) - row).abs().max() < 1e-4, step
    assert all(torch.allclose(a.state.ssm, b.state.ssm, atol=1e-5) for a, b in zip(together, alone))
    assert not torch.allclose(together[0].state.ssm, together[1].state.ssm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_the_native_steps_are_the_torch_step(build, name, dtype):
    """The kernels' decode paths against gdn.py's torch ops on the same model and weights:
    the DeltaNet step alone (kernels/gdn.c between torch's other ops, as a model the
    whole-step decoder declines runs it) and decode.c's whole step (Qwen3-Next's experts and
    gated shared expert in moe.c). Three sessions decode in one batched step, grouped (qwen3_next) and tiled (qwen3_5)
    value heads, f32 and bf16: logits, convolution inputs and states agree to rounding, the
    whole step's row of a sequence is the one it computes for that sequence alone, bit for
    bit, and the step reads what the session holds (a changed state changes the next logits)."""
    _, _, _, gguf_path = build(name)
    kernels = native.load()
    assert kernels is not None, "the native kernels did not build"
    models = {}
    for path in ("whole", "step", "torch"):
        model = models[path] = Llama(load(gguf_path, dtype, "cpu"), MAX_POS, kernels=kernels)
        assert all(ly.gdn.native is not None for ly in model.layers if ly.gdn)
        assert model.decoder is not None
        if path != "whole":
            model.decoder = None
        if path == "torch":
            for ly in model.layers:
                if ly.gdn:
                    ly.gdn.native = None
    ids = _prompt(name)
    # decode.c's rows do not depend on the batch
    runs = {path: batched_steps(model, ids, alone_equal=path == "whole") for path, model in models.items()}
    ref, s_t = runs.pop("torch")
    scale = ref.abs().max().item()
    for path, (ours, s_n) in runs.items():
        # in bf16 the whole step keeps f32 activations between ops where torch's path rounds
        # each one (measured 0.17-0.21 of |logits| ~4.6 here; gdn.c's step alone rounds as torch)
        tol = 1e-4 if dtype == torch.float32 else 0.1 if path == "whole" else 0.05
        print(f"\n[{name} {dtype} {path}] max logit diff {(ours - ref).abs().max().item():.3g} of {scale:.3g}")
        assert (ours - ref).abs().max() < tol * max(1.0, scale)
        for a, b in zip(s_n, s_t):
            assert (a.state.ssm - b.state.ssm).abs().max() < tol * max(1.0, b.state.ssm.abs().max().item())
            assert (a.state.conv.float() - b.state.conv.float()).abs().max() < \
                tol * max(1.0, b.state.conv.abs().max().item())
        before = s_n[0].decode(7)
        s_n[0].state.ssm.mul_(0.5)
        assert (s_n[0].decode(7) - before).abs().max() > 10 * tol


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_llama_cpp_reads_the_files_as_we_do(tmp_path, name):
    """The peer: llama.cpp (llama-cpp-python, the bench extra) runs the same GGUF, written as
    its converter writes one (qwen3next's split projections, qwen35's tiled value heads and
    mrope sections, the +1 norms, -exp(A_log)), with the default model's vocabulary, and its
    logits over a 150-token prompt agree with transformers' and ours."""
    llama_cpp = pytest.importorskip("llama_cpp")
    gguf = pytest.importorskip("gguf")
    from common.config import Settings
    from common.models import resolve
    from tests.procs.inference.tiny_models import CASES, _hf_model, _write_gguf
    default = resolve("", Settings().models_path())
    vocab = len(gguf.GGUFReader(default).fields["tokenizer.ggml.tokens"].data)
    m = _hf_model(name, vocab_size=vocab, max_position_embeddings=512)
    path = str(tmp_path / "tiny.gguf")
    _write_gguf(m, path, CASES[name][2], tokenizer_from=default)
    ids = torch.randint(0, vocab, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        ref = m(torch.tensor([ids]), use_cache=False).logits[0].float()
    s = KVSession(Llama(load(path, torch.float32, "cpu"), 512), 512, 512)
    got = s.prefill(ids, logits_at=range(1, len(ids) + 1))
    ours = torch.stack([got[n] for n in range(1, len(ids) + 1)])
    llm = llama_cpp.Llama(path, n_ctx=512, logits_all=True, verbose=False, n_threads=2)
    llm.eval(ids)
    peer = torch.tensor(llm.scores[:len(ids)])
    print(f"\n[{name}] |logits| max {ref.abs().max():.3g}: ours vs transformers {(ours - ref).abs().max():.3g}, "
          f"llama.cpp vs transformers {(peer - ref).abs().max():.3g}, ours vs llama.cpp {(ours - peer).abs().max():.3g}")
    assert (ours - ref).abs().max() < LOGIT_TOL
    assert (peer - ref).abs().max() < LOGIT_TOL and (ours - peer).abs().max() < LOGIT_TOL
