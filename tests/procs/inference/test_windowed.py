"""Sliding-window layers keep and checkpoint only their window (docs/kv-format.md section 4,
payload version 2), on a tiny random Gemma 3 (6 layers: five with a window of 8, one global)
in f32: a session exported at n tokens and imported elsewhere continues exactly as the
uninterrupted one, below and above the window, also through Disk.save -> shared-memory slot
-> the persister's Store -> Disk.restore; rows the restored session does not hold are never
read (they are NaN there); a restored session refuses truncations below its window floor, and
so do live_reuse and the inference Worker's plan. Last, the real Gemma 3 270M GGUF: a 2,000
token checkpoint against its dense-layout equivalent (run with -s to see the sizes)."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from common import kvfile as kf  # noqa: E402
from common.config import Settings  # noqa: E402
from common.trace import Trace  # noqa: E402
from procs.inference.loader import load  # noqa: E402
from procs.inference.model import Llama  # noqa: E402
from procs.inference.kvsession import KVSession  # noqa: E402
from procs.inference.plan import live_reuse  # noqa: E402
from tests.helpers import LOG, sha1  # noqa: E402
from tests.procs.inference.tiny_models import VOCAB, _hf_model  # noqa: E402

N_CTX, CHUNK, W, PROMPT = 96, 4, 8, 44
GEMMA_GGUF = os.path.expanduser("~/.cache/ricordo/models/gemma-3-270m-q4_k_m.gguf")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma3") / "hf"
    _hf_model("gemma3").save_pretrained(d)
    model = Llama(load(str(d), torch.float32, "cpu"), N_CTX)
    assert [ly.window for ly in model.layers] == [W] * 5 + [0]
    return model


def prompt(n: int = PROMPT) -> list[int]:
    g = torch.Generator().manual_seed(17)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def greedy(sess: KVSession, steps: int = 6):
    toks, out = [], []
    for _ in range(steps):
        toks.append(int(sess.logits.argmax()))
        out.append(sess.decode(toks[-1]).clone())
    return toks, out


def poisoned(model) -> KVSession:
    """A session whose every row is NaN until written: reading a row a checkpoint did not
    bring would make the logits NaN."""
    s = KVSession(model, N_CTX, CHUNK)
    s.k.fill_(float("nan"))
    s.v.fill_(float("nan"))
    return s


def assert_same_run(a: KVSession, b: KVSession, ids, n: int, want: dict) -> None:
    """b, holding the first n of ids, prefills the rest: every logit equal to a's (want),
    then greedy decoding gives the same tokens and logits."""
    got = b.prefill(ids[n:], logits_at=range(n + 1, len(ids) + 1))
    for i in range(n + 1, len(ids) + 1):
        assert torch.equal(got[i], want[i]), i
    assert torch.isfinite(b.logits).all()
    ta, la = greedy(a)
    tb, lb = greedy(b)
    assert ta == tb and all(torch.equal(x, y) for x, y in zip(la, lb))


@pytest.mark.parametrize("n", [4, 8, 20, 36])      # below, at, above the window (chunk-aligned)
def test_export_import_continues_bit_identically(gemma, n):
    ids = prompt()
    whole = KVSession(gemma, N_CTX, CHUNK)
    want = whole.prefill(ids, logits_at=range(n, len(ids) + 1))
    toks, k, v = whole.export(n)
    assert [x.shape[0] for x in k] == [min(n, W)] * 5 + [n] == [x.shape[0] for x in v]
    assert torch.equal(k[0][-1], whole.k[0, :, n - 1])    # the last rows, in logical order
    resumed = poisoned(gemma)
    resumed.import_(toks, want[n], k, v)
    assert resumed.window_floor == max(0, n - W) and resumed.can_keep(n)
    assert torch.equal(resumed.logits, want[n])
    assert_same_run(whole, resumed, ids, n, want)


@pytest.mark.parametrize("n", [5, 13, 27])
def test_exact_mode_resumes_anywhere(gemma, n):
    """Exact mode attends over whole padded key blocks, rows below the floor masked: the
    logits from a windowed checkpoint at an unaligned position still equal the whole run's."""
    ids = prompt()
    whole = KVSession(gemma, N_CTX, 16, exact=True)
    want = whole.prefill(ids, logits_at=range(n, len(ids) + 1))
    resumed = KVSession(gemma, N_CTX, 16, exact=True)
    toks, k, v = whole.export(n)
    resumed.import_(toks, want[n], k, v)
    got = resumed.prefill(ids[n:], logits_at=range(n + 1, len(ids) + 1))
    assert all(torch.equal(got[i], want[i]) for i in range(n + 1, len(ids) + 1))


def test_import_refuses_too_few_rows(gemma):
    whole = KVSession(gemma, N_CTX, CHUNK)
    whole.prefill(prompt(20))
    toks, k, v = whole.export(20)
    s = KVSession(gemma, N_CTX, CHUNK)
    with pytest.raises(ValueError):
        s.import_(toks, None, [x[1:] for x in k], [x[1:] for x in v])      # a window short
    with pytest.raises(ValueError):
        s.import_(toks, None, k[:5] + [k[5][-8:]], v[:5] + [v[5][-8:]])    # a global layer cut
    s.import_(toks, None, whole.k[:, :, :20].transpose(1, 2), whole.v[:, :, :20].transpose(1, 2))
    assert s.window_floor == 0                       # all rows: nothing missing


class Harness:
    """Disk on the tiny Gemma, its saves routed straight through the slot into a Store."""

    def __init__(self, model, tmp_path):
        from procs.inference.disk import Disk
        from procs.persister.store import Store
        self.dir = tmp_path / "kv"
        self.store = Store(str(self.dir), 1000, LOG, Trace(str(tmp_path / "trace"), "persister"))
        self.s = Settings(kv_disk_dir=str(self.dir), run_dir=str(tmp_path / "run"), chunk_size=CHUNK)
        os.makedirs(self.s.run_dir, exist_ok=True)
        self.saved: list[str] = []
        self.disk = Disk(self.s, model, N_CTX, self.s.run_dir, self.send, lambda t: None, LOG)

    @staticmethod
    def text(tokens) -> bytes:
        return b"".join(b"<%d>" % t for t in tokens)

    def send(self, msg) -> None:
        from shm.slots import read_slot
        mm, body = read_slot(msg.slot_path, msg.nbytes)
        try:
            self.saved.append(self.store.write(msg, body, self.text(msg.tokens), {}))
        finally:
            body.release()
            mm.close()
        self.disk.slot_freed(msg.slot, msg.seq)


@pytest.fixture
def harness(gemma, tmp_path):
    h = Harness(gemma, tmp_path)
    yield h
    h.disk.close()


def test_disk_save_restore_through_the_persister(gemma, harness):
    g = harness.disk.geometry
    assert g.windows == (W,) * 5 + (0,) and g.sliding_window == W and g.kv_dtype == kf.KV_F32
    ids = prompt()
    whole = KVSession(gemma, N_CTX, CHUNK)
    want = whole.prefill(ids, logits_at=range(4, len(ids) + 1))
    for n in (4, 20, 36):
        assert harness.disk.save(whole, n, want[n], kf.CONTINUED)
    assert not harness.disk.pool.busy
    for n, name in zip((4, 20, 36), harness.saved):
        assert name == sha1(Harness.text(ids[:n]))
        path = harness.dir / f"{name}.kv"
        e = kf.read(str(path), expect_geometry=g, expect_fingerprint=gemma.fingerprint)
        p0 = kf.TEXT_OFFSET + len(e.text)
        assert path.read_bytes()[p0 + 4] == 2                    # payload version 2
        assert e.rows == g.rows(n) == tuple([min(n, W)] * 5 + [n])
        assert os.path.getsize(path) == p0 + kf.payload_size(n, g) and kf.verify(str(path)) == []
        dense = kf.payload_size(n, kf.Geometry(**{**{f: getattr(g, f) for f in g.__struct_fields__},
                                                  "windows": (), "sliding_window": 0}))
        assert (kf.payload_size(n, g) < dense) == (n > W)
        for layer, r in enumerate(e.rows):
            assert torch.equal(torch.from_numpy(e.k[layer].copy()), whole.k[layer, :, n - r:n].transpose(0, 1))
    # the one above the window, restored into a session that holds NaN everywhere else
    whole2 = KVSession(gemma, N_CTX, CHUNK)
    whole2.prefill(ids)
    fresh = poisoned(gemma)
    assert harness.disk.restore(fresh, harness.saved[1]) == 20
    assert fresh.window_floor == 20 - W and torch.equal(fresh.logits, want[20])
    # a checkpoint needs one row more than a continuation: none at 19, one at 20 again
    assert not fresh.can_export(19) and not harness.disk.save(fresh, 19, want[19], kf.EVICT)
    assert fresh.can_export(20)
    assert_same_run(whole2, fresh, ids, 20, want)


def test_can_keep_and_live_reuse_refuse_the_rows_below_the_floor(gemma):
    from procs.inference.server import Worker
    ids = prompt()
    whole = KVSession(gemma, N_CTX, CHUNK)
    assert all(whole.can_keep(k) for k in range(0, 30))          # nothing is missing from scratch
    want = whole.prefill(ids[:20], logits_at=[20])
    s = KVSession(gemma, N_CTX, CHUNK)
    toks, k, v = whole.export(20)
    s.import_(toks, want[20], k, v)
    assert s.window_floor == 12
    # truncating to k keeps the session only if position k still sees its W - 1 keys
    assert [s.can_keep(k) for k in (0, 18, 19, 20, 25)] == [True, False, True, True, True]
    assert s.keep_from == 19 and whole.keep_from == 0          # what the renderer is told
    with pytest.raises(ValueError):
        s.truncate(18)
    assert s.tokens == ids[:20]                                   # a refused truncate changes nothing
    assert live_reuse(ids, 18, s.tokens, True, CHUNK, s.can_keep) == (0, True)
    assert live_reuse(ids, 19, s.tokens, True, CHUNK, s.can_keep) == (19, False)
    assert live_reuse(ids, 20, s.tokens, True, CHUNK, s.can_keep) == (20, False)
    # the whole prompt cached without logits: re-run from the chunk boundary (16) is below it
    assert live_reuse(ids[:20], 20, s.tokens, False, CHUNK, s.can_keep) == (0, True)
    assert live_reuse(ids[:20], 20, s.tokens, False, CHUNK) == (16, False)   # without the check
    # the inference worker's plan asks the session
    w = SimpleNamespace(s=SimpleNamespace(chunk_size=CHUNK), log=LOG)
    assert Worker.plan(w, SimpleNamespace(ids=ids, reuse=18, rid="j"), s) == 0
    assert Worker.plan(w, SimpleNamespace(ids=ids, reuse=20, rid="j"), s) == 20
    # a truncate to 0 forgets the floor; what is prefilled after it is whole
    s.truncate(0)
    assert s.window_floor == 0
    s.prefill(ids[:30])
    assert all(s.can_keep(k) for k in range(0, 31))


@pytest.mark.skipif(not os.path.isfile(GEMMA_GGUF), reason="gemma-3-270m GGUF not fetched")
def test_real_gemma_checkpoint_sizes(tmp_path):
    """Gemma 3 270M (15 layers with a window of 512, 3 global): a 2,000-token checkpoint
    written through Disk and the Store, its size against the same checkpoint in the dense
    layout, and the restored session decoding exactly as the live one."""
    from procs.inference.disk import Disk
    from procs.persister.store import Store
    from shm.slots import read_slot
    model = Llama(load(GEMMA_GGUF, torch.bfloat16, "cpu"), 4096)
    n = 2000
    ids = torch.randint(1000, 200000, (n,), generator=torch.Generator().manual_seed(3)).tolist()
    live = KVSession(model, 4096, 512)
    live.prefill(ids)
    store = Store(str(tmp_path / "kv"), 10000, LOG, Trace(str(tmp_path / "trace"), "persister"))
    s = Settings(kv_disk_dir=str(tmp_path / "kv"), run_dir=str(tmp_path / "run"), chunk_size=512)
    os.makedirs(s.run_dir)
    saved = []

    def send(msg):
        mm, body = read_slot(msg.slot_path, msg.nbytes)
        try:
            saved.append(store.write(msg, body, Harness.text(msg.tokens), {}))
        finally:
            body.release()
            mm.close()
        disk.slot_freed(msg.slot, msg.seq)
    disk = Disk(s, model, 4096, s.run_dir, send, lambda t: None, LOG)
    try:
        assert disk.save(live, n, live.logits, kf.SHUTDOWN)
        path = tmp_path / "kv" / f"{saved[0]}.kv"
        size = os.path.getsize(path)
        g = disk.geometry
        dense_g = kf.Geometry(**{**{f: getattr(g, f) for f in g.__struct_fields__},
                                 "windows": (), "sliding_window": 0})
        k = live.k[:, :, :n].transpose(1, 2).contiguous().view(torch.uint16).numpy()
        v = live.v[:, :, :n].transpose(1, 2).contiguous().view(torch.uint16).numpy()
        text = Harness.text(ids)
        dense = len(kf.pack(text, ids, live.logits.numpy(), k, v, dense_g, model.fingerprint, 4, kf.SHUTDOWN))
        print(f"\n[gemma-3-270m] {n}-token checkpoint: {size} bytes with windowed layers "
              f"(payload version 2), {dense} bytes in the dense layout (version 1): {dense / size:.2f}x")
        assert size == kf.TEXT_OFFSET + len(text) + kf.payload_size(n, g) and size < dense / 2
        fresh = KVSession(model, 4096, 512)
        assert disk.restore(fresh, saved[0]) == n and fresh.window_floor == n - 512
        a, b = greedy(live, 3), greedy(fresh, 3)
        assert a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
    finally:
        disk.close()
