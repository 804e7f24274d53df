"""Rows several batched sessions hold alike are read once a step (kvsession.Sharing, decode.c
decode_batch's lead/shared, attention.c decode_attention_many), and the answers stay bit for
bit each session's alone: sessions copied from one prefix (a side request, a sub-agent on the
same system prompt) share its whole chunks; sessions with the same tokens but rows that differ
in one bit share only the chunks before it; a truncated and regrown session is compared again.
On the default model (global attention, f32 and bf16) and on Gemma 3 270M (sliding-window
layers beside global ones: only layers whose keys start at row 0 share)."""
from __future__ import annotations

import pytest
import torch

from common.config import Settings
from common.models import ModelError, resolve
from procs.inference.kvsession import KVSession
from procs.inference.steps import decode_many
from procs.inference.sharing import Sharing
from procs.inference.native import ATT_CHUNK
from tests.conftest import _load_model

STEPS = 5
SYSTEM = [1 + (j * 37) % 2900 for j in range(300)]      # 2 whole chunks and 44 tokens


def suffix(i: int, n: int) -> list[int]:
    return [5 + (i * 11 + j * 17) % 2500 for j in range(n)]


def built(model, n_ctx: int = 2048) -> list[KVSession]:
    """A conversation and three others started from a copy of its system prompt (as the
    server's plan starts them), each with its own suffix: positions differ per session."""
    first = KVSession(model, n_ctx, 64)
    first.prefill(SYSTEM + suffix(0, 90))
    out = [first]
    for i in range(1, 4):
        s = KVSession(model, n_ctx, 64)
        s.copy_prefix(first, len(SYSTEM))
        s.prefill(suffix(i, 20 + 35 * i))
        out.append(s)
    return out


def greedy(ss: list[KVSession], sharing: Sharing | None, batched: bool = True):
    """STEPS greedy tokens of each session, batched (or each alone); (tokens, last logits)."""
    toks = [[] for _ in ss]
    for _ in range(STEPS):
        ts = [int(s.logits.argmax()) for s in ss]
        for a, t in zip(toks, ts):
            a.append(t)
        if batched:
            decode_many(ss, ts, sharing)
        else:
            for s, t in zip(ss, ts):
                s.decode(t)
    return [(t, s.logits.clone()) for t, s in zip(toks, ss)]


def same(a, b) -> bool:
    return all(ta == tb and torch.equal(la, lb) for (ta, la), (tb, lb) in zip(a, b))


def test_copied_prefix_is_shared_and_rows_stay_bit_exact(model):
    assert model.decoder is not None
    sharing = Sharing()
    ss = built(model)
    plan = sharing.plan(ss)
    # whole chunks of the copied system prompt, each from the first session (the leader)
    assert plan == [(0, 0)] + [(0, len(SYSTEM) // ATT_CHUNK * ATT_CHUNK)] * 3
    assert same(greedy(built(model), None, batched=False), greedy(ss, sharing))


def test_rows_that_differ_in_one_bit_are_not_shared(model):
    sharing = Sharing()
    ss = built(model)
    bits = torch.int16 if model.dtype == torch.bfloat16 else torch.int32
    ss[2].v[3, 1, 200].view(bits)[7] ^= 1      # one bit of the 2nd chunk of a V row, layer 3
    ss[3].k[0, 0, 5].view(bits)[0] ^= 1        # the 1st chunk of a K row, layer 0
    assert sharing.plan(ss) == [(0, 0), (0, 256), (0, 128), (3, 0)]
    ref = built(model)
    ref[2].v[3, 1, 200].view(bits)[7] ^= 1
    ref[3].k[0, 0, 5].view(bits)[0] ^= 1
    # were the changed rows read from the leader, the answers would be the unchanged ones'
    assert same(greedy(ref, None, batched=False), greedy(ss, sharing))


def test_a_session_cut_below_its_shared_rows_is_compared_again(model):
    sharing = Sharing()
    ss = built(model)
    assert sharing.plan(ss)[1] == (0, 256)
    ss[1].truncate(len(ss[1]) - 20)             # a cut past the shared rows keeps them
    ss[1].prefill(suffix(8, 30))
    assert sharing.plan(ss)[1] == (0, 256)
    ss[1].truncate(100)
    ss[1].prefill(suffix(9, 40))                # other tokens from row 100 on
    assert sharing.plan(ss)[1] == (1, 0)         # 100 common tokens: not one whole chunk
    ss[2].truncate(200)                         # a cut inside them: compared again
    ss[2].k[1, 0, 150].view(torch.int16 if model.dtype == torch.bfloat16 else torch.int32)[3] ^= 1
    assert sharing.plan(ss)[2] == (0, 128)


def test_sliding_window_layers_share_only_while_their_keys_start_at_row_0():
    try:
        path = resolve("gemma3-270m", Settings().models_path())
    except ModelError as e:
        pytest.skip(f"Gemma 3 270M is not fetched: {e}")
    gemma = _load_model(path, "bf16")
    assert gemma.decoder is not None and any(ly.window for ly in gemma.layers)
    window = max(ly.window for ly in gemma.layers)

    def long(model):   # past the window: the windowed layers' keys start after row 0
        ss = built(model, 4096)
        extra = window + 80 - len(SYSTEM)
        for i, s in enumerate(ss):
            s.prefill(suffix(20 + i, extra))
        return ss
    for make in (built, long):
        sharing = Sharing()
        ss = make(gemma)
        assert all(n >= ATT_CHUNK for _, n in sharing.plan(ss)[1:])
        assert same(greedy(make(gemma), None, batched=False), greedy(ss, sharing))


_MARCH_CHECK = r"""
import torch
import torch.nn.functional as F
from procs.inference import native
from procs.inference.sharing import Sharing
from tests.conftest import _load_model, default_model_path
from tests.procs.inference import test_shared_rows as t
k = native.load()
assert k is not None
g = torch.Generator().manual_seed(3)
# every query group size (G up to 16: more than one group of scores), head dims with and
# without a vector tail, rows with and without a partial block
for H, KV, D in ((9, 3, 64), (16, 1, 128), (4, 1, 256), (8, 8, 80), (7, 7, 24)):
    for S in (1, 13, 128, 300):
        q = torch.randn(H, D, generator=g)
        kk, vv = torch.randn(KV, S, D, generator=g).bfloat16(), torch.randn(KV, S, D, generator=g).bfloat16()
        got = k.attention(q, kk, vv, D ** -0.5)
        want = F.scaled_dot_product_attention(q.view(1, H, 1, D), kk.float().unsqueeze(0), vv.float().unsqueeze(0),
                                              enable_gqa=True, scale=D ** -0.5).view(1, H * D)
        assert (got - want).abs().max().item() < 1e-4, (H, KV, D, S, (got - want).abs().max().item())
m = _load_model(default_model_path(), "f32")
assert t.same(t.greedy(t.built(m), None, batched=False), t.greedy(t.built(m), Sharing()))
print("ok")
"""


@pytest.mark.parametrize("march", ["haswell", "x86-64"])
def test_each_kernel_build_shares_rows_exactly(march):
    """The AVX2 and portable builds (this CPU's own runs above): attention against SDPA for
    every query-group and head-dim shape, and shared rows give the alone answers bit for bit."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, RICORDO_KERNEL_MARCH=march)
    p = subprocess.run([sys.executable, "-c", _MARCH_CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout + p.stderr
