"""The frontend's test double: FakeBackend, ZmqBackend's API answering from a script (no
renderer, no model), the default script, drive() (one request through the ASGI app
with a client that disconnects), and make() (the app over a FakeBackend, called through
Client) with the helpers that read its answers (sse, err); used by the frontend's unit tests
and the HTTP fuzz of tests/stress."""
from __future__ import annotations

import asyncio
import json

import httpx

from common.config import Settings
from common.messages import Accepted, Delta, Finished, GenerateRequest, Health, TokenLogprob, Usage
from procs.frontend.app import create_app

MODEL = "test-model"
USAGE = Usage(prompt_tokens=7, completion_tokens=3, cached_tokens=0)


def lp(tok: str, v: float, top=()) -> TokenLogprob:
    return TokenLogprob(token=tok, bytes=tuple(tok.encode()), logprob=v, top=tuple(top))


def ok_script(rid, req):
    """"Hello!" in three pieces with logprobs (the last one -inf), then stop."""
    return [Accepted(rid=rid, prompt_tokens=7),
            Delta(rid=rid, text="Hel", logprobs=(lp("Hel", -0.5, [("Hel", (72, 101, 108), -0.5), ("Hi", (72, 105), -1.5)]),)),
            Delta(rid=rid, text="lo", logprobs=(lp("lo", -0.25, [("lo", (108, 111), -0.25)]),)),
            Delta(rid=rid, text="!", logprobs=(lp("!", float("-inf")),)),
            Finished(rid=rid, finish_reason="stop", usage=USAGE)]


class FakeBackend:
    """ZmqBackend's API; `script(rid, req)` lists the events (a float = sleep that long,
    None = wait forever). It records the requests submitted, the rids cancelled and the rids
    whose event stream was closed (ended, or left by the app); health() answers
    `health_result`."""

    def __init__(self, script=ok_script, health=None):
        self.script = script
        self.requests: list[GenerateRequest] = []
        self.cancelled: list[str] = []
        self.closed: list[str] = []
        self.health_result = health or Health(rid="x", ready=True, model=MODEL, n_ctx=2048, device="cpu",
                                              dtype="float32")

    async def submit(self, req):
        self.requests.append(req)
        try:
            for ev in self.script(req.rid, req):
                if ev is None:
                    await asyncio.Event().wait()
                elif isinstance(ev, float):
                    await asyncio.sleep(ev)
                else:
                    yield ev
        finally:
            self.closed.append(req.rid)

    async def cancel(self, rid):
        self.cancelled.append(rid)

    async def health(self, timeout=1.0, slots=False):
        self.slots_asked = slots
        return self.health_result


class Resp:
    """An httpx response read to the end: status_code, headers, text, and json."""

    def __init__(self, r: httpx.Response):
        self.status_code, self.headers, self.text = r.status_code, r.headers, r.text

    @property
    def json(self):
        return json.loads(self.text)


async def drive(app, body: dict, after_first_body=None, disconnect_after: float | None = None,
                path: str = "/v1/chat/completions"):
    """Run one request through the ASGI app; the client disconnects once the first body chunk
    came (streamed) or after `disconnect_after` seconds."""
    raw = json.dumps(body).encode()
    gone = asyncio.Event()
    sent_body = False
    out = {"status": None, "chunks": []}

    async def receive():
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(msg):
        if msg["type"] == "http.response.start":
            out["status"] = msg["status"]
        elif msg["type"] == "http.response.body" and msg.get("body"):
            out["chunks"].append(msg["body"])
            if after_first_body is not None:
                gone.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json"),
                                                                (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 1234), "server": ("127.0.0.1", 80)}
    if disconnect_after is not None:
        asyncio.get_running_loop().call_later(disconnect_after, gone.set)
    await asyncio.wait_for(app(scope, receive, send), 5)
    return out


class Client:
    """Synchronous calls through httpx's ASGI transport (which, unlike falcon's TestClient,
    keeps the simulated client connected until the response is complete)."""

    def __init__(self, app):
        self.app = app

    def request(self, method, path, json=None, body=None, headers=None) -> Resp:
        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://t") as hc:
                return Resp(await hc.request(method, path, json=json, content=body, headers=headers))
        return asyncio.run(go())

    def simulate_post(self, path, **kw) -> Resp:
        return self.request("POST", path, **kw)

    def simulate_get(self, path, **kw) -> Resp:
        return self.request("GET", path, **kw)


def make(script=ok_script, **kw):
    s = Settings(model_id=MODEL, max_body_bytes=kw.pop("max_body_bytes", 1 << 16), **kw)
    be = FakeBackend(script)
    return be, Client(create_app(be, s))


def chat_body(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw}


def sse(text: str) -> list:
    """The data of each event; comments as ('comment', text)."""
    out = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        for line in block.split("\n"):
            if line.startswith(":"):
                out.append(("comment", line[1:].strip()))
            elif line.startswith("data: "):
                d = line[6:]
                out.append(d if d == "[DONE]" else json.loads(d))
    return out


def err(r, status, param=None, code=None, etype="invalid_request_error"):
    assert r.status_code == status, r.text
    e = r.json["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"]
    assert (e["type"], e["param"], e["code"]) == (etype, param, code), e
    return e
