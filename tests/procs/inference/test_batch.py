"""Batched decode (Llama.decode_batch, steps.decode_many): B sequences of different lengths
advance in one step. With the native kernels each row equals, bit for bit, the same sequence
decoded alone (greedy tokens and logits, in f32 and bf16); torch's batched linears (no native
kernels) agree within rounding, and exactly when asked (exact: one sequence at a time)."""
from __future__ import annotations

import pytest
import torch

from procs.inference.kvsession import KVSession
from procs.inference.steps import decode_many
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
def test_the_pooled_step_equals_the_batched_step(name):
    """graphs.GraphDecoder's step (what a CUDA graph captures: the batch in slots of one K/V
    pool, positions as a tensor, one masked attention over the attended capacity), run
    eagerly here, gives decode_batch's logits and writes the same rows into the sessions, past
    Gemma's 512-token window and for a session restored from a windowed checkpoint (its rows
    below the layers' floors hold NaN here, as garbage may). A session is copied into a slot
    only when the slot does not hold it as it is now: not on every step, not when the batch
    shrinks or reorders, again after it changed outside the pool."""
    from common.config import Settings
    from common.models import resolve
    from procs.inference.graphs import GraphDecoder
    from procs.inference.loader import load
    m = Llama(load(resolve(name, Settings().models_path()), torch.float32, "cpu"), 2048, packed=False)  # torch, f32
    ps = [[1 + (i * 7 + j * 13) % 3000 for j in range(n)] for i, n in enumerate((300, 530, 710))]
    ref, got = sessions(m, ps), sessions(m, ps)
    toks, k, v = got[2].export()
    got[2] = KVSession(m, 1024, 64)
    got[2].import_(toks, ref[2].logits, k, v)
    for li, f in enumerate(got[2].floors):
        got[2].k[li, :, :f] = float("nan")
        got[2].v[li, :, :f] = float("nan")
    assert (got[2].window_floor > 0) == (name == "gemma3-270m")
    gd = GraphDecoder(m, capture=False)

    def step(idx):
        toks = [int(ref[i].logits.argmax()) for i in idx]
        m.graphs = None
        want = torch.stack(decode_many([ref[i] for i in idx], toks))
        m.graphs = gd
        out = torch.stack(decode_many([got[i] for i in idx], toks))
        m.graphs = None
        assert out.shape == want.shape and torch.equal(out.argmax(dim=1), want.argmax(dim=1))
        assert (out - want).abs().max().item() <= 1e-3 * want.abs().max().item()
        for i in idx:                                    # the same rows written, where they belong
            a, b = ref[i], got[i]
            assert a.tokens == b.tokens
            lo = b.window_floor
            assert torch.allclose(a.k[:, :, lo:len(a)], b.k[:, :, lo:len(b)], atol=1e-3)
    for _ in range(3):
        step([0, 1, 2])
    dec = gd.pools["decode"]
    assert dec.copies == 3
    step([1, 0])                                         # shrunk and reordered: slots held
    assert dec.copies == 3
    step([0, 2])                                         # 2's slot is past the batch: copied
    assert dec.copies == 4
    step([0, 1, 2])                                      # 1 went on without: copied again
    assert dec.copies == 5
    for s in (ref[0], got[0]):                           # a turn prefilled outside the pool
        s.prefill([11, 12, 13])
    step([1, 0, 2])
    assert dec.copies == 6


def test_the_pool_rows_must_be_finite(model_path):
    """Why graphs.py keeps every slot row finite: the step reads the attended capacity under a
    mask, and a NaN in a masked row poisons every sum it enters."""
    from procs.inference.graph_step import static_step
    from procs.inference.pools import Pool
    from procs.inference.loader import load
    m = Llama(load(model_path, torch.float32, "cpu"), 2048, packed=False)
    s = sessions(m, prompts(1))[0]
    pool = Pool("decode")
    pool.grow(m, 1, 512)
    pool.place([s])
    pos = torch.tensor([[len(s)]])
    assert torch.isfinite(static_step(m, torch.tensor([5]), pos, pool.k, pool.v, 512)).all()
    pool.k[:, 0, :, len(s) + 1:] = float("nan")
    assert static_step(m, torch.tensor([5]), pos, pool.k, pool.v, 512).isnan().all()


@pytest.mark.parametrize("fused", [False, True], ids=["product", "fused"])
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_the_pooled_prefill_equals_the_forward(name, fused):
    """graphs.GraphDecoder.prefill (a chunk padded to a bucket in the prefill pool's slot, one
    masked attention over the attended capacity: the product, or torch's fused kernel with
    the query heads folded into rows), run eagerly here: the logits asked for and
    the rows written equal Llama.forward's within rounding, a prompt in several chunks, a
    single token, a turn that starts mid-chunk, Gemma past its window; the padding's rows
    never reach the session; the slot is copied into only when it does not hold the session."""
    from common.config import Settings
    from common.models import resolve
    from procs.inference.graphs import GraphDecoder
    from procs.inference.loader import load
    m = Llama(load(resolve(name, Settings().models_path()), torch.float32, "cpu"), 2048, packed=False)
    gd = GraphDecoder(m, capture=False)
    gd.fused["prefill"] = fused
    ids = [1 + (j * 13) % 3000 for j in range(700)]
    ref, got = KVSession(m, 2048, 256), KVSession(m, 2048, 256)
    for part, at in ((ids[:600], (100, 256, 600)), (ids[600:601], ()), (ids[601:700], (650,))):
        m.graphs = None
        want = ref.prefill(part, logits_at=at)
        m.graphs = gd
        out = got.prefill(part, logits_at=at)
        m.graphs = None
        assert sorted(out) == sorted(want) and got.tokens == ref.tokens
        for n in list(want) + [None]:
            a, b = (want[n], out[n]) if n else (ref.logits, got.logits)
            assert int(a.argmax()) == int(b.argmax()) and (a - b).abs().max().item() <= 1e-3 * a.abs().max().item()
        assert torch.allclose(ref.k[:, :, :len(ref)], got.k[:, :, :len(got)], atol=1e-3)
        assert torch.allclose(ref.v[:, :, :len(ref)], got.v[:, :, :len(got)], atol=1e-3)
    pool = gd.pools["prefill"]
    # copied in at the first chunk and once more when the pool grew past 512 rows; every
    # other chunk found its rows held
    assert pool.copies == 2 and pool.k.shape[3] == 1024
    assert pool.k[:, 0, :, len(got):len(got) + 5].abs().amax() > 0   # the last chunk's padding, in the pool only


@pytest.mark.parametrize("fused", [False, True], ids=["product", "fused"])
def test_chunks_of_several_prompts_in_one_pooled_prefill(model_path, fused):
    """steps.prefill_many (several sessions' next chunks in one step of the prefill pool,
    padded to one bucket, each with its own mask), run eagerly here: each session's logits
    and rows are those of its own prefill within rounding, whatever the order of their slots;
    a chunk that crosses a chunk boundary is refused; without graphs it does nothing (None)."""
    from procs.inference.graphs import GraphDecoder
    from procs.inference.steps import prefill_many
    from procs.inference.loader import load
    m = Llama(load(model_path, torch.float32, "cpu"), 2048, packed=False)
    ps = [[1 + (i * 7 + j * 13) % 3000 for j in range(n)] for i, n in enumerate((100, 300, 40))]
    ref = [KVSession(m, 2048, 256) for _ in ps]
    got = [KVSession(m, 2048, 256) for _ in ps]
    assert prefill_many(got, [p[:10] for p in ps], [(), (), ()]) is None and all(len(s) == 0 for s in got)
    m.graphs = GraphDecoder(m, capture=False)
    m.graphs.fused["prefill"] = fused
    for rnd in range(3):
        idx = [2, 0, 1] if rnd == 1 else [0, 1, 2]         # the slots reordered in the second round
        chunks, ats = [], []
        for i in idx:
            lo = len(got[i])
            hi = min(len(ps[i]), got[i].boundaries(lo, len(ps[i]))[0]) if lo < len(ps[i]) else lo
            chunks.append(ps[i][lo:hi] or [5])
            ats.append({lo + 1, lo + len(chunks[-1])})
        out = prefill_many([got[i] for i in idx], chunks, ats)
        m.graphs, keep = None, m.graphs
        for i, ch, at, o in zip(idx, chunks, ats, out):
            want = ref[i].prefill(ch, logits_at=at)
            assert sorted(o) == sorted(want) and got[i].tokens == ref[i].tokens
            for n in want:
                assert int(o[n].argmax()) == int(want[n].argmax())
                assert (o[n] - want[n]).abs().max().item() <= 1e-3 * want[n].abs().max().item()
            assert torch.allclose(got[i].k[:, :, :len(got[i])], ref[i].k[:, :, :len(ref[i])], atol=1e-3)
            assert torch.equal(got[i].logits, o[max(o)])
        m.graphs = keep
    with pytest.raises(ValueError):
        prefill_many([got[0]], [list(range(1, 300))], [()])


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

    def oom(*args):
        raise torch.OutOfMemoryError("no memory for the capture")
    monkeypatch.setattr(m.graphs, "capture", oom)
    got = decode_many(sessions(m, ps), toks)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and m.graphs is not None

    def unsupported(*args):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(m.graphs, "capture", unsupported)
    got = decode_many(sessions(m, ps), toks)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and m.graphs is None


def test_a_capture_the_fused_attention_fails_falls_back_to_the_product(model_path):
    """A capture that fails with the fused kernel (an op the graph cannot hold) is made again
    with the product, that kind of step keeps the product, and graphs stay on; the decode
    steps of several sequences, each with its own mask, then give the eager ops' answer
    within rounding, fused or not (the CPU's fused kernel here: torch's flash with a mask)."""
    from procs.inference.graphs import GraphDecoder
    from procs.inference.loader import load
    from tests.procs.inference.test_runs import EagerGraphs

    class FusedFails(EagerGraphs):
        tried: list = []

        def capture(self, host, shape, cap, pool, head):
            self.tried.append(self.fused[pool.name])
            if self.fused[pool.name]:
                raise RuntimeError("operation not permitted when stream is capturing")
            return super().capture(host, shape, cap, pool, head)

    m = Llama(load(model_path, torch.float32, "cpu"), 2048, packed=False)
    ps = prompts(3)
    toks = [5, 6, 7]
    want = decode_many(sessions(m, ps), toks)
    ss = sessions(m, ps)
    gd = m.graphs = FusedFails(m)
    gd.fused["decode"] = True
    got = decode_many(ss, toks)
    assert gd.tried == [True, False] and gd.fused == {"decode": False, "prefill": False} and m.graphs is gd
    for a, b in zip(got, want):
        assert int(a.argmax()) == int(b.argmax()) and (a - b).abs().max().item() <= 1e-3 * a.abs().max().item()
    ss = sessions(m, ps)
    m.graphs = GraphDecoder(m, capture=False)
    m.graphs.fused["decode"] = True
    got = decode_many(ss, toks)
    for a, b in zip(got, want):
        assert int(a.argmax()) == int(b.argmax()) and (a - b).abs().max().item() <= 1e-3 * a.abs().max().item()


def test_a_failed_fused_prefill_capture_never_captures_what_only_the_fused_kernel_fits(model_path, monkeypatch):
    """When the fused kernel's capture fails, the product takes over prefill steps, but only
    those whose f32 scores fit SCORES_MAX: a step that fitted only as the fused kernel's mask
    runs eagerly (its answer the forward's), and warm() leaves out the lengths the product
    outgrows instead of pinning their scores in the graphs' pool."""
    from procs.inference import graphs as graphs_mod
    from procs.inference.loader import load
    from tests.procs.inference.test_runs import EagerGraphs

    class FusedFails(EagerGraphs):
        def __init__(self, model):
            super().__init__(model)
            self.tried = []

        def capture(self, host, shape, cap, pool, head):
            self.tried.append((pool.name, shape, self.fused[pool.name]))
            if self.fused[pool.name]:
                raise RuntimeError("operation not permitted when stream is capturing")
            return super().capture(host, shape, cap, pool, head)

    m = Llama(load(model_path, torch.float32, "cpu"), 2048, packed=False)
    c = m.cfg
    # a 256-row chunk at 512 keys: its product's scores over the bound, the fused mask within
    monkeypatch.setattr(graphs_mod, "SCORES_MAX", 2 << 20)
    assert c.n_heads * 256 * 512 * 4 > graphs_mod.SCORES_MAX >= (c.n_heads // c.n_kv_heads) * 256 * 512 * 4
    ids = [1 + (j * 13) % 3000 for j in range(200)]
    ref = KVSession(m, 2048, 256)
    want = ref.prefill(ids, logits_at=(199,))
    gd = m.graphs = FusedFails(m)
    gd.fused["prefill"] = True
    got = KVSession(m, 2048, 256)
    out = got.prefill(ids, logits_at=(199,))
    m.graphs = None
    assert gd.tried == [("prefill", (1, 256), True)] and not gd.fused["prefill"] and not gd.graphs
    assert torch.allclose(out[199], want[199], atol=1e-4) and got.tokens == ref.tokens

    gd = m.graphs = FusedFails(m)
    gd.fused["prefill"] = True
    made = gd.warm(1, 256)
    m.graphs = None
    prefills = [k for k in gd.graphs if k[0] == "prefill"]
    assert not gd.fused["prefill"] and prefills and made == len(gd.graphs)
    assert all(gd.fits_scores(B, T, cap, fused=False) for _, B, T, cap in prefills), prefills
    assert {k[2] for k in gd.graphs if k[0] == "decode"} == {512, 1024, 2048}   # warm went on to every capacity


def test_the_attention_of_each_kind_of_step_is_timed_and_the_faster_kept(model_path):
    """GraphDecoder.choose_attention (warm's first step on CUDA): each kind timed at its
    largest graph's shape, both ways, and the faster kept; a fused kernel that refuses the
    shape leaves the product."""
    from procs.inference import graphs as graphs_mod
    from procs.inference.graphs import GraphDecoder
    from procs.inference.loader import load
    m = Llama(load(model_path, torch.float32, "cpu"), 2048, packed=False)
    gd = GraphDecoder(m, capture=False)
    got = gd.choose_attention(2, 256)
    assert set(gd.attention_ms) == {"decode", "prefill"}
    assert gd.attention_ms["decode"][0] == (2, 1, 2048) and gd.attention_ms["prefill"][0] == (1, 256, 2048)
    for kind, (shape, product, fused) in gd.attention_ms.items():
        assert product > 0 and fused > 0 and got[kind] == (fused < product)
    real = graphs_mod.time_attention

    def refuse(fused, *args):
        if fused:
            raise RuntimeError("No available kernel")
        return real(fused, *args)
    graphs_mod.time_attention = refuse
    try:
        assert gd.choose_attention(2, 256) == {"decode": False, "prefill": False}
        assert all(f is None for _, _, f in gd.attention_ms.values())
    finally:
        graphs_mod.time_attention = real


def test_a_fused_prefill_takes_longer_chunks_into_graphs(model_path):
    """The product writes f32 scores for every query head (SCORES_MAX bounds them); the fused
    kernel writes only its mask, one row per query head of a K/V head's group: a 512-token
    chunk at 16k keys is eager with the product and a graph's step when fused."""
    from procs.inference.graphs import SCORES_MAX, GraphDecoder
    from procs.inference.loader import load
    m = Llama(load(model_path, torch.float32, "cpu"), 2048, packed=False)
    gd = GraphDecoder(m, capture=False)
    c = m.cfg
    assert c.n_heads * 512 * 16384 * 4 > SCORES_MAX >= (c.n_heads // c.n_kv_heads) * 512 * 16384 * 4
    assert not gd.fits_scores(1, 512, 16384)
    gd.fused["prefill"] = True
    assert gd.fits_scores(1, 512, 16384) and not gd.fits_scores(1, 512, 16384, fused=False)
    assert not gd.fits_scores(64, 512, 16384)
