"""The web side of readiness: /v1/models answers only when the server is ready, a
request told to wait (Waiting) starts its stream with keepalives instead of an error, and
the ZeroMQ backend waits (bounded) for a renderer that is not there yet."""
from __future__ import annotations

import asyncio

import msgspec
import zmq
import zmq.asyncio

from common.config import Settings
from common.messages import (Accepted, Delta, Failed, Finished, GenerateRequest, Health, RendererIn,
                             SamplingParams, Waiting)
from common.sockets import RENDERER, address
from procs.frontend import flow
from procs.frontend.backend import NO_RENDERER_YET, ZmqBackend

from tests.procs.frontend.fakes import MODEL, USAGE, chat_body, err, make, sse

NOT_READY = Health(rid="x", ready=False, detail="waiting for the disk cache index from the persister")


def waiting_script(rid, req):
    return [Waiting(rid=rid, detail="waiting for the inference process (starting: loading its model)"), 0.15,
            Accepted(rid=rid, prompt_tokens=4), Delta(rid=rid, text="x"),
            Finished(rid=rid, finish_reason="length", usage=USAGE)]


def test_models_answer_only_when_ready():
    be, c = make()
    be.health_result = NOT_READY
    for path in ("/v1/models", f"/v1/models/{MODEL}"):
        r = c.simulate_get(path)
        e = err(r, 503, None, "model_not_ready", "server_error")
        assert "persister" in e["message"] and r.headers["retry-after"] == "1"
    r = c.simulate_get("/health")
    assert r.status_code == 503 and r.json == {"status": "loading", "detail": NOT_READY.detail}
    be.health_result = Health(rid="x", ready=True, model=MODEL, n_ctx=2048, device="cpu", dtype="float32")
    assert c.simulate_get("/v1/models").status_code == 200
    assert c.simulate_get(f"/v1/models/{MODEL}").json["id"] == MODEL


def test_a_waiting_request_streams_keepalives_then_its_answer(monkeypatch):
    monkeypatch.setattr(flow, "KEEPALIVE_S", 0.02)
    be, c = make(waiting_script)
    r = c.simulate_post("/v1/chat/completions", json=chat_body(stream=True))
    ev = sse(r.text)
    assert r.status_code == 200 and ("comment", "keepalive") in ev
    assert "".join(x["choices"][0]["delta"].get("content") or "" for x in ev
                   if isinstance(x, dict) and x.get("choices")) == "x"
    assert ev[-1] == "[DONE]"
    r = c.simulate_post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 200 and r.json["choices"][0]["message"]["content"] == "x"
    r = c.simulate_post("/v1/messages", json={"model": MODEL, "max_tokens": 4, "stream": True,
                                              "messages": [{"role": "user", "content": "hi"}]})
    # keepalives (SSE comments) while it waits, message_start when the model begins
    assert r.status_code == 200 and r.text.count(": keepalive") >= 2
    assert r.text.index(": keepalive") < r.text.index("event: message_start")
    assert "message_stop" in r.text


def test_backend_waits_for_a_renderer_that_comes_late(tmp_path):
    s = Settings(run_dir=str(tmp_path))

    async def go():
        be = ZmqBackend(s, wait_notice=0.05, send_timeout=10.0)
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        try:
            it = be.submit(GenerateRequest(rid="r1", kind="completion", sampling=SamplingParams(), prompt="x"))
            first = await it.__anext__()
            assert isinstance(first, Waiting) and first.detail == NO_RENDERER_YET
            nxt = asyncio.ensure_future(it.__anext__())
            router.bind(address(s, RENDERER))          # the renderer starts now
            route, raw = await asyncio.wait_for(router.recv_multipart(), 5)
            req = msgspec.msgpack.Decoder(RendererIn).decode(raw)
            assert isinstance(req, GenerateRequest) and req.rid == "r1"
            enc = msgspec.msgpack.Encoder()
            for m in (Accepted(rid="r1", prompt_tokens=1), Delta(rid="r1", text="hi"),
                      Finished(rid="r1", finish_reason="stop", usage=USAGE)):
                await router.send_multipart([route, enc.encode(m)])
            evs = [await asyncio.wait_for(nxt, 5)] + [e async for e in it]
            assert [type(e) for e in evs] == [Accepted, Delta, Finished]
            # bounded: with no renderer at all the request fails with a 503 after send_timeout
            router.close(0)
            be2 = ZmqBackend(Settings(run_dir=str(tmp_path / "none")), wait_notice=0.05, send_timeout=0.3)
            evs = [e async for e in be2.submit(GenerateRequest(rid="r2", kind="completion",
                                                              sampling=SamplingParams(), prompt="x"))]
            assert [type(e) for e in evs] == [Waiting, Failed] and evs[1].status == 503
            await be2.close()
        finally:
            await be.close()
            router.close(0)
            ctx.term()
    asyncio.run(go())
