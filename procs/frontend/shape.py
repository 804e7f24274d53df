"""Renderer events -> OpenAI response objects: chat.completion, text_completion and their
streamed chunks, usage, and logprobs in both OpenAI shapes.

Knows the OpenAI response schema; nothing of tokens beyond the strings and logprobs the
renderer already resolved. Plain dicts, encoded by msgspec.
"""
from __future__ import annotations

from common.messages import Delta, TokenLogprob, Usage

LOGPROB_FLOOR = -9999.0     # JSON has no -inf


def _lp(v: float) -> float:
    return v if v > LOGPROB_FLOOR else LOGPROB_FLOOR


def usage(u: Usage) -> dict:
    d = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
         "total_tokens": u.prompt_tokens + u.completion_tokens,
         "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}
    if u.reasoning_tokens:
        d["completion_tokens_details"] = {"reasoning_tokens": u.reasoning_tokens}
    return d


def chat_logprobs(lps) -> list[dict]:
    """The chat shape: {"content": [this list]}."""
    return [{"token": t.token, "logprob": _lp(t.logprob), "bytes": list(t.bytes),
             "top_logprobs": [{"token": s, "logprob": _lp(v), "bytes": list(b)} for s, b, v in t.top]}
            for t in lps]


class LegacyLogprobs:
    """The /v1/completions shape: tokens, token_logprobs, top_logprobs, text_offset;
    text_offset counts characters from the start of the completion."""

    def __init__(self):
        self.offset = 0

    def take(self, lps: tuple[TokenLogprob, ...]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t in lps:
            out["tokens"].append(t.token)
            out["token_logprobs"].append(_lp(t.logprob))
            top: dict[str, float] = {}
            for s, _, v in t.top:
                top.setdefault(s, _lp(v))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(t.token)
        return out


def merge_legacy(parts: list[dict]) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for p in parts:
        for k in out:
            out[k].extend(p[k])
    return out


def tool_calls(pieces) -> list[dict]:
    """Whole calls, in order, from ToolCallDelta pieces (arguments concatenated)."""
    calls: dict[int, dict] = {}
    for p in pieces:
        c = calls.setdefault(p.index, {"id": "", "type": "function",
                                       "function": {"name": "", "arguments": ""}})
        c["id"] = c["id"] or p.id
        c["function"]["name"] = c["function"]["name"] or p.name
        c["function"]["arguments"] += p.arguments
    return [calls[i] for i in sorted(calls)]


def stream_tool_calls(pieces) -> list[list[dict]]:
    """The chunk shape, one list per chunk: a chunk holds one entry per call, its pieces
    merged (a client may read `delta.tool_calls[0]` alone), and each call of the pieces
    goes in a chunk of its own. id, type and name ride on a call's first piece."""
    merged: dict[int, dict] = {}
    for p in pieces:
        d = merged.get(p.index)
        if d is None:
            d = merged[p.index] = {"index": p.index}
        if p.id:
            d.update(id=p.id, type="function")
            d["function"] = {"name": p.name, "arguments": d.get("function", {}).get("arguments", "")}
        d.setdefault("function", {"arguments": ""})["arguments"] += p.arguments
    return [[merged[i]] for i in sorted(merged)]


def delta_tool_calls(ev) -> tuple:
    return tuple(getattr(ev, "tool_calls", ()) or ())


class Collected:
    """A whole non-streamed answer, gathered from the events."""

    def __init__(self, legacy: bool):
        self.text: list[str] = []
        self.chat_lps: list[dict] = []
        self.legacy = LegacyLogprobs() if legacy else None
        self.legacy_parts: list[dict] = []
        self.calls: list = []
        self.reasoning: list[str] = []

    def add(self, ev: Delta, want_logprobs: bool) -> None:
        self.text.append(ev.text)
        self.reasoning.append(getattr(ev, "reasoning", ""))
        self.calls.extend(delta_tool_calls(ev))
        if want_logprobs and ev.logprobs:
            if self.legacy is not None:
                self.legacy_parts.append(self.legacy.take(ev.logprobs))
            else:
                self.chat_lps.extend(chat_logprobs(ev.logprobs))


def chat_completion(cid: str, created: int, model: str, col: Collected, want_logprobs: bool,
                    finish_reason: str, u: Usage) -> dict:
    text = "".join(col.text)
    message: dict = {"role": "assistant", "content": text if text or not col.calls else None}
    if col.calls:
        message["tool_calls"] = tool_calls(col.calls)
    reasoning = "".join(col.reasoning)
    if reasoning:      # as llama.cpp's and vLLM's servers return a reasoning model's thinking
        message["reasoning_content"] = reasoning
    message["refusal"] = None
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message,
                         "logprobs": {"content": col.chat_lps} if want_logprobs else None,
                         "finish_reason": finish_reason}],
            "usage": usage(u)}


def text_completion(cid: str, created: int, model: str, col: Collected, want_logprobs: bool,
                    finish_reason: str, u: Usage) -> dict:
    return {"id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": "".join(col.text),
                         "logprobs": merge_legacy(col.legacy_parts) if want_logprobs else None,
                         "finish_reason": finish_reason}],
            "usage": usage(u)}


class Chunks:
    """The streamed objects of one request, chat or completion."""

    def __init__(self, kind: str, cid: str, created: int, model: str, want_logprobs: bool,
                 include_usage: bool):
        self.chat = kind == "chat"
        self.head = {"id": cid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                     "created": created, "model": model}
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.legacy = LegacyLogprobs()

    def _chunk(self, choice: dict | None) -> dict:
        d = {**self.head, "choices": [choice] if choice is not None else []}
        if self.include_usage:
            d["usage"] = None
        return d

    def _choice(self, delta: dict | None, text: str, lps, finish: str | None) -> dict:
        logprobs = None
        if self.want_logprobs and lps:
            logprobs = {"content": chat_logprobs(lps)} if self.chat else self.legacy.take(lps)
        if self.chat:
            return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def first(self) -> dict | None:
        if not self.chat:
            return None
        return self._chunk(self._choice({"role": "assistant", "content": ""}, "", (), None))

    def delta(self, ev: Delta) -> list[dict]:
        """The chunks of one event: its text and logprobs with the first call's pieces, then
        one chunk for each further call."""
        calls = stream_tool_calls(delta_tool_calls(ev))
        reasoning = getattr(ev, "reasoning", "") if self.chat else ""
        if not ev.text and not ev.logprobs and not calls and not reasoning:
            return []
        delta: dict = {}
        if self.chat:
            if reasoning:
                delta["reasoning_content"] = reasoning
            if ev.text or not (calls or reasoning):
                delta["content"] = ev.text
            if calls:
                delta["tool_calls"] = calls[0]
        out = [self._chunk(self._choice(delta, ev.text, ev.logprobs, None))]
        if self.chat:
            out += [self._chunk(self._choice({"tool_calls": c}, "", (), None)) for c in calls[1:]]
        return out

    def final(self, finish_reason: str, finished_ev=None) -> list[dict]:
        out = []
        out.append(self._chunk(self._choice({} if self.chat else None, "", (), finish_reason)))
        return out

    def usage(self, u: Usage) -> dict:
        return {**self.head, "choices": [], "usage": usage(u)}
