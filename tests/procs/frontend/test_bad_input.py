"""Bad input to the web frontend, against a scripted fake backend: every malformed chat or
completion request is a 400 (413 for a body over the limit, 404 for an unknown model under
--strict-model-names, 500 for a bug) in OpenAI's error shape, naming the field, and no
request reaches the backend."""
from __future__ import annotations

import asyncio
import json

import pytest

from procs.frontend.schema import MAX_STOPS
from tests.procs.frontend.fakes import chat_body, err, make


# -- bad input ---------------------------------------------------------------------------

BAD_CHAT = [
    ({"messages": []}, "messages", None),
    ({}, "messages", None),
    ({"messages": "hi"}, "messages", None),
    ({"messages": ["hi"]}, "messages[0]", None),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", None),
    ({"messages": [{"content": "x"}]}, "messages[0].role", None),
    ({"messages": [{"role": "user"}]}, "messages[0].content", None),
    ({"messages": [{"role": "system", "content": None}]}, "messages[0].content", None),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type", None),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content", None),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}]},
     "messages[0].tool_calls[0].function.arguments", None),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", None),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls", None),
    (chat_body(n=2), "n", None),
    (chat_body(temperature="hot"), "temperature", None),
    (chat_body(temperature=-1), "temperature", None),
    (chat_body(top_p=0), "top_p", None),
    (chat_body(top_k=-1), "top_k", None),
    (chat_body(min_p=2), "min_p", None),
    (chat_body(max_tokens=-1), "max_tokens", None),
    (chat_body(max_tokens="5"), "max_tokens", None),
    (chat_body(max_completion_tokens=-2), "max_completion_tokens", None),
    (chat_body(max_tokens=True), "max_tokens", None),
    (chat_body(seed=1.5), "seed", None),
    (chat_body(seed=1 << 70), "seed", None),
    (chat_body(stop=[str(i) for i in range(MAX_STOPS + 1)]), "stop", None),
    (chat_body(stop=5), "stop", None),
    (chat_body(logprobs="yes"), "logprobs", None),
    (chat_body(logprobs=True, top_logprobs=21), "top_logprobs", None),
    (chat_body(top_logprobs=2), "top_logprobs", None),
    (chat_body(stream="yes"), "stream", None),
    (chat_body(stream=True, stream_options=[]), "stream_options", None),
    (chat_body(stream_options={"include_usage": True}), "stream_options", None),   # not streamed
    (chat_body(logit_bias={"12": 100.5}), "logit_bias", None),
    (chat_body(logit_bias={"-3": 1}), "logit_bias", None),
    (chat_body(logit_bias={"5": "high"}), "logit_bias", None),
    (chat_body(presence_penalty=2.01), "presence_penalty", None),
    (chat_body(frequency_penalty="x"), "frequency_penalty", None),
    (chat_body(repetition_penalty=0), "repetition_penalty", None),
    (chat_body(repeat_last_n=-2), "repeat_last_n", None),
    (chat_body(messages=[{"role": "user", "content": "hi"}, {"role": "assistant"}]), "messages[1].content", None),
    (chat_body(tools={"a": 1}), "tools", None),
    (chat_body(tool_choice=3), "tool_choice", None),
    (chat_body(model=3), "model", None),
]


@pytest.mark.parametrize("body,param,code", BAD_CHAT)
def test_bad_chat(body, param, code):
    be, c = make()
    err(c.simulate_post("/v1/chat/completions", json=body), 400, param, code)
    assert be.requests == []


BAD_COMPLETION = [
    ({}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, 2, 3]}, "prompt"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": "2"}, "logprobs"),
    ({"prompt": "x", "n": 3}, "n"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "temperature": 101}, "temperature"),
    ({"prompt": "x", "logit_bias": {"1": -101}}, "logit_bias"),
    ({"prompt": "x", "frequency_penalty": -2.5}, "frequency_penalty"),
]


@pytest.mark.parametrize("body,param", BAD_COMPLETION)
def test_bad_completion(body, param):
    be, c = make()
    err(c.simulate_post("/v1/completions", json=body), 400, param)


def test_bad_bodies():
    be, c = make(max_body_bytes=1000)
    for raw in (b"{nope", b"", b"[1, 2]", b'"x"', b'{"prompt": 1e999}', b'{"prompt": "\\ud800"}'):
        err(c.simulate_post("/v1/completions", body=raw, headers={"Content-Type": "application/json"}), 400)
    deep = b'{"a":' * 100000 + b"1" + b"}" * 100000
    err(make(max_body_bytes=1 << 20)[1].simulate_post("/v1/completions", body=deep), 400)
    big = json.dumps(chat_body(messages=[{"role": "user", "content": "x" * 2000}]))
    err(c.simulate_post("/v1/chat/completions", body=big), 413, None, "request_too_large")

    # no Content-Length: the limit holds while reading
    out = asyncio.run(raw_call(c.app, [b"{" + b" " * 600, b" " * 600 + b"}"]))
    assert out["status"] == 413 and json.loads(b"".join(out["chunks"]))["error"]["code"] == "request_too_large"
    e = err(make(strict_model_names=True)[1].simulate_post("/v1/chat/completions", json=chat_body(model="gpt-4")),
            404, "model", "model_not_found")
    assert "gpt-4" in e["message"]


def test_unexpected_exception_is_500():
    def broken(rid, req):
        raise RuntimeError("bug")
    be, c = make(broken)
    err(c.simulate_post("/v1/chat/completions", json=chat_body()), 500, etype="server_error")


async def raw_call(app, chunks: list[bytes], path="/v1/chat/completions"):
    """One POST through the ASGI app, the body in `chunks`, no Content-Length."""
    body = list(chunks)
    out = {"status": None, "chunks": []}

    async def receive():
        if body:
            return {"type": "http.request", "body": body.pop(0), "more_body": bool(body)}
        await asyncio.sleep(10)
        return {"type": "http.disconnect"}

    async def send(msg):
        if msg["type"] == "http.response.start":
            out["status"] = msg["status"]
        elif msg.get("body"):
            out["chunks"].append(msg["body"])
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80)}
    await asyncio.wait_for(app(scope, receive, send), 5)
    return out
