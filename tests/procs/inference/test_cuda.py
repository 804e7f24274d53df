"""The model on a CUDA device, as the server builds it there (bf16, torch's ops, no native
kernels, decode steps replayed from CUDA graphs): parity with llama.cpp's reference vectors,
batched decode against one sequence at a time and against torch's eager ops, a graph's replay
against the step it captured, graphs captured ahead leaving none to a request, a restored windowed session (rows below its floors), a
checkpoint's rows through a shared-memory slot and back, and the K/V budget sized from the
device's memory. Skipped where torch sees no CUDA device (CI has none); run on a GPU
machine with `pytest tests/procs/inference/test_cuda.py -s`.
"""
from __future__ import annotations

import pytest
import torch

from common.config import Settings
from common.models import ModelError, resolve
from procs.inference.graphs import GraphDecoder
from procs.inference.kvsession import KVSession
from procs.inference.steps import decode_many
from procs.inference.runtime import build
from procs.inference.sessions import RAM_SHARE, budget_bytes
import numpy as np

from shm import slots

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


def _build(model_path, graphs: bool):
    model, _, _ = build(Settings(model=model_path, device="auto", dtype="auto", ctx_size=4096, cuda_graphs=graphs))
    assert model.device.type == "cuda" and model.dtype == torch.bfloat16 and model.decoder is None
    assert (model.graphs is not None) == graphs
    return model


@pytest.fixture(scope="module")
def gpu(model_path):
    return _build(model_path, True)


@pytest.fixture(scope="module")
def eager(model_path):
    return _build(model_path, False)


def test_parity_with_llama_cpp(gpu, vectors):
    """Teacher-forced next-token distributions against llama.cpp's, as test_model's CPU check."""
    agree = total = 0
    kls = []
    for case in vectors["cases"]:
        ids = case["token_ids"]
        logits = KVSession(gpu, 128, 512).prefill(ids, logits_at=range(1, len(ids) + 1))
        for i, pos in enumerate(case["positions"]):
            lp = torch.log_softmax(logits[i + 1].double().cpu(), dim=-1)
            ref_lp = torch.tensor(pos["top_logprobs"], dtype=torch.float64)
            agree += int(torch.argmax(lp)) == pos["top_ids"][0]
            total += 1
            kls.append(float((ref_lp.exp() * (ref_lp - lp[torch.tensor(pos["top_ids"])])).sum()))
    top1, kl = agree / total, sum(kls) / len(kls)
    print(f"\n[cuda bf16] {total} positions: top-1 agreement {top1:.2%}, mean top-10 KL {kl:.4f}")
    assert total == 349 and top1 >= 0.93 and kl <= 0.01


def _sessions(model, vectors, n: int = 4, cap: int = 512) -> list[KVSession]:
    out = []
    for c in vectors["cases"][:n]:
        s = KVSession(model, cap, 128)
        s.prefill(c["token_ids"])
        out.append(s)
    return out


@pytest.mark.parametrize("which", ["gpu", "eager"])
def test_batched_decode_matches_one_at_a_time(which, request, vectors):
    """Four sessions of different lengths decoded in one batched step give each the logits
    that decoding it alone gives (bf16 GEMMs over 4 rows may round differently: close, and
    the same greedy token), with graphs and without."""
    model = request.getfixturevalue(which)
    alone, batched = _sessions(model, vectors), _sessions(model, vectors)
    nexts = [int(torch.argmax(s.logits)) for s in alone]
    want = [s.decode(t) for s, t in zip(alone, nexts)]
    got = decode_many(batched, nexts)
    for w, g, s, t in zip(want, got, batched, nexts):
        assert g.shape == w.shape and s.tokens[-1] == t
        assert (g.float() - w.float()).abs().max().item() <= 2.0
        assert int(torch.argmax(g)) == int(torch.argmax(w))


def test_graphs_agree_with_eager_ops(gpu, eager, vectors):
    """Eight steps of four sessions fed the same tokens: the graphs' logits are torch's eager
    ops' within bf16 rounding (their attention differs: a masked product over the capacity
    against SDPA over the length), and name the same top token almost always."""
    a, b = _sessions(gpu, vectors), _sessions(eager, vectors)
    same = total = 0
    for _ in range(8):
        toks = [int(torch.argmax(s.logits)) for s in a]
        for x, y in zip(decode_many(a, toks), decode_many(b, toks)):
            assert (x - y).abs().max().item() <= 2.0
            same += int(torch.argmax(x)) == int(torch.argmax(y))
            total += 1
    assert same >= 0.9 * total, (same, total)


def test_a_replay_is_the_step_it_captured(gpu, vectors):
    """A graph replayed gives, bit for bit, what the same step run eagerly on the same pool
    gives (GraphDecoder(capture=False): graph_step.static_step, which it captured): prefill chunks
    (padded to their bucket) and decode steps. One capture serves every step of its shape:
    other sessions, the batch reordered; a new size or a doubled capacity captures anew."""
    kept = gpu.graphs
    graphs = GraphDecoder(gpu)
    eager = GraphDecoder(gpu, capture=False)
    try:
        gpu.graphs = graphs
        a = _sessions(gpu, vectors, 3, cap=1024)
        gpu.graphs = eager
        b = _sessions(gpu, vectors, 3, cap=1024)
        assert all(torch.equal(x.logits, y.logits) and torch.equal(x.k[:, :, :len(x)], y.k[:, :, :len(y)])
                   for x, y in zip(a, b))
        assert any(k[0] == "prefill" for k in graphs.graphs)
        start = graphs.captures

        def decodes():
            return {k[1:] for k in graphs.graphs if k[0] == "decode"}

        def both(idx):
            toks = [int(torch.argmax(a[i].logits)) for i in idx]
            gpu.graphs = graphs
            got = decode_many([a[i] for i in idx], toks)
            gpu.graphs = eager
            want = decode_many([b[i] for i in idx], toks)
            gpu.graphs = graphs
            assert all(torch.equal(g, w) for g, w in zip(got, want)), \
                max((g - w).abs().max().item() for g, w in zip(got, want))
        for _ in range(4):
            both([0, 1, 2])
        both([2, 1, 0])
        assert graphs.captures == start + 1 and decodes() == {(3, 512)}
        both([1, 2])
        assert graphs.captures == start + 2
        while len(a[0]) < 600:                     # past the first capacity bucket
            both([0])
        # a larger pool: the graphs on the old one dropped
        assert decodes() == {(1, 1024)} and graphs.pools["decode"].k.shape[3] == 1024
    finally:
        gpu.graphs = kept


def test_warmed_graphs_leave_no_capture_to_a_request(gpu, vectors):
    """warm() (the server's start) captures every decode batch size and one prompt's every
    padded chunk length at each capacity bucket; prompts prefilled in chunks and their
    answers decoded together then capture nothing, and the pools never grow."""
    kept = gpu.graphs
    graphs = GraphDecoder(gpu)
    try:
        gpu.graphs = graphs
        made = graphs.warm(3, 128)
        assert made == graphs.captures == len(graphs.graphs) > 0
        assert set(graphs.attention_ms) == {"decode", "prefill"}     # timed both ways first
        print("attention chosen at start:", graphs.fused, graphs.attention_ms)
        storage = [p.k.data_ptr() for p in graphs.pools.values()]
        a = _sessions(gpu, vectors, 3, cap=4096)
        for _ in range(5):
            decode_many(a, [int(torch.argmax(s.logits)) for s in a])
        decode_many(a[:2], [int(torch.argmax(s.logits)) for s in a[:2]])
        assert graphs.captures == made and [p.k.data_ptr() for p in graphs.pools.values()] == storage
    finally:
        gpu.graphs = kept


@pytest.mark.parametrize("fused", [False, True], ids=["product", "fused"])
def test_prefill_graphs_match_eager_ops(gpu, eager, vectors, fused):
    """A prompt prefilled through the prefill graphs (chunks padded to buckets, one of a
    single token) gives torch's eager ops' logits and rows within bf16 rounding, with the
    attention's product and with the fused kernel (captured, not fallen back from); then
    decode steps of three sequences likewise."""
    kept = gpu.graphs
    graphs = GraphDecoder(gpu)
    graphs.fused = {"decode": fused, "prefill": fused}
    try:
        gpu.graphs = graphs
        ids = vectors["cases"][0]["token_ids"] + [1 + (j * 13) % 3000 for j in range(700)]
        ids = ids[:700]
        a, b = KVSession(gpu, 2048, 256), KVSession(eager, 2048, 256)
        for part in (ids[:600], ids[600:601], ids[601:]):
            la, lb = a.prefill(part, logits_at=(len(a) + 1,)), b.prefill(part, logits_at=(len(b) + 1,))
            for x, y in [(a.logits, b.logits)] + [(la[n], lb[n]) for n in lb]:
                assert (x - y).abs().max().item() <= 2.0 and int(torch.argmax(x)) == int(torch.argmax(y))
        ka, kb = a.k[:, :, :700].float(), b.k[:, :, :700].float()
        assert (ka - kb).abs().max().item() <= 0.05 * kb.abs().max().item()
        assert any(k[0] == "prefill" for k in graphs.graphs)
        x, y = _sessions(gpu, vectors, 3, cap=1024), _sessions(eager, vectors, 3, cap=1024)
        for _ in range(3):
            toks = [int(torch.argmax(s.logits)) for s in y]
            for p, q in zip(decode_many(x, toks), decode_many(y, toks)):
                assert (p - q).abs().max().item() <= 2.0
        assert graphs.fused == {"decode": fused, "prefill": fused} and gpu.graphs is graphs
    finally:
        gpu.graphs = kept


def test_a_restored_windowed_session_reads_zeros_below_its_floors():
    """Gemma 3 (512-token window): a checkpoint of 700 tokens holds only the last 512 rows of
    its windowed layers. Restored into GPU memory that held NaN, the session's rows below
    those layers' floors are garbage; the graph step reads its pool's copy of them (masked),
    which GraphDecoder zeroed: finite logits, those of the session it was exported from."""
    try:
        path = resolve("gemma3-270m", Settings().models_path())
    except ModelError as e:
        pytest.skip(str(e))
    gem, _, _ = build(Settings(model=path, device="auto", dtype="auto", ctx_size=2048))
    assert gem.graphs is not None
    src = KVSession(gem, 2048, 512)
    src.prefill([1 + (j * 13) % 3000 for j in range(700)])
    tokens, k, v = src.export()
    junk = torch.full((64 << 20,), float("nan"), device="cuda")   # the allocator's next blocks held NaN
    del junk
    dst = KVSession(gem, 2048, 512)
    dst.import_(tokens, src.logits, k, v)
    assert dst.window_floor > 0
    t = int(torch.argmax(src.logits))
    got = decode_many([dst], [t])[0]
    want = src.decode(t)                                          # torch's eager ops
    assert torch.isfinite(got).all()
    assert int(torch.argmax(got)) == int(torch.argmax(want)) and (got - want).abs().max().item() <= 2.0


def test_checkpoint_rows_through_a_slot(gpu, vectors, tmp_path):
    """A CUDA session's rows written into a shared-memory slot (the persister's input) and read
    back into a fresh CUDA session are the same bits, and decode goes on identically."""
    ids = vectors["cases"][0]["token_ids"]
    src = KVSession(gpu, 256, 128)
    src.prefill(ids)
    n = len(ids)
    L, KV, D, V = src.k.shape[0], src.k.shape[1], src.k.shape[3], src.logits.numel()
    pool = slots.SlotPool(str(tmp_path), count=1, capacity=slots.body_bytes(n, V, L, KV, D, 2) + slots.SEQ_BYTES)
    try:
        nbytes = pool.write(0, src.tokens, src.logits, src.k, src.v, n=n, seq=1)
        mm, body = slots.read_slot(slots.slot_path(str(tmp_path), 0), nbytes)
        logits, k, v = slots.read_body(body, n, V, L, KV, D, np.uint16)
        tokens = [int(t) for t in np.frombuffer(body[:4 * n], dtype="<i4")]
        dst = KVSession(gpu, 256, 128)
        dst.import_(tokens, torch.from_numpy(logits.copy()), torch.from_numpy(k.copy()).view(torch.bfloat16),
                    torch.from_numpy(v.copy()).view(torch.bfloat16))
        del logits, k, v, body      # numpy views of the map: it closes only without them
        mm.close()
    finally:
        pool.close()
    assert dst.tokens == src.tokens and dst.k.device == gpu.device
    assert torch.equal(dst.k[:, :, :n], src.k[:, :, :n]) and torch.equal(dst.v[:, :, :n], src.v[:, :, :n])
    t = int(torch.argmax(src.logits))
    assert torch.equal(dst.decode(t), src.decode(t))


def test_kv_budget_follows_the_device_memory():
    free, _ = torch.cuda.mem_get_info()
    got = budget_bytes(0, "cuda")
    assert abs(got - free * RAM_SHARE) <= 0.05 * free       # other processes may take some meanwhile
    assert budget_bytes(64, "cuda") == 64 << 20
