"""Quantized GGUF files against transformers: the tiny random models of test_architectures
(every architecture and rope scaling) written with every 2-D weight in one quant type (by the gguf package, as
llama.cpp's quantizer lays the blocks out), loaded by ricordo, compared with transformers
running the same weights dequantized by the gguf package (the file's exact values).

Types ricordo reads as stored (F16, BF16; Q8_0 and Q5_0 as int8 levels with the block's
scale; Q4_0, Q4_1 as int4 groups with their own levels) must be as close as the unquantized
model (f32 rounding only) and give the same greedy tokens through the native decode, except where the native kernels multiply int8 and int4 weights by
activations rounded to int8 per group of 32 (qdot.c, as llama.cpp does): there the logits
(the output projection is such a product) are within ACT_TOL, and the greedy tokens of these
random tiny models, whose logits lie close together, are not compared. Q5_1 is requantized to int8 groups of 32 (one more rounding, at most
half an int8 step of the group's range): its tolerance is a share of the file's own
quantization error. The K-quants, which the gguf package cannot write, are checked on the
real Gemma 3 file (test_gemma.py: Q4_K unpacked exactly, Q6_K/Q5_0 equal to the gguf
package's values). Run with -s to see the measured differences."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.procs.inference.tiny_models import CASES, GREEDY, MOE, _ours, _prompt, _transformers, _write_gguf

gguf = pytest.importorskip("gguf")
from gguf.constants import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

EXACT_TOL = 1e-3          # f32 rounding, as the unquantized parity
# types requantized for decode: their extra rounding against the file's own quantization error
# (how far the file's values move the logits from the unquantized model's), both as the largest
# logit difference: measured 0.11-0.29 over the architectures here; a wrong scale or min would
# be at least the quantization's own size. A mixture of experts (or a model whose linears are
# requantized ahead of its experts' router: every model on the CPU, now that the kernels pack
# the linears of those the whole-step decoder declines) flips a token's choice of experts on
# such small changes, and a flip moves its logits by a step: 0.47-0.86 of the file's own
# error measured here (qwen3moe, glm4moe, glm4_moe_lite, deepseek_v2, qwen3_next,
# qwen3_5_moe), so there the bound is that error itself
REQUANT_SHARE = 0.4
# int8 activations (Q8_0, Q4_0, Q4_1 in the native kernels): measured 0.028-0.041 over the
# architectures here, against 0.2-4.6 for the files' own quantization
ACT_TOL = 0.1
TYPES = [T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]
REQUANTIZED = {T.Q5_1}
INT8_ACTS = {T.Q8_0, T.Q4_0, T.Q4_1}

def _dequantized(m, qtype):
    """The transformers model with each 2-D weight replaced by the file's values. Rows are
    quantized independently, so the converter's Q/K row permutation commutes with this."""
    ref = copy.deepcopy(m)

    def file(a: torch.Tensor) -> torch.Tensor:
        x = a.detach().float().contiguous().numpy()
        return torch.from_numpy(dequantize(quantize(x, qtype), qtype).reshape(x.shape))
    with torch.no_grad():
        for name, p in ref.named_parameters():
            # as _write_gguf (gpt-oss's expert biases are 2-D)
            if p.ndim == 2 and "bias" not in name and "kv_b_proj" not in name:
                p.copy_(file(p))
            elif "kv_b_proj" in name:   # MLA's kv_b goes as its per-head parts, rows of nope and of r
                c = m.config
                kv = p.detach().view(c.num_attention_heads, -1, c.kv_lora_rank)
                k, v = kv[:, :c.qk_nope_head_dim].transpose(1, 2), kv[:, c.qk_nope_head_dim:]
                k = file(k) if k.shape[-1] % 32 == 0 else k
                v = file(v) if v.shape[-1] % 32 == 0 else v
                p.copy_(torch.cat([k.transpose(1, 2), v], dim=1).reshape(p.shape))
    return ref


@pytest.fixture(scope="module")
def models():
    from tests.procs.inference.tiny_models import _hf_model
    return {name: _hf_model(name) for name in CASES if name not in SAME_AS_LLAMA}


# architectures whose weights load as another's do (Llama's tensors, a bias, a rotary table or
# a query scale more): their parity test in test_architectures.py covers them, every file type
# here would repeat llama's
SAME_AS_LLAMA = {"seed_oss", "smollm3", "ministral3"}


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
@pytest.mark.parametrize("arch", [a for a in CASES if a not in SAME_AS_LLAMA])
def test_quantized_file_matches_its_dequantized_weights(models, tmp_path, arch, qtype):
    m = models[arch]
    path = str(tmp_path / f"{qtype.name}.gguf")
    _write_gguf(m, path, CASES[arch][2], qtype)
    ids = _prompt(arch)
    ref_logits, ref_toks = _transformers(_dequantized(m, qtype), ids)
    model, logits, toks = _ours(path, ids)
    assert model.decoder is not None   # the native decode ran
    d = (logits - ref_logits).abs().max().item()
    plain = m(torch.tensor([ids]), use_cache=False).logits[0].float().detach()
    d_quant = (plain - ref_logits).abs().max().item()     # what the file's quantization itself moves
    int8_acts = qtype in INT8_ACTS and model.kernels is not None   # the kernels pack (every model on the CPU)
    share = 1.0 if arch in MOE else REQUANT_SHARE
    tol = share * d_quant if qtype in REQUANTIZED else ACT_TOL if int8_acts else EXACT_TOL
    agree = sum(a == b for a, b in zip(toks, ref_toks)) / GREEDY
    print(f"\n[{arch} {qtype.name}] logits vs transformers on the file's values: {d:.3g} (tolerance {tol:.3g}; "
          f"the quantization itself moves them {d_quant:.3g}); greedy tokens equal for {agree:.0%} of {GREEDY}")
    assert d < tol
    if qtype not in REQUANTIZED and not int8_acts and model.decoder is not None:   # torch's packed decode: bf16 activations
        assert toks == ref_toks
    if qtype not in (T.F16, T.BF16):                      # the quantization is real
        assert d_quant > 10 * EXACT_TOL
