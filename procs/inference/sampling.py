"""Token sampling: greedy at temperature 0, else temperature / top-k / top-p / min-p.

A request's seed drives its own torch.Generator, so a seeded run is reproducible whatever
else the process did before. Log-probabilities are the model's (log-softmax of the raw
logits), as OpenAI reports them, not of the filtered distribution.
"""
from __future__ import annotations

import torch

from common.messages import SamplingParams


class Sampler:
    def __init__(self, p: SamplingParams):
        self.p = p
        self.gen = None
        if p.temperature > 0:
            self.gen = torch.Generator(device="cpu")
            self.gen.manual_seed(p.seed if p.seed is not None else torch.seed() & 0x7FFF_FFFF_FFFF_FFFF)

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
        pick = logits if masked is None else masked
        if p.ignore_eos and masked is None and p.stop_ids:   # a grammar's own end is kept
            pick = logits.index_fill(0, torch.tensor(p.stop_ids), float("-inf"))
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
        lp = torch.log_softmax(logits, dim=-1)
        top = []
        if p.top_logprobs > 0:
            v, i = torch.topk(lp, p.top_logprobs)
            # equal values (common with bf16 logits) in id order, as argmax breaks ties, so
            # a greedy token is always the first alternative
            top = sorted(zip(i.tolist(), v.tolist()), key=lambda t: (-t[1], t[0]))
        return tok, float(lp[tok]), top
