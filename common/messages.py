"""Every ZeroMQ message, as msgspec Structs (tagged unions per socket). No pickle anywhere."""
from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, frozen=True):
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    top_logprobs: int = 0
    stop_ids: tuple[int, ...] = ()


def validate_sampling(p: SamplingParams) -> None:
    """Raise ValueError(param, message) for arguments no request may carry."""
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
    if not (0 <= p.top_logprobs <= 20):
        raise ParamError("top_logprobs", "top_logprobs must be between 0 and 20")


class ParamError(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
