"""The rules a request's sampling parameters must follow, for every API and the CLI."""
from __future__ import annotations

from common.messages import SamplingParams

MAX_TOP_LOGPROBS = 20


class ParamError(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


MAX_LOGIT_BIAS = 1024          # entries; OpenAI's own limit is lower, this bounds a message


def validate_sampling(p: SamplingParams, vocab: int = 0) -> None:
    """Raise ParamError(param, message) for arguments no request may carry; with `vocab`
    (the tokenizer's size) also for a logit_bias of a token the model does not have."""
    if p.max_tokens < 0:
        raise ParamError("max_tokens", "max_tokens must be >= 0")
    if not (p.temperature >= 0) or p.temperature > 100:
        raise ParamError("temperature", "temperature must be between 0 and 100")
    if not (0 < p.top_p <= 1):
        raise ParamError("top_p", "top_p must be in (0, 1]")
    if p.top_k < 0:
        raise ParamError("top_k", "top_k must be >= 0")
    if not (0 <= p.min_p <= 1):
        raise ParamError("min_p", "min_p must be in [0, 1]")
    if not (0 <= p.top_logprobs <= MAX_TOP_LOGPROBS):
        raise ParamError("top_logprobs", f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
    if not (0 < p.repeat_penalty <= 10):
        raise ParamError("repetition_penalty", "repetition_penalty must be in (0, 10]")
    if p.repeat_last_n < -1:
        raise ParamError("repeat_last_n", "repeat_last_n must be >= -1")
    for name in ("presence_penalty", "frequency_penalty"):
        if not (-2 <= getattr(p, name) <= 2):
            raise ParamError(name, f"{name} must be between -2 and 2")
    if len(p.logit_bias) > MAX_LOGIT_BIAS:
        raise ParamError("logit_bias", f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens")
    for tok, v in p.logit_bias:
        if not (-100 <= v <= 100):
            raise ParamError("logit_bias", f"logit_bias of token {tok} must be between -100 and 100")
        if tok < 0 or (vocab and tok >= vocab):
            raise ParamError("logit_bias", f"logit_bias names token {tok}, which is not in the model's "
                                           f"vocabulary ({vocab} tokens)" if vocab else
                             f"logit_bias names token {tok}, which is not a token id")
