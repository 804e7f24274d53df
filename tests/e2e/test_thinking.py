"""A thinking model's template end to end (tests/data/templates/think.jinja over the default
model: its generation prompt opens `<think>`, as DeepSeek-R1's and Qwen3's thinking-only
templates do): what the model writes before `</think>` comes back as reasoning
(`reasoning_content`, a Responses reasoning item), the rest as the answer, whole and streamed
alike; the next turn renders the answer without its thinking and still reuses the prompt
before it from the live session."""
from __future__ import annotations

from pathlib import Path

import pytest

from .server import Server

openai = pytest.importorskip("openai")

TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "templates" / "think.jinja"
ASK = [{"role": "user", "content": "What is two plus two?"}]


@pytest.fixture(scope="module")
def client():
    # a common prefix this short is reused only under a lower --kv-cache-min-tokens than 512
    with Server(env={"RICORDO_CHAT_TEMPLATE_FILE": str(TEMPLATE), "RICORDO_CTX_SIZE": "2048",
                     "RICORDO_KV_CACHE_MIN_TOKENS": "8"}) as srv:
        yield srv.client()


def _expected(written: str) -> tuple[str, str]:
    """(reasoning, content) of the text the model wrote after the prompt's <think>."""
    for end in ("<|im_end|>", "<|endoftext|>"):
        written = written.split(end)[0]
    if "</think>" not in written:
        return written, ""
    think, rest = written.split("</think>", 1)
    return think, rest.lstrip("\r\n")


def test_the_thinking_is_reasoning_whole_and_streamed(client):
    r = client.chat.completions.create(model="m", messages=ASK, max_tokens=24, temperature=0, logprobs=True)
    c = r.choices[0]
    written = "".join(t.token for t in c.logprobs.content)
    want_r, want_c = _expected(written)
    assert want_r.strip(), f"the model wrote no thinking: {written!r}"
    assert c.message.reasoning_content == want_r and (c.message.content or "") == want_c
    stream = client.chat.completions.create(model="m", messages=ASK, max_tokens=24, temperature=0, stream=True)
    deltas = [ch.choices[0].delta for ch in stream if ch.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == want_r
    assert "".join(d.content or "" for d in deltas) == want_c
    resp = client.responses.create(model="m", input=ASK[0]["content"], max_output_tokens=24, temperature=0)
    assert resp.output[0].type == "reasoning" and resp.output[0].content[0].text == want_r
    # the tokens that wrote the thinking (a token held as a possible `</think>` is not counted)
    n = r.usage.completion_tokens_details.reasoning_tokens
    assert 0 < n <= r.usage.completion_tokens and (n == r.usage.completion_tokens) == (not want_c)
    assert resp.usage.output_tokens_details.reasoning_tokens == n


def test_the_next_turn_reuses_the_prompt_before_the_answer(client):
    r1 = client.chat.completions.create(model="m", messages=ASK, max_tokens=24, temperature=0)
    msg = r1.choices[0].message
    turn2 = ASK + [{"role": "assistant", "content": msg.content or ""}, {"role": "user", "content": "And three?"}]
    r2 = client.chat.completions.create(model="m", messages=turn2, max_tokens=4, temperature=0)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    # turn 1's prompt but its last few tokens (`assistant\n<think>\n`: the next turn writes the
    # answer's text there, which tokenizes with the newline), none of the thinking
    assert r1.usage.prompt_tokens - 5 <= cached < r1.usage.prompt_tokens + r1.usage.completion_tokens, \
        (r1.usage, r2.usage)


def test_reasoning_sent_back_is_rendered_and_reused(client):
    """An agent's loop: the answer's thinking comes back as reasoning_content with its call's
    result; the template renders it in the block (as Qwen3's does after the last user
    message), so the next turn reuses the thinking from the live session too."""
    ask = [{"role": "user", "content": "List the files here."}]
    r1 = client.chat.completions.create(model="m", messages=ask, max_tokens=24, temperature=0)
    msg, u1 = r1.choices[0].message, r1.usage
    assert msg.reasoning_content and u1.completion_tokens_details.reasoning_tokens > 4
    call = {"id": "call_ls", "type": "function", "function": {"name": "shell", "arguments": '{"cmd": "ls"}'}}
    turn2 = ask + [{"role": "assistant", "content": msg.content or "", "reasoning_content": msg.reasoning_content,
                    "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "call_ls", "content": "main.py\nREADME.md"}]
    r2 = client.chat.completions.create(model="m", messages=turn2, max_tokens=4, temperature=0)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    # the prompt and the thinking (but a token or two where the block's closing meets what was
    # sampled); without the reasoning the reuse ends before the thinking
    assert cached >= u1.prompt_tokens + u1.completion_tokens_details.reasoning_tokens - 2, (u1, r2.usage)
