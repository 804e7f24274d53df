"""Batched decode (Llama.decode_batch, kvsession.decode_many): B sequences of different lengths
advance in one step. With the native kernels each row equals, bit for bit, the same sequence
decoded alone (greedy tokens and logits, in f32 and bf16); torch's batched linears (no native
kernels) agree within rounding, and exactly when asked (exact: one sequence at a time)."""
from __future__ import annotations

import pytest
import torch

from procs.inference.kvsession import KVSession, decode_many
from procs.inference.model import Llama


STEPS = 6


def prompts(n: int) -> list[list[int]]:
    """n prompts of different lengths (different positions in one step), plain token ids."""
    return [[1 + (i * 7 + j * 13) % 3000 for j in range(40 + 29 * i)] for i in range(n)]


def sessions(model: Llama, ps, exact: bool = False) -> list[KVSession]:
    out = []
    for p in ps:
        s = KVSession(model, 1024, 64, exact=exact)
        s.prefill(p)
        out.append(s)
    return out


def alone(model: Llama, ps, exact: bool = False):
    """(greedy tokens, final logits) of each prompt decoded alone."""
    res = []
    for s in sessions(model, ps, exact):
        toks = []
        for _ in range(STEPS):
            t = int(s.logits.argmax())
            toks.append(t)
            s.decode(t)
        res.append((toks, s.logits.clone()))
    return res


def together(model: Llama, ps, exact: bool = False):
    ss = sessions(model, ps, exact)
    toks = [[] for _ in ps]
    for _ in range(STEPS):
        ts = [int(s.logits.argmax()) for s in ss]
        for a, t in zip(toks, ts):
            a.append(t)
        rows = decode_many(ss, ts)
        assert all(r is s.logits for r, s in zip(rows, ss))
    for s, p, t in zip(ss, ps, toks):
        assert s.tokens == p + t
    return [(t, s.logits.clone()) for t, s in zip(toks, ss)]


@pytest.mark.parametrize("n", [2, 5])        # 5: more rows than one pass of the kernel (4)
def test_native_batch_rows_equal_single_rows(model, n):
    assert model.decoder is not None
    ps = prompts(n)
    for (ta, la), (tb, lb) in zip(alone(model, ps), together(model, ps)):
        assert ta == tb
        assert torch.equal(la, lb)


def test_batched_step_writes_each_sequence_at_its_own_position(model):
    ps = prompts(3)
    ss = sessions(model, ps)
    before = [(s.k[:, :, :len(s)].clone(), len(s)) for s in ss]
    decode_many(ss, [5, 6, 7])
    for s, (k, n) in zip(ss, before):
        assert len(s) == n + 1 and s.tokens[-1] in (5, 6, 7)
        assert torch.equal(s.k[:, :, :n], k)                      # earlier rows untouched
        assert s.k[:, :, n].abs().amax().item() > 0              # its new row written


def test_torch_path_batches_within_rounding_and_exactly_when_exact(model_path):
    from tests.conftest import _load_model
    native = _load_model(model_path, "f32")
    m = Llama.__new__(Llama)
    m.__dict__.update(native.__dict__)
    m.decoder = None                  # the same weights on torch's ops
    ps = prompts(3)
    ref = alone(m, ps)
    got = together(m, ps)
    for (ta, la), (tb, lb) in zip(ref, got):
        assert (la - lb).abs().max().item() < 1e-2 * la.abs().max().item()
    for (ta, la), (tb, lb) in zip(alone(m, ps, exact=True), together(m, ps, exact=True)):
        assert ta == tb and torch.equal(la, lb)
