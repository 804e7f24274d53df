"""The OpenAI-compatible API end to end: honcho starts every process of the Procfile with the
real default model, and the official `openai` client (or raw httpx, for the error cases)
talks to it.

Three server starts in all: `server` (default settings, two web workers), `small` (a context
of 256 tokens and a 4 KiB body limit, for the limits and bad input) and one started and
stopped by the shutdown test. Greedy (temperature 0) and few tokens everywhere, so answers
are reproducible and the file stays reasonably quick on a CPU.
"""
from __future__ import annotations

import concurrent.futures
import json
import re
import threading
import time
import uuid

import anthropic
import httpx
import openai
import pytest

from .server import Server

SMALL_CTX = 256
SMALL_BODY = 4096
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"     # a raw prompt the model continues for long


def tag() -> str:
    """A word no other request carries: makes a conversation new to the live session."""
    return uuid.uuid4().hex[:8]


def chat(srv: Server, messages, **kw):
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    return srv.client().chat.completions.create(model=srv.health["model"], messages=messages, **kw)


def chat_text(srv: Server, messages, **kw) -> str:
    return chat(srv, messages, **kw).choices[0].message.content


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def assert_error(r: httpx.Response, status: int, param="?", code="?", err_type=None) -> dict:
    """The OpenAI error shape with the given status (and param/code, unless left '?')."""
    assert r.status_code == status, f"{r.status_code} {r.text}"
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    if err_type is not None:
        assert err["type"] == err_type, err
    elif 400 <= status < 500 and status != 429:
        assert err["type"] == "invalid_request_error", err
    if param != "?":
        assert err["param"] == param, err
    if code != "?":
        assert err["code"] == code, err
    return err


def sse_events(lines) -> list:
    """The `data:` payloads of an SSE stream, decoded (the final [DONE] as the string)."""
    out = []
    for line in lines:
        if line.startswith("data:"):
            data = line[5:].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# -- health and models ---------------------------------------------------------------------

def test_health_reports_the_loaded_model(server):
    with server.http() as c:
        r = c.get("/health")
    assert r.status_code == 200, r.text
    h = r.json()
    assert h["status"] == "ok"
    assert h["model"] and isinstance(h["model"], str)
    assert h["n_ctx"] > 0
    assert h["device"] and h["dtype"]


def test_models_list_and_retrieve(server):
    model = server.health["model"]
    client = server.client()
    listed = client.models.list()
    assert [m.id for m in listed.data] == [model]
    card = client.models.retrieve(model)
    assert card.id == model and card.object == "model" and card.owned_by
    other = client.models.retrieve("gpt-4o")        # any name is served by the loaded model
    assert other.id == "gpt-4o" and other.owned_by == card.owned_by
    with server.http() as c:
        r = c.get("/v1/models")
        assert r.status_code == 200 and r.json()["object"] == "list"
        assert_error(c.get("/v1/no-such-route"), 404)
    listed = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0).models.list()
    assert [(m.type, m.id) for m in listed.data] == [("model", model)] and listed.data[0].created_at


# -- generation ----------------------------------------------------------------------------

def test_chat_completion(server):
    r = chat(server, user(f"Say hello to {tag()}."), max_tokens=10)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.model == server.health["model"]
    assert len(r.choices) == 1
    ch = r.choices[0]
    assert ch.message.role == "assistant"
    assert ch.message.content, r
    assert ch.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 10
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details is not None
    assert u.prompt_tokens_details.cached_tokens == 0      # a conversation the server never saw


def test_chat_stream_equals_whole_answer(server):
    messages = user(f"Name three colors, {tag()}.")
    whole = chat(server, messages, max_tokens=12)
    stream = chat(server, messages, max_tokens=12, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks, "no chunks"
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None, last
    assert all(c.usage is None for c in chunks[:-1])
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert last.usage.prompt_tokens_details.cached_tokens is not None


def test_completions_raw_prompt_streamed_and_not(server):
    client, model = server.client(), server.health["model"]
    prompt = f"[{tag()}] The capital of France is"
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    ch = whole.choices[0]
    assert ch.text and ch.finish_reason in ("stop", "length")
    assert whole.usage.prompt_tokens > 0 and 0 < whole.usage.completion_tokens <= 8
    assert whole.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ch.text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [ch.finish_reason]


def test_completions_legacy_logprobs(server):
    r = server.client().completions.create(model=server.health["model"], prompt=COUNTING, max_tokens=5,
                                           temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert len(lp.tokens) == r.usage.completion_tokens
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert v <= 0
        assert 1 <= len(top) <= 2
        assert max(top.values()) == pytest.approx(v, abs=1e-6)     # greedy: the best is the one taken
    if r.choices[0].finish_reason == "length":
        assert "".join(lp.tokens) == r.choices[0].text


def test_chat_logprobs_top3(server):
    r = chat(server, user(f"Write one word, {tag()}."), max_tokens=6, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert t.logprob <= 0
        assert len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token                  # greedy: the top one is taken
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-6)
        lps = [a.logprob for a in t.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert bytes(t.bytes or []).decode("utf-8", "replace") == t.token
    if r.choices[0].finish_reason == "length":
        assert "".join(t.token for t in content) == r.choices[0].message.content


def test_logit_bias_and_penalties(server, text_model):
    """Checked against the server's own raw logprobs, so on any CPU: +100 makes a token the
    answer, -100 bans the greedy one (the next best is taken), and with a frequency penalty
    every pick is the best after subtracting 2 per earlier use (which changes the answer)."""
    def complete(**kw):
        return server.client().completions.create(model=server.health["model"], prompt=COUNTING, temperature=0,
                                                  **kw).choices[0]
    base = complete(max_tokens=16, logprobs=5)
    zebra = text_model.encode(b" zebra")[0]
    forced = complete(max_tokens=4, logit_bias={str(zebra): 100})
    assert forced.text == text_model.pieces[zebra].decode() * 4, forced.text
    first = base.logprobs.tokens[0]
    ids = [i for i, p in enumerate(text_model.pieces) if p == first.encode()]
    banned = complete(max_tokens=1, logprobs=5, logit_bias={str(i): -100 for i in ids})
    alts = sorted(((v, t) for t, v in base.logprobs.top_logprobs[0].items() if t != first), reverse=True)
    assert banned.logprobs.tokens[0] != first and banned.logprobs.tokens[0] == alts[0][1], (first, banned.logprobs)

    pen = complete(max_tokens=16, logprobs=5, frequency_penalty=2)
    lp, seen = pen.logprobs, {}
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        best = max(a - 2 * seen.get(t, 0) for t, a in top.items())
        assert v - 2 * seen.get(tok, 0) >= best - 1e-3, (tok, v, top, seen)
        seen[tok] = seen.get(tok, 0) + 1
    assert pen.text != base.text, pen.text
    # llama.cpp's repeat penalty looks back into the prompt: counting, every digit is there
    rep = complete(max_tokens=16, logprobs=1, extra_body={"repetition_penalty": 10.0})
    window = {text_model.pieces[i].decode("utf-8", "replace") for i in text_model.encode(COUNTING.encode())}
    assert base.logprobs.tokens[0] in window and rep.logprobs.tokens[0] not in window, (rep.logprobs.tokens, window)
    assert complete(max_tokens=16, extra_body={"repetition_penalty": 10.0, "repeat_last_n": 0}).text == base.text


def _pick_stop(text: str) -> str:
    """A stop string from the middle of `text`: the start of its second word or later."""
    words = [m.start() for m in re.finditer(r"(?<=\s)\S", text)]
    assert words, f"no second word in {text!r}"
    i = words[len(words) // 2]
    return text[i:i + 3]


def test_stop_strings(server):
    messages = user(f"Describe the sea in one sentence, {tag()}.")
    full = chat_text(server, messages, max_tokens=16)
    stop = _pick_stop(full)
    want = full[:full.find(stop)]
    r = chat(server, messages, max_tokens=16, stop=["@@never@@", stop])
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens <= 16
    chunks = list(chat(server, messages, max_tokens=16, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_the_turn_after_a_stop_string_reuses_the_answer_before_it(server):
    """A stop string ends the answer inside what the model wrote: the live session is cut
    back to the tokens of the text the client got, so the next turn, which sends the answer
    as the client has it, is served from the session, answer included. Before, the session
    went on past it, and a conversation this short (under --kv-cache-min-tokens) matched
    nothing."""
    messages = user(f"Describe the sea in one sentence, {tag()}.")
    stop = _pick_stop(chat_text(server, messages, max_tokens=16))
    r1 = chat(server, messages, max_tokens=16, stop=[stop])
    assert r1.choices[0].finish_reason == "stop" and r1.choices[0].message.content
    turn2 = messages + [{"role": "assistant", "content": r1.choices[0].message.content},
                        {"role": "user", "content": "And the sky?"}]
    r2 = chat(server, turn2, max_tokens=2)
    assert r2.usage.prompt_tokens_details.cached_tokens > r1.usage.prompt_tokens, (r1.usage, r2.usage)


def test_multi_turn_reuses_the_live_session(server):
    turn1 = user(f"My name is {tag()}. Say hi.")
    r1 = chat(server, turn1, max_tokens=10)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "What is my name?"}]
    r2 = chat(server, turn2, max_tokens=10)
    assert r2.choices[0].message.content
    assert r2.usage.prompt_tokens > r1.usage.prompt_tokens
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens, (r1.usage, r2.usage)
    assert r2.usage.prompt_tokens_details.cached_tokens <= r2.usage.prompt_tokens


def test_parallel_conversations_get_their_own_answers(server):
    topics = ["cats", "the moon", "bread", "rivers"]
    n_tok = 5

    def converse(topic: str) -> tuple[str, str, int]:
        t1 = user(f"Tell me about {topic}.")
        a1 = chat_text(server, t1, max_tokens=n_tok)
        t2 = t1 + [{"role": "assistant", "content": a1}, {"role": "user", "content": "Say more."}]
        r2 = chat(server, t2, max_tokens=n_tok)
        return a1, r2.choices[0].message.content, threading.get_ident()

    alone = {t: converse(t)[:2] for t in topics}
    start = threading.Barrier(len(topics))

    def together(topic: str):
        start.wait(60)
        return converse(topic)

    with concurrent.futures.ThreadPoolExecutor(len(topics)) as pool:
        results = dict(zip(topics, pool.map(together, topics)))
    assert len({r[2] for r in results.values()}) == len(topics)      # really four clients at once
    for t in topics:
        assert results[t][:2] == alone[t], t


def test_a_side_requests_session_is_filled_on_huge_pages(server):
    """A request that shares a long system prompt with a resident conversation gets a new
    session filled with a copy of that prefix, on transparent huge pages
    (procs/inference/pages.py: 512x fewer page faults, bench/bench_pages.py): the inference
    process's AnonHugePages grows by that session's K and V. Where the kernel allows no huge
    pages ('never') there is nothing to see."""
    from pathlib import Path
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    if "[never]" in mode:
        pytest.skip(f"transparent huge pages off here ({mode.strip()})")
    inference = max((p for p in server.processes() if "inference" in " ".join(p.cmdline())),
                    key=lambda p: p.memory_info().rss)      # not honcho's shell around it

    def huge_kb() -> int:
        rollup = Path(f"/proc/{inference.pid}/smaps_rollup").read_text()
        return int(re.search(r"AnonHugePages:\s+(\d+) kB", rollup).group(1))
    c = server.client()
    system = " ".join(f"Line {i}: the {i}th crate holds {i * 7} apples." for i in range(150))

    def ask(question: str) -> None:
        c.chat.completions.create(model=server.health["model"], max_tokens=4, temperature=0,
                                  messages=[{"role": "system", "content": system},
                                            {"role": "user", "content": question}])
    ask("Which crate holds 70 apples?")
    before = huge_kb()
    ask("How many apples are in crate 12? Answer with the number only, nothing else.")
    # the copy: >= 1,536 rows of 30 layers x 3 heads x 64 x 2 bytes, in K and in V
    assert huge_kb() >= before + (8 << 10), (before, huge_kb())


def test_client_disconnect_stops_generation(server):
    with server.http() as c:
        body = {"model": server.health["model"], "prompt": COUNTING, "max_tokens": 4000,
                "temperature": 0, "stream": True}
        rid = None
        got = 0
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    ev = json.loads(line[5:])
                    rid = rid or ev["id"]
                    got += 1
                    if got >= 3:
                        break
        # leaving the block closes the connection mid-stream
    assert rid and rid.startswith("cmpl-")
    # the next request is served at once (it would wait behind ~4000 tokens otherwise)
    r = chat(server, user(f"Say yes, {tag()}."), max_tokens=4)
    assert r.choices[0].message.content
    # inference logs every job: "job <rid>: ..., <n> tokens at <rate> tok/s, <reason>"
    found = server.wait_log(rf"job {rid[len('cmpl-'):]}: .*, (\d+) tokens at .*, (\w+)\s*$", timeout=60)
    assert found.group(2) == "cancelled", found.string
    assert int(found.group(1)) < 400, found.string


# -- limits and bad input (small context, small body limit) ---------------------------------

@pytest.fixture(scope="module")
def small():
    with Server(env={"RICORDO_CTX_SIZE": str(SMALL_CTX), "RICORDO_MAX_BODY_BYTES": str(SMALL_BODY),
                     "RICORDO_STRICT_MODEL_NAMES": "1"}, name="ricordo-small") as srv:
        srv.initial = srv.children()
        yield srv


@pytest.fixture
def post(small):
    with small.http() as c:
        def post(path, body=None, **kw):
            if body is not None:
                kw["json"] = body
            return c.post(path, **kw)
        yield post


def chat_body(small: Server, **kw) -> dict:
    body = {"model": small.health["model"], "messages": user("Hi"), "max_tokens": 4, "temperature": 0}
    body.update(kw)
    return body


def test_small_server_context(small):
    assert small.health["n_ctx"] == SMALL_CTX


def test_invalid_json(post):
    assert_error(post("/v1/chat/completions", content=b'{"messages": [', headers={"content-type":
                                                                             "application/json"}), 400)
    assert_error(post("/v1/chat/completions", content=b"", headers={"content-type": "application/json"}), 400)
    assert_error(post("/v1/chat/completions", content=b"[1, 2]", headers={"content-type": "application/json"}),
                 400)


@pytest.mark.parametrize("key,value", [("temperature", "hot"), ("max_tokens", "ten"), ("stream", "yes"),
                                       ("top_p", [1]), ("logprobs", 1), ("stop", 5)])
def test_wrong_types(small, post, key, value):
    assert_error(post("/v1/chat/completions", chat_body(small, **{key: value})), 400, param=key)


@pytest.mark.parametrize("key,value", [("temperature", -1), ("top_p", 0), ("max_tokens", -1),
                                       ("top_logprobs", 21), ("presence_penalty", 2.5), ("frequency_penalty", -3),
                                       ("logit_bias", {"1": 101}), ("logit_bias", {"x": 1}), ("logit_bias", [1]),
                                       ("logit_bias", {"99999999": 1})])
def test_values_out_of_range(small, post, key, value):
    extra = {"logprobs": True} if key == "top_logprobs" else {}
    assert_error(post("/v1/chat/completions", chat_body(small, **{key: value}, **extra)), 400, param=key)


def test_missing_messages(small, post):
    body = chat_body(small)
    del body["messages"]
    assert_error(post("/v1/chat/completions", body), 400, param="messages")
    assert_error(post("/v1/chat/completions", chat_body(small, messages=[])), 400, param="messages")


def test_missing_prompt(small, post):
    assert_error(post("/v1/completions", {"model": small.health["model"], "max_tokens": 4}), 400,
                 param="prompt")


def test_unknown_role(small, post):
    body = chat_body(small, messages=[{"role": "wizard", "content": "Hi"}])
    assert_error(post("/v1/chat/completions", body), 400, param="messages[0].role")


def test_empty_user_content(small, post):
    for content in (None, ""):
        body = chat_body(small, messages=[{"role": "user", "content": content}])
        err = assert_error(post("/v1/chat/completions", body), 400)
        assert err["param"] in ("messages", "messages[0].content"), err


def test_prompt_over_the_context(small, post):
    err = assert_error(post("/v1/chat/completions", chat_body(small, messages=user("hello " * 400))), 400,
                       code="context_length_exceeded")
    assert err["param"] == "messages"
    r = post("/v1/completions", {"model": small.health["model"], "prompt": " a" * 400, "max_tokens": 4})
    assert_error(r, 400, param="prompt", code="context_length_exceeded")
    # streamed: the error comes as the HTTP status, before any event
    r = post("/v1/chat/completions", chat_body(small, messages=user("hello " * 400), stream=True))
    assert_error(r, 400, code="context_length_exceeded")


def test_prompt_exactly_the_context(small, post):
    """' a' * k is k tokens for this model's tokenizer (checked through usage below)."""
    model = small.health["model"]
    r = post("/v1/completions", {"model": model, "prompt": " a" * SMALL_CTX, "max_tokens": 4})
    assert_error(r, 400, param="prompt", code="context_length_exceeded")
    # one token less fits, and leaves room for exactly one token whatever max_tokens says
    r = post("/v1/completions", {"model": model, "prompt": " a" * (SMALL_CTX - 1), "max_tokens": 50,
                                 "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == SMALL_CTX - 1
    assert body["usage"]["completion_tokens"] == 1
    assert body["choices"][0]["finish_reason"] == "length"


def test_max_tokens_clamped_to_the_context_left(small):
    r = small.client().completions.create(model=small.health["model"], prompt=" a" * (SMALL_CTX - 12),
                                          max_tokens=1000, temperature=0)
    u = r.usage
    assert u.prompt_tokens == SMALL_CTX - 12
    assert r.choices[0].finish_reason == "length", r
    assert u.completion_tokens == SMALL_CTX - u.prompt_tokens
    # no max_tokens at all: generation runs until the context is full
    r = small.client().completions.create(model=small.health["model"], prompt=" a" * (SMALL_CTX - 6),
                                          temperature=0)
    assert r.choices[0].finish_reason == "length", r
    assert r.usage.completion_tokens == 6


def test_unknown_model(small, post):
    """--strict-model-names (the small server has it): another model's name is a 404."""
    assert_error(post("/v1/chat/completions", chat_body(small, model="gpt-17")), 404, param="model",
                 code="model_not_found")
    assert_error(post("/v1/completions", {"model": "gpt-17", "prompt": "x"}), 404, param="model",
                 code="model_not_found")
    with pytest.raises(openai.NotFoundError):
        small.client().chat.completions.create(model="gpt-17", messages=user("Hi"), max_tokens=2)


def test_body_over_the_limit(small, post):
    big = chat_body(small, messages=user("x" * (2 * SMALL_BODY)))
    assert_error(post("/v1/chat/completions", big), 413, code="request_too_large")

    def chunked():          # no Content-Length: the limit holds while reading
        data = json.dumps(big).encode()
        for i in range(0, len(data), 1000):
            yield data[i:i + 1000]
    r = post("/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"})
    assert_error(r, 413, code="request_too_large")


def test_n_greater_than_one(small, post):
    assert_error(post("/v1/chat/completions", chat_body(small, n=2)), 400, param="n")
    with pytest.raises(openai.BadRequestError):
        small.client().chat.completions.create(model=small.health["model"], messages=user("Hi"), n=2,
                                               max_tokens=2)


def test_wrong_method(small):
    with small.http() as c:
        assert_error(c.get("/v1/chat/completions"), 405)


def test_still_serving_after_bad_input(small):
    """Run last on `small`: nothing above killed or restarted a process."""
    r = chat(small, user(f"Say ok, {tag()}."), max_tokens=4)
    assert r.choices[0].message.content and r.usage.completion_tokens > 0
    dead = [p.pid for p in small.initial if not p.is_running()]
    assert not dead, f"processes gone: {dead}"
    assert {p.pid for p in small.children()} >= {p.pid for p in small.initial}
    with small.http() as c:
        assert c.get("/health").status_code == 200


# -- shutdown ------------------------------------------------------------------------------

def test_sigterm_stops_every_process_within_5s():
    """SIGTERM to honcho while a stream is generating: every process is gone within 5 s."""
    with Server(name="ricordo-stop") as srv:
        procs = srv.children()
        names = " ".join(" ".join(p.cmdline()) for p in procs)
        assert "gunicorn" in names and "renderer" in names and "inference" in names, names
        events: list[str] = []

        def read():
            try:
                with srv.http() as c:
                    body = {"model": srv.health["model"], "prompt": COUNTING, "max_tokens": 4000,
                            "temperature": 0, "stream": True}
                    with c.stream("POST", "/v1/completions", json=body) as r:
                        for line in r.iter_lines():
                            events.append(line)
            except httpx.HTTPError as e:
                events.append(f"error: {e!r}")

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        deadline = time.monotonic() + 120
        while sum(e.startswith("data:") for e in events) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sum(e.startswith("data:") for e in events) >= 2, (events, srv.tail())
        took = srv.stop()
        print(f"stopped in {took:.2f} s")
        reader.join(30)
        assert not reader.is_alive(), "the stream did not end with the server"
        gone = [p for p in procs if p.is_running() and p.status() != "zombie"]
        assert not gone, gone
        assert took < 5.0, f"processes took {took:.2f} s to exit\n{srv.tail()}"
