"""The rules a request's sampling parameters must follow, for every API and the CLI."""
from __future__ import annotations

from common.messages import SamplingParams

MAX_TOP_LOGPROBS = 20


class ParamError(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def validate_sampling(p: SamplingParams) -> None:
    """Raise ParamError(param, message) for arguments no request may carry."""
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
