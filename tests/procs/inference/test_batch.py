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


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])     # gemma: windowed layers
def test_static_step_equals_the_batched_step(name):
    """graphs.static_step (what a CUDA graph captures: positions as a tensor, attention over
    each cache's whole capacity under a mask) gives decode_batch's logits, sequences past
    Gemma's 512-token window included, once the rows past each length are cleared; with NaN
    left there, the masked rows poison the sum (why graphs.py clears them)."""
    from common.config import Settings
    from common.models import resolve
    from procs.inference.graphs import clear_past, static_step
    from procs.inference.loader import load
    m = Llama(load(resolve(name, Settings().models_path()), torch.float32, "cpu"), 2048, packed=False)  # torch, f32
    ps = [[1 + (i * 7 + j * 13) % 3000 for j in range(n)] for i, n in enumerate((300, 530, 610))]
    ref, got = sessions(m, ps), sessions(m, ps)
    for step in range(3):
        toks = [int(s.logits.argmax()) for s in ref]
        want = torch.stack(decode_many(ref, toks))
        for s in got:
            s.reserve(len(s) + 1)
        pos = [len(s) for s in got]
        caches = [(s.k, s.v) for s in got]
        m.ensure_rope(max(pos) + 1)
        if step == 0:
            for kc, vc in caches:
                kc[:, :, len(kc[0, 0]) - 1:].fill_(float("nan"))
            poisoned = static_step(m, torch.tensor(toks), torch.tensor(pos), caches)
            assert poisoned.isnan().all(dim=1).all()
        clear_past(caches, pos)
        out = static_step(m, torch.tensor(toks), torch.tensor(pos), caches)
        for s, t, row in zip(got, toks, out):
            s.tokens.append(t)
            s.logits = row
        assert out.shape == want.shape and torch.equal(out.argmax(dim=1), want.argmax(dim=1))
        assert (out - want).abs().max().item() <= 1e-3 * want.abs().max().item()
        for a, b in zip(ref, got):                       # the same rows written, where they belong
            assert torch.allclose(a.k[:, :, :len(a)], b.k[:, :, :len(b)], atol=1e-3)



def test_a_failed_capture_falls_back_to_eager_ops(model_path, monkeypatch):
    """graphs.GraphDecoder's failures, with its capture replaced by one that fails (CUDA graphs
    need a GPU; the bookkeeping does not): out of memory, the step runs on torch's eager ops
    and graphs stay on; any other error turns them off. Either way the answer is the eager
    one, bit for bit."""
    from procs.inference.graphs import GraphDecoder
    from procs.inference.loader import load
    m = Llama(load(model_path, torch.float32, "cpu"), 2048, packed=False)
    assert m.graphs is None                                   # none on the CPU
    ps = prompts(3)
    toks = [5, 6, 7]
    want = decode_many(sessions(m, ps), toks)
    m.graphs = GraphDecoder(m)

    def oom(host, caches):
        raise torch.OutOfMemoryError("no memory for the capture")
    monkeypatch.setattr(m.graphs, "capture", oom)
    got = decode_many(sessions(m, ps), toks)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and m.graphs is not None

    def unsupported(host, caches):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(m.graphs, "capture", unsupported)
    got = decode_many(sessions(m, ps), toks)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and m.graphs is None
