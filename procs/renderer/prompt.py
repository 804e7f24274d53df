"""Turning requests into prompt bytes, and generated tokens back into text.

Knows text and tokens, nothing of tensors. The prompt bytes are what the token ids stand
for (their pieces concatenated), so they are also the cache text of any checkpoint taken
from them.
"""
from __future__ import annotations

import json

import numpy as np

from common import messages as m
from common.detok import Detokenizer
from common.policy import common_prefix
from procs.renderer import harmony, toolfmt, tools
from common.tokenizer import TextModel


class PromptError(ValueError):
    def __init__(self, param: str | None, message: str, code: str | None = None, status: int = 400,
                 prompt_tokens: int = 0, limit: int = 0):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status
        self.prompt_tokens, self.limit = prompt_tokens, limit


def _message_dict(msg: m.ChatMessage) -> dict:
    role = "system" if msg.role == "developer" else msg.role
    d = {"role": role, "content": msg.content}
    if msg.tool_calls:
        d["tool_calls"] = [{"id": c.id, "type": "function",
                            "function": {"name": c.function.name, "arguments": c.function.arguments}}
                           for c in msg.tool_calls]
    if msg.tool_call_id:
        d["tool_call_id"] = msg.tool_call_id
    if msg.name:
        d["name"] = msg.name
    if msg.reasoning:   # Qwen3's templates read reasoning_content; gpt-oss's `thinking`, which it
        d["reasoning_content"] = msg.reasoning      # refuses beside content on a call's message
        if not msg.content:
            d["thinking"] = msg.reasoning
    return d


# written after a continued message's text and cut there (private-use characters: no template
# alters them, and text found elsewhere, such as in the end-of-turn marker, is not taken for it)
CUT = "\ue000ricordo-continue\ue000"


def chat_messages(req: m.GenerateRequest, memory, index_sha1s, stats, fmt: toolfmt.Format) -> list[dict]:
    tool_list = json.loads(req.tools) if req.tools else []
    out = tools.prepare_messages([_message_dict(x) for x in req.messages], tool_list, memory,
                                 index_sha1s, stats, fmt)
    if req.continue_final and out:
        out[-1]["content"] += CUT
    return out


def _render(text: TextModel, req: m.GenerateRequest, msgs: list[dict], fmt: toolfmt.Format,
            add_generation_prompt: bool) -> str:
    """The template's text; a template that speaks tools gets them as `tools`. A template
    that writes the BOS itself (Llama 3's) loses it here: render() puts one in front when the
    model wants it, never two."""
    extra = {"tools": json.loads(req.tools)} if req.tools and fmt.native else {}
    if req.template_kwargs:       # checked by the web worker (fields.template_kwargs)
        extra.update(json.loads(req.template_kwargs))
    if req.reasoning_effort:      # a template that does not read it renders as before
        extra["reasoning_effort"] = req.reasoning_effort
    out = text.render_chat(msgs, add_generation_prompt=add_generation_prompt, **extra)
    bos = text.bos_text().decode("utf-8", "replace")
    return out[len(bos):] if bos and out.startswith(bos) else out


def tool_choice(req: m.GenerateRequest):
    """none | auto | required | {"type": "function", ...}; auto when tools are given alone."""
    if req.tool_choice:
        return json.loads(req.tool_choice)
    return "auto" if req.tools else "none"


def render(text: TextModel, req: m.GenerateRequest, memory=None, index_sha1s=(), stats=None) -> bytes:
    """The prompt bytes: template output (with tools, replayed calls and a call opener when
    tool_choice forces a call), or the raw prompt of a completion."""
    if req.kind == "completion":
        return text.bos_text() + req.prompt.encode("utf-8", "surrogatepass")
    fmt = toolfmt.detect(text.chat_template)
    if req.continue_final:
        _check_continued(req, fmt)
    gen = not req.continue_final
    stats = stats if stats is not None else tools.Rendered()
    msgs = chat_messages(req, memory, index_sha1s, stats, fmt)
    try:
        rendered = _render(text, req, msgs, fmt, gen)
        if stats.replays:
            rendered = harmony.replay(rendered, stats.replays)
            if rendered is None:
                raise ValueError("a replayed call's marker is not in the rendered prompt")
    except Exception as e:  # a template that raises on this conversation: the client's input
        if not (fmt.native and stats.memory + stats.disk):
            raise PromptError("messages", f"the chat template rejected the messages: {e}") from None
        # a replayed call is an assistant turn without tool_calls, which a template may refuse
        # (Mistral's check that user and assistant turns alternate): the calls from JSON then
        stats.reset()
        try:
            rendered = _render(text, req, chat_messages(req, None, (), stats, fmt), fmt, gen)
        except Exception as e2:
            raise PromptError("messages", f"the chat template rejected the messages: {e2}") from None
    if req.continue_final:
        rendered = _cut_after_last(rendered)
    elif fmt.kind == "harmony":
        rendered += harmony.opener(tool_choice(req), bool(req.response_format))
    elif req.tools:
        rendered += fmt.opener(tool_choice(req))
    return text.bos_text() + rendered.encode("utf-8", "surrogatepass")


def _check_continued(req: m.GenerateRequest, fmt: toolfmt.Format) -> None:
    """What a continued answer cannot be: constrained decoding starts from the answer's
    beginning, which the prefill has passed."""
    last = req.messages[-1] if req.messages else None
    if last is None or last.role != "assistant" or last.tool_calls or not last.content:
        raise PromptError("messages", "only a final assistant message with text can be continued")
    if isinstance(tool_choice(req), dict) or tool_choice(req) == "required":
        raise PromptError("tool_choice", "a forced tool call cannot continue an assistant message")
    if req.response_format:
        raise PromptError("response_format", "an answer held to a format cannot continue an assistant message")
    if req.tools and fmt.trigger in last.content:
        raise PromptError("messages", "an assistant message that opens a tool call cannot be continued")


def _cut_after_last(out: str) -> str:
    """The conversation rendered as finished, cut right after the last message's text (where
    CUT was written; transformers' continue_final_message cuts at the text itself)."""
    i = out.rfind(CUT)
    if i < 0:
        raise PromptError("messages", "the chat template does not render the final assistant message's text, "
                                      "so it cannot be continued")
    return out[:i]


def prefix_bytes(text: TextModel, req: m.GenerateRequest, prompt: bytes) -> int:
    """Byte length of the leading system part of a chat prompt (shared by every conversation
    of one agent), or 0 when there is none or it does not render as a prefix."""
    if req.kind != "chat":
        return 0
    n_lead = 0
    for msg in req.messages:
        if msg.role not in ("system", "developer"):
            break
        n_lead += 1
    if not req.tools and (not n_lead or n_lead == len(req.messages)):
        return 0
    fmt = toolfmt.detect(text.chat_template)
    head = m.GenerateRequest(rid="", kind="chat", sampling=req.sampling, messages=req.messages[:n_lead],
                             tools=req.tools, reasoning_effort=req.reasoning_effort,
                             template_kwargs=req.template_kwargs)
    lead = chat_messages(head, None, (), tools.Rendered(), fmt)
    if not lead and not (req.tools and fmt.native):
        return 0
    try:
        part = text.bos_text() + _render(text, head, lead, fmt, False).encode("utf-8", "surrogatepass")
    except Exception:
        return 0
    return len(part) if prompt.startswith(part) else 0


class TextStream:
    """Incremental text of a generation with stop strings: text that could be the start of
    a stop string is held back until it is known not to be one."""

    def __init__(self, text: TextModel, stops: tuple[str, ...]):
        self.detok = Detokenizer(text.pieces)
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False
        self.sent = 0           # UTF-8 bytes of the text returned so far (before a stop string)

    def push(self, tok: int) -> str:
        return self._count(self._emit(self.detok.push(tok)))

    def flush(self) -> str:
        out = self._emit(self.detok.flush())
        out += self.held if not self.stopped else ""
        self.held = ""
        return self._count(out)

    def _count(self, out: str) -> str:
        self.sent += len(out.encode("utf-8", "surrogateescape"))
        return out

    def _emit(self, new: str) -> str:
        if self.stopped:
            return ""
        buf = self.held + new
        if not self.stops:
            self.held = ""
            return buf
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self.held = ""
            return buf[:cut]
        keep = 0   # longest tail of buf that is a proper prefix of some stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]


def plan_reuse(text: TextModel, prompt: bytes, full: list[int], live: list[int],
               min_tokens: int, answer_from: int = 0) -> tuple[list[int], int]:
    """(effective prompt ids, live tokens to keep), in the pipeline's order of preference:
    live ids a prefix of the prompt's; live text a byte prefix of the prompt (the suffix is
    tokenized alone, live ids stay authoritative); longest common token prefix >= min, or
    the whole prompt when the live session extends it. answer_from (LiveSession's): a prefix
    that keeps the whole prompt of the session's last answer is that conversation's next
    turn, kept whatever its length (a template that renders another end of turn than the
    one sampled parts from the session a token or two before its end); 0: unknown."""
    if not live:
        return full, 0
    n = len(live)
    k = common_prefix(full, live)
    if k == n:
        return full, n
    live_text = text.piece_bytes(live)      # a tuple's bytes are remembered (TextModel)
    if prompt.startswith(live_text):
        return list(live) + text.encode(prompt[len(live_text):]), n
    # the live tokens whose text the prompt starts with, when they go further than the ids in
    # common: the session's text and the prompt part only near its end (a stop token the
    # template renders otherwise), while the tokens the model sampled part earlier from how
    # the prompt's text tokenizes
    j = _text_prefix_tokens(text, live, live_text, prompt)
    least = min(min_tokens, answer_from or min_tokens)
    if j > k and j >= least:
        return list(live[:j]) + text.encode(prompt[len(text.piece_bytes(live[:j])):]), j
    # the whole prompt inside the live session (a repeated request) is always worth keeping
    return full, (k if k >= least or k == len(full) else 0)


def _text_prefix_tokens(text: TextModel, live, live_text: bytes, prompt: bytes) -> int:
    """How many of the live tokens have their whole text at the prompt's start."""
    lo, hi = 0, min(len(live_text), len(prompt))     # bytes in common: lo always, hi + 1 never
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if live_text[:mid] == prompt[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return int(np.searchsorted(text.byte_ends(live), lo, side="right"))


def token_logprob(text: TextModel, tok: int, lp: float, top) -> m.TokenLogprob:
    def piece(i: int):
        b = text.pieces[i]
        return b.decode("utf-8", "replace"), tuple(b)
    s, b = piece(tok)
    return m.TokenLogprob(token=s, bytes=b, logprob=lp,
                          top=tuple((*piece(i), v) for i, v in top))
