"""The web frontend against a scripted fake backend (no renderer, no model), and the ZeroMQ
backend against a fake renderer ROUTER."""
from __future__ import annotations

import asyncio
import json
import re

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio

from common.config import Settings
from common.messages import (Accepted, CancelRequest, Delta, Failed, Finished, GenerateRequest, Health, SlotState,
                             PingRequest, RendererIn, SamplingParams)
from common.sockets import RENDERER, address
from procs.frontend import fields, flow
from procs.frontend.app import create_app
from procs.frontend.backend import NOT_ANSWERING, ZmqBackend
from procs.frontend.fields import UNTIL_FULL
from procs.frontend.shape import LOGPROB_FLOOR
from tests.procs.frontend.fakes import MODEL, USAGE, Client, FakeBackend, chat_body, drive, err, make, sse


# -- chat ---------------------------------------------------------------------------------

def test_chat_whole():
    be, c = make()
    r = c.simulate_post("/v1/chat/completions", json=chat_body(max_tokens=5, temperature=0.7, top_p=0.9,
                                                               top_k=40, min_p=0.05, seed=3, stop="\n"))
    assert r.status_code == 200
    d = r.json
    assert d["object"] == "chat.completion" and d["id"].startswith("chatcmpl-") and d["model"] == MODEL
    ch = d["choices"][0]
    assert ch["index"] == 0 and ch["message"]["role"] == "assistant" and ch["message"]["content"] == "Hello!"
    assert ch["logprobs"] is None and ch["finish_reason"] == "stop"
    assert d["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                          "prompt_tokens_details": {"cached_tokens": 0}}
    req = be.requests[0]
    assert req.kind == "chat" and req.stop == ("\n",) and not req.logprobs
    assert req.sampling == SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=3)
    assert req.messages[0].role == "user" and req.messages[0].content == "hi"
    r = c.simulate_post("/v1/chat/completions", json=chat_body(max_tokens=5, ignore_eos=True))
    assert r.status_code == 200 and be.requests[-1].sampling.ignore_eos


def test_chat_defaults_and_message_forms():
    be, c = make()
    msgs = [{"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "developer", "content": "dev"},
            {"role": "user", "content": "q", "name": "bob"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\":1}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = c.simulate_post("/v1/chat/completions", json={"messages": msgs, "tools": tools, "tool_choice": "auto",
                                                      "max_completion_tokens": 9, "n": 1})
    assert r.status_code == 200, r.text
    req = be.requests[0]
    assert [m.role for m in req.messages] == ["system", "developer", "user", "assistant", "tool"]
    assert req.messages[0].content == "a\nb" and req.messages[2].name == "bob"
    call = req.messages[3].tool_calls[0]
    assert (call.id, call.function.name, call.function.arguments) == ("c1", "f", '{"x":1}')
    assert req.messages[3].content == "" and req.messages[4].tool_call_id == "c1"
    assert json.loads(req.tools) == tools and json.loads(req.tool_choice) == "auto"
    assert req.sampling.max_tokens == 9
    r = c.simulate_post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert be.requests[1].sampling.max_tokens == UNTIL_FULL and be.requests[1].tools == ""


def test_server_sampling_defaults_fill_what_a_request_leaves_out(monkeypatch):
    """--temp/--top-k/--top-p/--min-p/--seed (llama.cpp's flags) apply to every API when the
    request leaves the field out; what a request sets wins; a default no request could carry
    stops the server at start."""
    monkeypatch.setattr(fields, "DEFAULTS", fields.DEFAULTS)     # restored after the test
    be, c = make(temp=0.7, top_k=20, top_p=0.8, min_p=0.05, seed=5)
    assert c.simulate_post("/v1/chat/completions", json=chat_body()).status_code == 200
    assert c.simulate_post("/v1/chat/completions", json=chat_body(temperature=0, top_k=3, seed=9)).status_code == 200
    r = c.simulate_post("/v1/responses", json={"model": MODEL, "input": "hi"})
    assert r.status_code == 200, r.text
    r = c.simulate_post("/v1/messages", json={"model": MODEL, "max_tokens": 5, "temperature": 1,
                                              "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    got = [(q.sampling.temperature, q.sampling.top_k, q.sampling.top_p, q.sampling.min_p, q.sampling.seed)
           for q in be.requests]
    assert got == [(0.7, 20, 0.8, 0.05, 5), (0.0, 3, 0.8, 0.05, 9), (0.7, 20, 0.8, 0.05, 5), (1.0, 20, 0.8, 0.05, 5)]
    be, c = make()
    assert c.simulate_post("/v1/chat/completions", json=chat_body()).status_code == 200
    assert (be.requests[0].sampling.temperature, be.requests[0].sampling.seed) == (0.0, None)
    with pytest.raises(SystemExit, match="top_p"):
        make(top_p=0)


def test_chat_logprobs_whole():
    be, c = make()
    r = c.simulate_post("/v1/chat/completions", json=chat_body(logprobs=True, top_logprobs=2))
    assert r.status_code == 200
    content = r.json["choices"][0]["logprobs"]["content"]
    assert [x["token"] for x in content] == ["Hel", "lo", "!"]
    assert content[0] == {"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108],
                          "top_logprobs": [{"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108]},
                                           {"token": "Hi", "logprob": -1.5, "bytes": [72, 105]}]}
    assert content[2]["logprob"] == LOGPROB_FLOOR
    assert be.requests[0].logprobs and be.requests[0].sampling.top_logprobs == 2


def test_chat_stream():
    be, c = make()
    r = c.simulate_post("/v1/chat/completions", json=chat_body(stream=True, stream_options={"include_usage": True}))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    ev = sse(r.text)
    assert ev[-1] == "[DONE]"
    chunks = ev[:-1]
    for ch in chunks:
        assert ch["object"] == "chat.completion.chunk" and ch["model"] == MODEL and ch["id"] == chunks[0]["id"]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[0]["usage"] is None
    text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"])
    assert text == "Hello!"
    fin = chunks[-2]["choices"][0]
    assert fin["finish_reason"] == "stop" and fin["delta"] == {}
    assert all(ch["choices"][0]["finish_reason"] is None for ch in chunks[:-2])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 10
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_chat_stream_no_usage_and_logprobs():
    be, c = make()
    r = c.simulate_post("/v1/chat/completions", json=chat_body(stream=True, logprobs=True))
    ev = sse(r.text)
    assert ev[-1] == "[DONE]"
    assert all("usage" not in ch for ch in ev[:-1])
    assert ev[-2]["choices"][0]["finish_reason"] == "stop"
    assert ev[1]["choices"][0]["logprobs"]["content"][0]["token"] == "Hel"


def test_stream_keepalive(monkeypatch):
    monkeypatch.setattr(flow, "KEEPALIVE_S", 0.02)

    def slow(rid, req):
        return [Accepted(rid=rid, prompt_tokens=1), 0.15, Delta(rid=rid, text="x"),
                Finished(rid=rid, finish_reason="length", usage=USAGE)]
    be, c = make(slow)
    ev = sse(c.simulate_post("/v1/chat/completions", json=chat_body(stream=True)).text)
    assert ("comment", "keepalive") in ev
    assert ev[-1] == "[DONE]" and ev[-2]["choices"][0]["finish_reason"] == "length"


def test_failed_before_stream_is_http_error():
    def fail(rid, req):
        return [Failed(rid=rid, status=400, message="too long", code="context_length_exceeded", param="messages")]
    for stream in (False, True):
        be, c = make(fail)
        r = c.simulate_post("/v1/chat/completions", json=chat_body(stream=stream))
        err(r, 400, "messages", "context_length_exceeded")
        assert r.headers["content-type"].startswith("application/json")

    def busy(rid, req):
        return [Failed(rid=rid, status=429, message="busy", code="queue_full", err_type="rate_limit_error")]
    be, c = make(busy)
    err(c.simulate_post("/v1/completions", json={"prompt": "x", "stream": True}), 429, None, "queue_full",
        "rate_limit_error")


def test_failed_after_stream_start():
    def mid(rid, req):
        return [Accepted(rid=rid, prompt_tokens=1), Delta(rid=rid, text="a"),
                Failed(rid=rid, status=500, message="boom", err_type="server_error")]
    be, c = make(mid)
    r = c.simulate_post("/v1/chat/completions", json=chat_body(stream=True))
    assert r.status_code == 200
    ev = sse(r.text)
    assert "[DONE]" not in ev
    assert ev[-1] == {"error": {"message": "boom", "type": "server_error", "param": None, "code": None}}
    assert ev[1]["choices"][0]["delta"] == {"content": "a"}
    assert be.cancelled == []      # it ended; nothing to cancel


# -- completions --------------------------------------------------------------------------

def test_completions_whole_and_logprobs():
    be, c = make()
    r = c.simulate_post("/v1/completions", json={"model": MODEL, "prompt": ["Once"], "max_tokens": 3,
                                                 "logprobs": 2})
    assert r.status_code == 200, r.text
    d = r.json
    assert d["object"] == "text_completion" and d["id"].startswith("cmpl-")
    ch = d["choices"][0]
    assert ch["text"] == "Hello!" and ch["index"] == 0 and ch["finish_reason"] == "stop"
    assert ch["logprobs"] == {"tokens": ["Hel", "lo", "!"], "token_logprobs": [-0.5, -0.25, LOGPROB_FLOOR],
                              "top_logprobs": [{"Hel": -0.5, "Hi": -1.5}, {"lo": -0.25}, {}],
                              "text_offset": [0, 3, 5]}
    assert d["usage"]["total_tokens"] == 10
    req = be.requests[0]
    assert req.kind == "completion" and req.prompt == "Once" and req.logprobs and req.sampling.top_logprobs == 2
    r = c.simulate_post("/v1/completions", json={"prompt": "x"})
    assert r.json["choices"][0]["logprobs"] is None and not be.requests[1].logprobs


def test_completions_stream():
    be, c = make()
    r = c.simulate_post("/v1/completions", json={"prompt": "x", "stream": True, "logprobs": 0,
                                                 "stream_options": {"include_usage": True}})
    ev = sse(r.text)
    assert ev[-1] == "[DONE]"
    assert all(e["object"] == "text_completion" for e in ev[:-1])
    assert "".join(e["choices"][0]["text"] for e in ev[:-1] if e["choices"]) == "Hello!"
    assert ev[0]["choices"][0]["logprobs"]["tokens"] == ["Hel"]
    assert ev[1]["choices"][0]["logprobs"]["text_offset"] == [3]
    assert ev[-3]["choices"][0]["finish_reason"] == "stop"
    assert ev[-2]["choices"] == [] and ev[-2]["usage"]["completion_tokens"] == 3


# -- models, health, routing, auth ---------------------------------------------------------

def test_models():
    be, c = make()
    d = c.simulate_get("/v1/models").json
    assert d["object"] == "list" and [m["id"] for m in d["data"]] == [MODEL]
    assert d["data"][0]["object"] == "model"
    assert c.simulate_get(f"/v1/models/{MODEL}").json["id"] == MODEL
    # any name is served by the loaded model, so any name can be retrieved; not when strict
    assert c.simulate_get("/v1/models/gpt-4o").json == {**d["data"][0], "id": "gpt-4o"}
    _, strict = make(strict_model_names=True)
    err(strict.simulate_get("/v1/models/other"), 404, "model", "model_not_found")
    # the Anthropic client's list shape, told by its anthropic-version header
    a = c.simulate_get("/v1/models", headers={"anthropic-version": "2023-06-01"}).json
    assert a["has_more"] is False and a["first_id"] == a["last_id"] == MODEL
    [card] = a["data"]
    assert card["type"] == "model" and card["id"] == card["display_name"] == MODEL
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", card["created_at"])
    one = c.simulate_get("/v1/models/claude-sonnet-4-5", headers={"anthropic-version": "2023-06-01"}).json
    assert one["type"] == "model" and one["id"] == "claude-sonnet-4-5"
    # and its errors in Anthropic's shape
    r = strict.simulate_get("/v1/models/other", headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == 404 and r.json["type"] == "error" and r.json["error"]["type"] == "not_found_error", r.json


def test_health():
    be, c = make()
    r = c.simulate_get("/health")
    assert r.status_code == 200
    assert r.json == {"status": "ok", "model": MODEL, "n_ctx": 2048, "device": "cpu", "dtype": "float32"}
    be.health_result = Health(rid="x", ready=False, detail="inference process not answering yet")
    r = c.simulate_get("/health")
    assert r.status_code == 503 and r.json["status"] == "loading" and r.json["detail"]
    be.health_result = Health(rid="x", ready=False, detail=NOT_ANSWERING)
    r = c.simulate_get("/health")
    assert r.status_code == 503 and r.json == {"status": "unavailable", "detail": NOT_ANSWERING}


def test_slots():
    """GET /slots shapes the renderer's sessions (llama.cpp's keys where they mean the same);
    ?fail_on_no_slot=1 is a 503 while --parallel jobs run; --no-slots is a 501."""
    be, c = make()
    states = (SlotState(sid=3, n_tokens=900, rid="r1", n_decoded=5, on_disk=512), SlotState(sid=1, n_tokens=40),
              SlotState(sid=0, n_tokens=70, rid="r2", n_decoded=1))
    be.health_result = Health(rid="x", ready=True, n_ctx=2048, slots=states, parallel=2, queued=1)
    r = c.simulate_get("/slots")
    assert r.status_code == 200 and be.slots_asked
    assert r.json == [
        {"id": 3, "n_ctx": 2048, "is_processing": True, "id_task": "r1", "n_tokens": 900, "n_decoded": 5,
         "on_disk_tokens": 512},
        {"id": 1, "n_ctx": 2048, "is_processing": False, "id_task": None, "n_tokens": 40, "n_decoded": 0,
         "on_disk_tokens": 0},
        {"id": None, "n_ctx": 2048, "is_processing": True, "id_task": "r2", "n_tokens": 70, "n_decoded": 1,
         "on_disk_tokens": 0}]
    e = err(c.simulate_get("/slots?fail_on_no_slot=1"), 503, None, "no_slot_available", "server_error")
    assert "2 of 2" in e["message"]
    be.health_result = Health(rid="x", ready=True, n_ctx=2048, slots=states[1:], parallel=2)
    assert c.simulate_get("/slots?fail_on_no_slot=1").status_code == 200
    be.health_result = Health(rid="x", ready=False, detail="waiting for the inference process")
    err(c.simulate_get("/slots"), 503, None, "model_not_ready", "server_error")
    be, c = make(slots=False)
    err(c.simulate_get("/slots"), 501, None, "not_supported", "server_error")


def test_routing_errors():
    be, c = make()
    e = err(c.simulate_get("/v1/nothing"), 404)
    assert "/v1/nothing" in e["message"]
    r = c.simulate_get("/v1/chat/completions")
    err(r, 405)
    assert "POST" in r.headers["allow"]


def test_api_key():
    be = FakeBackend()
    c = Client(create_app(be, Settings(model_id=MODEL, api_key="sekrit")))
    err(c.simulate_get("/v1/models"), 401, None, "invalid_api_key", "authentication_error")
    err(c.simulate_post("/v1/chat/completions", json=chat_body(), headers={"Authorization": "Bearer nope"}),
        401, None, "invalid_api_key", "authentication_error")
    assert c.simulate_get("/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200
    r = c.simulate_post("/v1/chat/completions", json=chat_body(), headers={"Authorization": "Bearer sekrit"})
    assert r.status_code == 200
    assert c.simulate_get("/health").status_code == 200
    assert be.requests and len(be.requests) == 1


# -- disconnect ---------------------------------------------------------------------------

def hang(rid, req):
    return [Accepted(rid=rid, prompt_tokens=1), Delta(rid=rid, text="a"), None]


def test_disconnect_mid_stream_cancels():
    be = FakeBackend(hang)
    app = create_app(be, Settings(model_id=MODEL))
    out = asyncio.run(drive(app, chat_body(stream=True), after_first_body=True))
    assert out["status"] == 200
    assert be.cancelled == [be.requests[0].rid] and be.closed == [be.requests[0].rid]


def test_disconnect_while_waiting_whole_cancels():
    be = FakeBackend(hang)
    app = create_app(be, Settings(model_id=MODEL))
    asyncio.run(drive(app, chat_body(), disconnect_after=0.05))
    assert be.cancelled == [be.requests[0].rid] and be.closed == [be.requests[0].rid]


def test_disconnect_before_accepted_cancels():
    be = FakeBackend(lambda rid, req: [None])
    app = create_app(be, Settings(model_id=MODEL))
    asyncio.run(drive(app, chat_body(stream=True), disconnect_after=0.05))
    assert be.cancelled == [be.requests[0].rid]


# -- the official client -------------------------------------------------------------------

def test_openai_client_parses():
    openai = pytest.importorskip("openai")
    be = FakeBackend()
    app = create_app(be, Settings(model_id=MODEL, api_key="k"))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as hc:
            cl = openai.AsyncOpenAI(base_url="http://t/v1", api_key="k", http_client=hc, max_retries=0)
            r = await cl.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 logprobs=True, top_logprobs=1)
            assert r.choices[0].message.content == "Hello!" and r.usage.total_tokens == 10
            assert r.usage.prompt_tokens_details.cached_tokens == 0
            assert r.choices[0].logprobs.content[0].top_logprobs[1].token == "Hi"
            s = await cl.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 stream=True, stream_options={"include_usage": True})
            parts, usage = [], None
            async for ch in s:
                if ch.choices:
                    parts.append(ch.choices[0].delta.content or "")
                if ch.usage:
                    usage = ch.usage
            assert "".join(parts) == "Hello!" and usage.completion_tokens == 3
            t = await cl.completions.create(model=MODEL, prompt="x", logprobs=1)
            assert t.choices[0].text == "Hello!" and t.choices[0].logprobs.tokens == ["Hel", "lo", "!"]
            models = await cl.models.list()
            assert [m.id async for m in models] == [MODEL]
            other = await cl.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
            assert other.model == MODEL             # the loaded model serves any name and names itself
            with pytest.raises(openai.BadRequestError) as ei:
                await cl.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=2)
            assert ei.value.param == "n"
            bad = openai.AsyncOpenAI(base_url="http://t/v1", api_key="wrong", http_client=hc, max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await bad.models.list()
    asyncio.run(go())


# -- ZmqBackend against a fake renderer ------------------------------------------------------

def test_zmq_backend(tmp_path):
    s = Settings(run_dir=str(tmp_path))

    async def go():
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(address(s, RENDERER))
        dec, enc = msgspec.msgpack.Decoder(RendererIn), msgspec.msgpack.Encoder()
        seen, held = [], set()

        async def renderer():
            while True:
                route, raw = await router.recv_multipart()
                msg = dec.decode(raw)
                seen.append(msg)
                if isinstance(msg, PingRequest):
                    out = [Health(rid=msg.rid, ready=True, model="m", n_ctx=99, holds=msg.about in held)]
                elif isinstance(msg, GenerateRequest) and msg.prompt == "hang":
                    held.add(msg.rid)
                    out = [Accepted(rid=msg.rid, prompt_tokens=1)]
                elif isinstance(msg, GenerateRequest):
                    out = [Accepted(rid=msg.rid, prompt_tokens=2), Delta(rid="someone-else", text="?"),
                           Delta(rid=msg.rid, text="hi"), Finished(rid=msg.rid, finish_reason="stop", usage=USAGE)]
                else:
                    out = []
                for m in out:
                    await router.send_multipart([route, enc.encode(m)])
        task = asyncio.create_task(renderer())
        be = ZmqBackend(s, idle_check=0.2, idle_ping_timeout=0.5)
        try:
            await be.start()
            h = await be.health(timeout=2.0)
            assert h.ready and h.n_ctx == 99
            req = GenerateRequest(rid="r1", kind="completion", sampling=SamplingParams(), prompt="x")
            evs = [ev async for ev in be.submit(req)]
            assert [type(e) for e in evs] == [Accepted, Delta, Finished] and evs[1].text == "hi"
            # a request left early is cancelled
            it = be.submit(GenerateRequest(rid="r2", kind="completion", sampling=SamplingParams(), prompt="hang"))
            assert isinstance(await it.__anext__(), Accepted)
            await it.aclose()
            await asyncio.sleep(0.05)
            assert any(isinstance(m, CancelRequest) and m.rid == "r2" for m in seen)
            await be.cancel("r3")
            await asyncio.sleep(0.05)
            assert any(isinstance(m, CancelRequest) and m.rid == "r3" for m in seen)
            # a request the renderer holds outlives idle checks; one it lost (a restarted
            # renderer) fails with a 503 at the next check
            it = be.submit(GenerateRequest(rid="r5", kind="completion", sampling=SamplingParams(), prompt="hang"))
            assert isinstance(await it.__anext__(), Accepted)
            nxt = asyncio.ensure_future(it.__anext__())
            await asyncio.sleep(0.7)
            assert not nxt.done()
            assert sum(isinstance(m, PingRequest) and m.about == "r5" for m in seen) >= 2
            held.discard("r5")
            ev = await asyncio.wait_for(nxt, 2)
            assert isinstance(ev, Failed) and ev.status == 503 and "restarted" in ev.message
            await it.aclose()
            # the renderer dies while a request waits: the idle check notices and fails it
            it = be.submit(GenerateRequest(rid="r4", kind="completion", sampling=SamplingParams(), prompt="hang"))
            assert isinstance(await it.__anext__(), Accepted)
            task.cancel()
            ev = await asyncio.wait_for(it.__anext__(), 3)
            assert isinstance(ev, Failed) and ev.status == 503
            await it.aclose()
        finally:
            task.cancel()
            await be.close()
            router.close(0)
            ctx.term()
    asyncio.run(go())


def test_zmq_backend_no_renderer(tmp_path):
    s = Settings(run_dir=str(tmp_path))

    async def go():
        be = ZmqBackend(s, send_timeout=0.1)
        try:
            h = await be.health(timeout=0.2)
            assert not h.ready and h.detail == NOT_ANSWERING
            evs = [e async for e in be.submit(GenerateRequest(rid="r", kind="completion",
                                                              sampling=SamplingParams(), prompt="x"))]
            assert len(evs) == 1 and isinstance(evs[0], Failed) and evs[0].status == 503
        finally:
            await be.close()
    asyncio.run(go())


def test_logit_bias_and_penalties_reach_the_request():
    be, c = make()
    r = c.simulate_post("/v1/chat/completions", json=chat_body(logit_bias={"12": 5, "3": -100}, presence_penalty=0.5,
                                                                frequency_penalty=-1))
    assert r.status_code == 200
    p = be.requests[0].sampling
    assert (p.logit_bias, p.presence_penalty, p.frequency_penalty) == (((3, -100.0), (12, 5.0)), 0.5, -1.0)
    assert (p.repeat_penalty, p.repeat_last_n) == (1.0, 64)          # the server's defaults
    c.simulate_post("/v1/chat/completions", json=chat_body(repetition_penalty=1.1, repeat_last_n=-1))
    c.simulate_post("/v1/completions", json={"prompt": "x", "repeat_penalty": 1.3})     # llama.cpp's name
    assert [(r.sampling.repeat_penalty, r.sampling.repeat_last_n) for r in be.requests[1:]] == [(1.1, -1), (1.3, 64)]
    be2, c2 = make(repeat_penalty=1.05, repeat_last_n=32)             # --repeat-penalty, --repeat-last-n
    c2.simulate_post("/v1/chat/completions", json=chat_body())
    assert (be2.requests[0].sampling.repeat_penalty, be2.requests[0].sampling.repeat_last_n) == (1.05, 32)
