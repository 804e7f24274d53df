"""sampling.sample_many: the greedy rows picked together (on a GPU, where the logits are) give
what each row's own Sampler gives; the other rows still go through their Sampler."""
from __future__ import annotations

import pytest
import torch

from common.messages import SamplingParams
from procs.inference.sampling import Sampler, sample_many


def _rows(n: int, V: int = 300) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    rows = [torch.randn(V, generator=g) * 4 for _ in range(n)]
    rows[1][17] = rows[1][250] = rows[1].max() + 1       # a tie: the first id wins, as argmax
    rows[2][9] = 100.0                                    # a stop id that would win
    rows[3][290] = 100.0                                  # a padding id that would win
    return rows


def _params() -> list[SamplingParams]:
    return [SamplingParams(),
            SamplingParams(),
            SamplingParams(stop_ids=(9,), ignore_eos=True),
            SamplingParams(vocab=280),
            SamplingParams(temperature=0.7, seed=3),       # these three: their own Sampler
            SamplingParams(top_logprobs=3),
            SamplingParams()]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_greedy_rows_together_match_each_rows_sampler(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device here")
    rows = _rows(7)
    masks = [None] * 6 + [torch.full((300,), float("-inf")).index_fill_(0, torch.tensor([42]), 0.0)]
    want = [Sampler(p)(r, m) for p, r, m in zip(_params(), rows, masks)]
    got = sample_many([Sampler(p) for p in _params()], [r.to(device) for r in rows], masks,
                      together=True if device == "cpu" else None)
    assert [g[0] for g in got] == [w[0] for w in want]
    assert want[1][0] == 17 and want[2][0] != 9 and want[3][0] < 280 and want[6][0] == 42   # the cases bite
    for g, w in zip(got, want):
        assert g[1] == pytest.approx(w[1], abs=1e-5)
        assert [t for t, _ in g[2]] == [t for t, _ in w[2]]
    assert len(got[5][2]) == 3


def test_logit_bias_and_penalties_shape_the_pick_not_the_logprobs():
    """+bias makes a token win, -100 bans it (with a grammar, the grammar's only choice is
    kept), presence and frequency penalties count the answer's own picks; the reported
    logprob stays the model's."""
    x = torch.tensor([5.0, 4.0, 3.0, 0.0])
    raw = torch.log_softmax(x, -1)
    s = Sampler(SamplingParams(logit_bias=((3, 10.0),)))
    tok, lp, _ = s(x)
    assert tok == 3 and lp == pytest.approx(float(raw[3]))
    assert Sampler(SamplingParams(logit_bias=((0, -100.0),)))(x)[0] == 1
    only0 = torch.tensor([0.0, float("-inf"), float("-inf"), float("-inf")])
    assert Sampler(SamplingParams(logit_bias=((0, -100.0),)))(x, only0)[0] == 0
    # frequency: 0 wins until picked twice (5 - 2*0.6 < 4), then 1 ...
    s = Sampler(SamplingParams(frequency_penalty=0.6))
    assert [s(x)[0] for _ in range(5)] == [0, 0, 1, 0, 1]
    # presence: once each token is picked, it pays 2 no matter how often
    s = Sampler(SamplingParams(presence_penalty=1.5))
    assert [s(x)[0] for _ in range(4)] == [0, 1, 0, 0]
    # sample_many leaves a shaped greedy row to its own Sampler
    got = sample_many([Sampler(SamplingParams(logit_bias=((2, 5.0),)))], [x], [None], together=True)
    assert got[0][0] == 2


def test_the_repeat_penalty_looks_back_over_prompt_and_answer():
    """llama.cpp's rule: a token among the last repeat_last_n (the prompt's included) has its
    logit divided by the penalty, multiplied where negative; older tokens go free again."""
    x = torch.tensor([5.0, 4.0, 3.0, -1.0])
    s = Sampler(SamplingParams(repeat_penalty=2.0, repeat_last_n=1), history=[7, 0])
    assert [s(x)[0] for _ in range(4)] == [1, 0, 1, 0]          # 5 / 2 < 4, then 0 is out of the window
    s = Sampler(SamplingParams(repeat_penalty=2.0, repeat_last_n=-1), history=[0, 1, 2])
    assert [s(x)[0] for _ in range(3)] == [0, 0, 0]               # 2.5 > 2 > 1.5, however often 0 is there
    neg = torch.tensor([-1.0, -1.5, -3.0, -4.0])
    assert Sampler(SamplingParams(repeat_penalty=2.0), history=[0])(neg)[0] == 1   # -1 * 2 < -1.5
    assert Sampler(SamplingParams(repeat_penalty=2.0, repeat_last_n=0), history=[0])(x)[0] == 0   # off
