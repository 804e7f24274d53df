"""4. Bad HTTP input: hypothesis over every endpoint, every method, near-valid and arbitrary
JSON bodies, raw bytes (invalid UTF-8), huge numbers, deep nesting, huge bodies, slow and
stalled clients. Only 2xx and 4xx answers, never 5xx; no process dies; a slow client never
holds up the others.

Volume runs on the frontend app with its real schema over httpx's ASGI transport and a fake
backend (no model); a smaller run, and the transport-level cases, hit the real server.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.parse

import httpx
import pytest

from .conftest import FULL, Stats, full_only, scale

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st   # noqa: E402

from common.config import Settings                                       # noqa: E402
from procs.frontend.app import create_app                                # noqa: E402
from tests.procs.frontend.fakes import FakeBackend                       # noqa: E402

MODEL = "test-model"
ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/models",
          f"/v1/models/{MODEL}", "/health", "/metrics", "/slots"]
# the fake app has no metrics directory (get_app() makes one): /metrics only on the real server
ASGI_ROUTES = [r for r in ROUTES if r != "/metrics"]
POSTS = ROUTES[:4]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
# huge, but float() of them works: ints beyond ~1.8e308 are the known OverflowError (see below)
BIG = 2 ** 1000

scalars = (st.none() | st.booleans() | st.integers(min_value=-BIG, max_value=BIG)
           | st.sampled_from([0, -1, 1, 2 ** 31, 2 ** 63, 2 ** 64, -(2 ** 63) - 1, 10 ** 30])
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40)
           | st.sampled_from(["", "user", "assistant", "system", "tool", "function", "text", "auto", "none",
                              "required", "any", "../../etc/passwd", "\x00", "\ud7ff", "🙂" * 3]))
values = st.recursive(scalars, lambda ch: st.lists(ch, max_size=4) | st.dictionaries(st.text(max_size=12), ch,
                                                                                      max_size=4), max_leaves=16)
role = st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "bot", ""]) | values
text_part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_text", "tool_result"]) | values,
                                   "text": st.text(max_size=30) | values})
content = st.text(max_size=60) | st.lists(text_part, max_size=3) | values
tool_call = st.fixed_dictionaries({"id": st.text(max_size=20) | values, "type": st.just("function") | values,
                                   "function": st.fixed_dictionaries({"name": st.text(max_size=12) | values,
                                                                      "arguments": st.text(max_size=40) | values})})
message = st.fixed_dictionaries({"role": role, "content": content},
                                optional={"tool_calls": st.lists(tool_call, max_size=2) | values,
                                          "tool_call_id": st.text(max_size=20) | values, "name": values})
tool = st.fixed_dictionaries({"type": st.just("function") | values,
                              "function": st.fixed_dictionaries({"name": st.from_regex(r"[a-z_]{1,10}", fullmatch=True) | values},
                                                                optional={"parameters": values, "description": values})})
anth_tool = st.fixed_dictionaries({"name": st.from_regex(r"[a-z_]{1,10}", fullmatch=True) | values},
                                  optional={"input_schema": values, "description": values})
resp_item = st.fixed_dictionaries({"type": st.sampled_from(["message", "function_call", "function_call_output"]) | values},
                                  optional={"role": role, "content": content, "call_id": values, "name": values,
                                            "arguments": values, "output": values})

COMMON = {"temperature": values, "top_p": values, "stream": st.booleans() | values, "model": st.just(MODEL) | values,
          "seed": values, "user": values, "metadata": values}
FIELDS = {
    "/v1/chat/completions": dict(COMMON, messages=st.lists(message, max_size=4) | values, max_tokens=values,
                                 max_completion_tokens=values, top_k=values, min_p=values, stop=values, n=values,
                                 logprobs=values, top_logprobs=values, stream_options=values,
                                 tools=st.lists(tool, max_size=2) | values, tool_choice=values,
                                 response_format=values, logit_bias=values, presence_penalty=values,
                                 frequency_penalty=values),
    "/v1/completions": dict(COMMON, prompt=st.text(max_size=80) | values, max_tokens=values, echo=values,
                            best_of=values, suffix=values, logprobs=values, stop=values, n=values, min_p=values,
                            logit_bias=values, frequency_penalty=values),
    "/v1/responses": dict(COMMON, input=st.text(max_size=60) | st.lists(resp_item, max_size=3) | values,
                          instructions=values, max_output_tokens=values, tools=values, tool_choice=values,
                          previous_response_id=values, background=values, text=values, store=values),
    "/v1/messages": dict(COMMON, messages=st.lists(message, max_size=3) | values, max_tokens=values, system=values,
                         tools=st.lists(anth_tool, max_size=2) | values, tool_choice=values,
                         stop_sequences=values, top_k=values),
}
VALID = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 1},
    "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 1},
    "/v1/messages": {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]},
}


@st.composite
def json_body(draw, path):
    """A near-valid body: the valid one with fields changed, added or removed."""
    body = dict(VALID[path])
    fields = FIELDS[path]
    for key in draw(st.lists(st.sampled_from(sorted(fields)), max_size=5, unique=True)):
        body[key] = draw(fields[key])
    for key in draw(st.lists(st.sampled_from(sorted(body)), max_size=2, unique=True)):
        body.pop(key, None)
    return body


def nested(depth: int, kind: str) -> bytes:
    if kind == "list":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


@st.composite
def raw_body(draw):
    kind = draw(st.sampled_from(["binary", "utf8-broken", "numbers", "nested", "truncated", "not-object"]))
    if kind == "binary":
        return draw(st.binary(max_size=200))
    if kind == "utf8-broken":
        good = json.dumps(VALID["/v1/chat/completions"]).encode()
        cut = draw(st.integers(0, len(good)))
        return good[:cut] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80"])) + good[cut:]
    if kind == "numbers":
        # (an integer literal beyond float range in a float field is the known OverflowError,
        # test_huge_integer_in_a_float_field; "1" * 300 is huge but fits a float)
        num = draw(st.sampled_from(["1e999", "-1e400", "1" * 300, "-" + "9" * 40, "1e-400", "0." + "0" * 500 + "1",
                                    "18446744073709551616", "NaN", "Infinity", "-0"]))
        key = draw(st.sampled_from(["max_tokens", "temperature", "top_p", "seed", "top_k", "n", "min_p",
                                    "max_output_tokens", "top_logprobs"]))
        return ('{"model":"%s","messages":[{"role":"user","content":"hi"}],"prompt":"hi","input":"hi",'
                '"max_tokens":1,"%s":%s}' % (MODEL, key, num)).encode()
    if kind == "nested":
        return nested(draw(st.sampled_from([10, 200, 900, 1000, 5000, 100000])), draw(st.sampled_from(["list", "obj"])))
    if kind == "truncated":
        good = json.dumps(VALID["/v1/messages"]).encode()
        return good[:draw(st.integers(0, len(good) - 1))]
    return draw(st.sampled_from([b"[]", b"1", b'"x"', b"null", b"true", b"[{}]", b" ", b"{}"]))


@st.composite
def http_request(draw, routes=tuple(ROUTES)):
    kind = draw(st.sampled_from(["json", "json", "json", "raw", "method", "path"]))
    headers = {}
    ctype = draw(st.sampled_from(["application/json", "application/json", "text/plain", "", "application/x-www-form-urlencoded",
                                  "application/json; charset=latin-1", "multipart/form-data; boundary=x"]))
    if ctype:
        headers["content-type"] = ctype
    if draw(st.booleans()):
        headers["authorization"] = draw(st.sampled_from(["Bearer x", "Basic eA==", "Bearer", "", "Bearer " + "a" * 300]))
    if kind == "json":
        path = draw(st.sampled_from(POSTS))
        return "POST", path, json.dumps(draw(json_body(path))).encode(), headers
    if kind == "raw":
        return "POST", draw(st.sampled_from(POSTS)), draw(raw_body()), headers
    if kind == "method":
        return draw(st.sampled_from(METHODS)), draw(st.sampled_from(list(routes))), draw(st.sampled_from([b"", b"{}"])), headers
    seg = draw(st.text(max_size=20) | st.sampled_from(["..", "../../etc/passwd", "%2e%2e/%2e%2e", "x" * 300, "\x00"]))
    base = draw(st.sampled_from(["/v1/models/", "/v1/", "/", "/v1/chat/completions/"]))
    return draw(st.sampled_from(["GET", "POST"])), base + urllib.parse.quote(seg, safe="/%"), b"{}", headers


def fake_app():
    return create_app(FakeBackend(), Settings(model_id=MODEL, max_body_bytes=1 << 16))


class AsgiRunner:
    """One event loop and one client for all examples (an example is one request)."""

    def __init__(self, app):
        self.loop = asyncio.new_event_loop()
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")

    def request(self, method, path, body, headers) -> httpx.Response:
        return self.loop.run_until_complete(self.client.request(method, path, content=body, headers=headers))

    def close(self):
        self.loop.run_until_complete(self.client.aclose())
        self.loop.close()


COUNTS: dict[str, dict] = {}


def judge(where: str, bad: list, method: str, path: str, body: bytes, r) -> None:
    """Count the answer; a 5xx is noted in `bad` and fails the example."""
    row = COUNTS.setdefault(where, {"requests": 0, "2xx": 0, "4xx": 0, "5xx": 0})
    row["requests"] += 1
    row[f"{r.status_code // 100}xx"] = row.get(f"{r.status_code // 100}xx", 0) + 1
    if r.status_code >= 500:
        bad.append((method, path, body[:300], r.status_code, r.text[:200]))
    assert r.status_code < 500, (method, path, body[:300], r.text[:300])


def test_fuzz_frontend_asgi():
    runner = AsgiRunner(fake_app())
    bad = []

    @settings(max_examples=scale(300, 4000), deadline=None, derandomize=not FULL, database=None,
              suppress_health_check=list(HealthCheck))
    @given(http_request(routes=tuple(ASGI_ROUTES)))
    def run(req):
        method, path, body, headers = req
        judge("asgi", bad, method, path, body, runner.request(method, path, body, headers))

    try:
        run()
    finally:
        runner.close()
        Stats.add("http: hypothesis on the frontend (ASGI, fake backend)", **COUNTS.get("asgi", {}))
    assert not bad


@pytest.mark.parametrize("path,key", [("/v1/chat/completions", "temperature"), ("/v1/completions", "top_p"),
                                      ("/v1/chat/completions", "min_p"), ("/v1/responses", "temperature"),
                                      ("/v1/messages", "top_p")])
def test_huge_integer_in_a_float_field(path, key):
    """An integer beyond float range in a float field is a 400 naming the field (it was a 500:
    float() raised OverflowError in schema.get_num)."""
    runner = AsgiRunner(fake_app())
    try:
        body = json.dumps(VALID[path])[:-1] + ', "%s": 1%s}' % (key, "0" * 400)
        r = runner.request("POST", path, body.encode(), {"content-type": "application/json"})
    finally:
        runner.close()
    assert r.status_code == 400, (r.status_code, r.text)
    assert key in r.text


@pytest.mark.parametrize("depth", [100000, 5000])
def test_deep_tool_arguments_render(depth):
    """The renderer's render() on such a request: a PromptError (400) at most, nothing else
    (a RecursionError here killed the renderer until commit bb5f0b9)."""
    from common import messages as m
    from procs.renderer.prompt import PromptError, render
    from .harness import text_model
    args = "[" * depth + "]" * depth
    req = m.GenerateRequest(rid="r", kind="chat", sampling=m.SamplingParams(max_tokens=1), messages=(
        m.ChatMessage(role="user", content="hi"),
        m.ChatMessage(role="assistant", content="", tool_calls=(m.ToolCall(id="call_1", function=m.ToolCallFunction(
            name="f", arguments=args)),)),
        m.ChatMessage(role="tool", content="ok", tool_call_id="call_1")))
    try:
        render(text_model(), req)
    except PromptError:
        pass


# ------------------------------------------------------------------ the real server

def real_body(method, path, body, headers):
    """The same request, with generation kept to a token or two where the body is a valid
    JSON object (the model runs for real)."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return body
    if not isinstance(obj, dict) or path not in POSTS:
        return body
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        v = obj.get(key)
        if v is None or (type(v) is int and v > 2):
            obj[key] = 1
    return json.dumps(obj).encode()


def test_fuzz_real_server(healthy):
    c = healthy
    bad = []
    served = c.model
    with c.http(timeout=300) as h:
        @settings(max_examples=scale(40, 400), deadline=None, derandomize=not FULL, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(http_request())
        def run(req):
            method, path, body, headers = req
            body = real_body(method, path, body.replace(MODEL.encode(), served.encode()), headers)
            judge("real", bad, method, path, body,
                  h.request(method, path.replace(MODEL, served), content=body, headers=headers))
        try:
            run()
        finally:
            Stats.add("http: hypothesis on the real server", **COUNTS.get("real", {}))
    assert c.all_alive(), c.dead()
    assert not bad


def test_transport_edge_cases(healthy):
    """Invalid UTF-8, huge numbers, deep nesting, bodies over RICORDO_MAX_BODY_BYTES (with a
    Content-Length and chunked), oversized header lines: all 4xx, nothing dies."""
    c = healthy
    limit = 8 << 20
    cases = {
        "invalid utf-8": b'{"prompt":"\xff\xfe","max_tokens":1}',
        "lone surrogate escape": b'{"prompt":"\\ud800","max_tokens":1}',
        "huge int max_tokens": b'{"prompt":"hi","max_tokens":' + b"9" * 5000 + b"}",
        "1e999": b'{"prompt":"hi","max_tokens":1,"temperature":1e999}',
        "nested 100000": nested(100000, "list"),
        "nested objects 50000": nested(50000, "obj"),
        "over the limit (content-length)": b'{"prompt":"' + b"a" * (limit + 10) + b'"}',
    }
    statuses = {}
    with c.http(timeout=300) as h:
        for name, body in cases.items():
            r = h.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            statuses[name] = r.status_code
        big = cases["over the limit (content-length)"]

        def chunks():
            for i in range(0, len(big), 1 << 16):
                yield big[i:i + (1 << 16)]
        r = h.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
        statuses["over the limit (chunked)"] = r.status_code
        r = h.get("/v1/models", headers={"x-long": "a" * 20000})
        statuses["20 kB header"] = r.status_code
        r = h.get("/v1/models?" + "a" * 20000)
        statuses["20 kB request line"] = r.status_code
    Stats.add("http: transport edge cases (real server)", requests=len(statuses),
              statuses=statuses)
    assert statuses["over the limit (content-length)"] == 413 and statuses["over the limit (chunked)"] == 413
    assert all(400 <= s < 500 for s in statuses.values()), statuses
    assert c.all_alive(), c.dead()


def raw_post_start(port: int, path: str, body_len: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=600)
    s.sendall((f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"Content-Length: {body_len}\r\n\r\n").encode())
    return s


def read_status(s: socket.socket) -> int:
    data = b""
    while b"\r\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    return int(data.split(b" ")[1]) if data.startswith(b"HTTP/") else -1


def test_slow_and_stalled_clients(healthy):
    """Clients that send their body a byte at a time, and clients that send headers and then
    nothing: meanwhile other requests (health, models, a generation) are answered promptly;
    the slow ones are answered when their body is complete."""
    c = healthy
    served = c.model
    body = json.dumps({"model": served, "prompt": "Hello", "max_tokens": 1}).encode()
    n_stalled, n_slow = scale(20, 200), scale(3, 20)
    stalled = [raw_post_start(c.port, "/v1/completions", 100) for _ in range(n_stalled)]
    slow_status = {}

    def slow(i):
        s = raw_post_start(c.port, "/v1/completions", len(body))
        try:
            for b in body:
                s.sendall(bytes([b]))
                time.sleep(6.0 / len(body))
            slow_status[i] = read_status(s)
        finally:
            s.close()
    threads = [threading.Thread(target=slow, args=(i,), daemon=True) for i in range(n_slow)]
    for t in threads:
        t.start()
    latencies = []
    try:
        with c.http(timeout=120) as h:
            for _ in range(scale(5, 20)):
                for path in ("/health", "/v1/models"):
                    t0 = time.monotonic()
                    r = h.get(path)
                    latencies.append(time.monotonic() - t0)
                    assert r.status_code == 200, (path, r.status_code)
                t0 = time.monotonic()
                r = h.post("/v1/completions", content=body, headers={"content-type": "application/json"})
                assert r.status_code == 200
                latencies.append(time.monotonic() - t0)
        for t in threads:
            t.join(120)
    finally:
        for s in stalled:
            s.close()
    assert all(v == 200 for v in slow_status.values()) and len(slow_status) == n_slow, slow_status
    worst = max(latencies)
    Stats.add("http: slow + stalled clients (real server)", stalled_connections=n_stalled, slow_clients=n_slow,
              other_requests=len(latencies), worst_other_latency_s=round(worst, 2))
    assert worst < 30, f"another request waited {worst:.1f} s"
    assert c.all_alive(), c.dead()


@full_only
def test_many_stalled_connections_and_a_stalled_body(healthy):
    """2500 connections that sent headers and no body, and one that stops half-way through its
    body: other requests are answered at once; the half body gets a 4xx when gunicorn's body
    wait (its --timeout, 30 s) expires; nothing dies."""
    c = healthy
    half = raw_post_start(c.port, "/v1/completions", 100)
    half.sendall(b'{"prompt":')
    t_half = time.monotonic()
    socks = []
    try:
        for _ in range(2500):
            socks.append(raw_post_start(c.port, "/v1/completions", 100))
        time.sleep(1.0)
        with c.http(timeout=120) as h:
            t0 = time.monotonic()
            assert h.get("/v1/models").status_code == 200
            models_s = time.monotonic() - t0
            t0 = time.monotonic()
            r = h.post("/v1/completions", json={"model": c.model, "prompt": "Hello", "max_tokens": 1})
            assert r.status_code == 200
            gen_s = time.monotonic() - t0
        half.settimeout(120)
        status = read_status(half)
        half_s = time.monotonic() - t_half
    finally:
        half.close()
        for s in socks:
            s.close()
    Stats.add("http: 2500 stalled connections + a stalled body (real server)", stalled=len(socks),
              models_s=round(models_s, 2), generation_s=round(gen_s, 2), stalled_body_status=status,
              stalled_body_answered_after_s=round(half_s))
    assert 400 <= status < 500 and half_s < 90, (status, half_s)
    assert models_s < 10
    assert c.all_alive(), c.dead()


@full_only
def test_deep_tool_arguments_real_server(healthy):
    c = healthy
    args = "[" * 50000 + "]" * 50000
    body = {"model": c.model, "max_tokens": 1, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                                               "function": {"name": "f", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]}
    try:
        with c.http(timeout=120) as h:
            r = h.post("/v1/chat/completions", json=body)
        time.sleep(2)
        alive = c.alive("renderer")
        Stats.add("http: deep tool-call arguments (real server)", requests=1, status=r.status_code,
                  renderer_alive=alive)
        assert alive and r.status_code < 500, (r.status_code, r.text[:200])
    finally:
        if not c.alive("renderer"):
            c.start("renderer")
