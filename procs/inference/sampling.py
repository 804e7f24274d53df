"""Token sampling: greedy at temperature 0, else temperature / top-k / top-p / min-p; before
either, OpenAI's logit_bias and presence / frequency penalties (counted over the answer's
own tokens, as OpenAI and vLLM count them), and llama.cpp's repeat penalty (over the last
repeat_last_n tokens of prompt and answer, as llama.cpp looks back).

A request's seed drives its own torch.Generator, so a seeded run is reproducible whatever
else the process did before. Log-probabilities are the model's (log-softmax of the raw
logits), as OpenAI reports them, not of the filtered distribution.
"""
from __future__ import annotations

import collections

import torch

from common.messages import SamplingParams


class Sampler:
    def __init__(self, p: SamplingParams, history=()):
        """history: the prompt's token ids (the repeat penalty looks back into them)."""
        self.p = p
        self.gen = None
        if p.temperature > 0:
            self.gen = torch.Generator(device="cpu")
            self.gen.manual_seed(p.seed if p.seed is not None else torch.seed() & 0x7FFF_FFFF_FFFF_FFFF)
        self.recent: collections.deque | None = None    # the tokens the repeat penalty sees
        if p.repeat_penalty != 1.0 and p.repeat_last_n != 0:
            n = p.repeat_last_n if p.repeat_last_n > 0 else None
            self.recent = collections.deque(list(history)[-n:] if n else history, maxlen=n)
        self.shapes = bool(p.logit_bias or p.presence_penalty or p.frequency_penalty or self.recent is not None)
        self.counts: torch.Tensor | None = None     # how often each token was picked (penalties)
        self.bias: torch.Tensor | None = None

    def shaped(self, x: torch.Tensor) -> torch.Tensor:
        """x with the request's bias and penalties added (a forbidden -inf stays -inf)."""
        if not self.shapes:
            return x
        p = self.p
        if self.bias is None:
            self.bias = torch.zeros(x.shape[0])
            self.counts = torch.zeros(x.shape[0])
            for tok, v in p.logit_bias:
                if tok < x.shape[0]:      # -100 bans the token, as OpenAI documents it
                    self.bias[tok] = v if v > -100 else float("-inf")
        adj = self.bias
        if p.frequency_penalty or p.presence_penalty:
            adj = adj - self.counts * p.frequency_penalty - (self.counts > 0).float() * p.presence_penalty
        out = x + adj
        if self.recent:
            idx = torch.tensor(sorted(set(self.recent)), dtype=torch.long)
            idx = idx[idx < out.shape[0]]
            v = out[idx]
            out[idx] = torch.where(v > 0, v / p.repeat_penalty, v * p.repeat_penalty)
        # a grammar's choice is never banned away: with nothing left, the grammar wins
        return out if bool(torch.isfinite(out).any()) else x

    def picked(self, tok: int) -> None:
        if self.counts is not None and tok < self.counts.shape[0]:
            self.counts[tok] += 1
        if self.recent is not None:
            self.recent.append(tok)

    def __call__(self, logits: torch.Tensor, masked: torch.Tensor | None = None
                 ) -> tuple[int, float, list[tuple[int, float]]]:
        """logits: float32 [V]; masked: the same with forbidden tokens at -inf (a grammar),
        sampled from instead. Returns (token, its logprob, top alternatives [(id, logprob)]),
        the log-probabilities always the model's own."""
        p = self.p
        logits = logits.float().cpu()
        if 0 < p.vocab < logits.shape[0]:     # padding rows (Qwen's embedding outgrows its tokenizer)
            logits = logits[:p.vocab]
            masked = masked[:p.vocab] if masked is not None else None
        pick = self.shaped(logits if masked is None else masked)
        if p.ignore_eos and masked is None and p.stop_ids:   # a grammar's own end is kept
            pick = pick.index_fill(0, torch.tensor(p.stop_ids), float("-inf"))
        if p.temperature <= 0:
            tok = int(torch.argmax(pick))
        else:
            x = pick / p.temperature
            if 0 < p.top_k < x.shape[0]:
                kth = torch.topk(x, p.top_k).values[-1]
                x = x.masked_fill(x < kth, float("-inf"))
            probs = torch.softmax(x, dim=-1)
            if p.min_p > 0:
                probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
            if p.top_p < 1.0:
                sp, si = torch.sort(probs, descending=True)
                cum = torch.cumsum(sp, dim=-1)
                drop = (cum - sp) > p.top_p * cum[-1]     # keep the smallest set reaching top_p
                sp = sp.masked_fill(drop, 0.0)
                probs = torch.zeros_like(probs).scatter_(0, si, sp)
            tok = int(torch.multinomial(probs, 1, generator=self.gen))
        self.picked(tok)
        lp = torch.log_softmax(logits, dim=-1)
        top = []
        if p.top_logprobs > 0:
            v, i = torch.topk(lp, p.top_logprobs)
            # equal values (common with bf16 logits) in id order, as argmax breaks ties, so
            # a greedy token is always the first alternative
            top = sorted(zip(i.tolist(), v.tolist()), key=lambda t: (-t[1], t[0]))
        return tok, float(lp[tok]), top


def sample_many(samplers: list[Sampler], rows: list[torch.Tensor], masks: list,
                together: bool | None = None) -> list[tuple]:
    """Sampler(row, mask) for each row. On a GPU, the greedy rows with nothing else asked (no
    grammar mask, no alternatives) are picked together where the logits are, and only their
    tokens and log-probabilities come to the host, in one copy: a row of logits each, and
    the host's small ops on them, cost more than the step itself there. The same argmax
    (first of equal values, as on the host) and log-softmax, in f32. together: whether such
    rows go together (None: where the rows are not on the CPU)."""
    out: list = [None] * len(rows)
    fast = [i for i, (s, m) in enumerate(zip(samplers, masks))
            if m is None and s.p.temperature <= 0 and s.p.top_logprobs == 0 and not s.shapes
            and (rows[i].device.type != "cpu" if together is None else together)]
    for vocab in {samplers[i].p.vocab for i in fast}:
        group = [i for i in fast if samplers[i].p.vocab == vocab]
        x = torch.stack([rows[i] for i in group]).float()                    # [G, V]
        if 0 < vocab < x.shape[1]:
            x = x[:, :vocab]
        lp = torch.log_softmax(x, dim=-1)
        pick = x
        for j, i in enumerate(group):
            p = samplers[i].p
            if p.ignore_eos and p.stop_ids:
                if pick is x:
                    pick = x.clone()
                pick[j, list(p.stop_ids)] = float("-inf")
        tok = pick.argmax(dim=-1)
        got = torch.stack([tok.double(), lp.gather(1, tok.unsqueeze(1)).squeeze(1).double()]).cpu()
        for j, i in enumerate(group):
            out[i] = (int(got[0, j]), float(got[1, j]), [])
    for i, s in enumerate(samplers):
        if out[i] is None:
            out[i] = s(rows[i], masks[i])
    return out
