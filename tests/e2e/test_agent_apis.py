"""The agent APIs end to end: /v1/responses through the official `openai` client and
/v1/messages through the official `anthropic` client, against every process of the
Procfile with the real default model and a disk KV cache in a temp dir.

Greedy everywhere (the server's default temperature is 0; newer `anthropic` clients no
longer send one). One server start and one restart in all (the machine is slow): the tests
run in file order on one server, restarted by the last.

A two-turn exchange forces a function call with a named tool_choice (constrained decoding
makes it a closed call that fits the tool's schema whatever the CPU), answers it, and checks that
the second turn's prompt was served from the cache up to the end of the first turn's
answer: the call ids handed out are replayed as the exact sampled bytes. After a restart
they come from the cache files' tool-id sections, and turn 2 matches the checkpoint of
turn 1's whole session only if the call replays byte for byte.
"""
from __future__ import annotations

import json
import uuid

import pytest

from .server import Server

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

SLACK = 16                  # "cached >= turn 1 in + out - SLACK": the answer's end-of-turn tokens and so on
CALL_TOKENS = 40            # room for the small model to close its call
CITIES = ("Tokyo", "London", "Berlin", "Oslo", "Paris", "Madrid", "Cairo", "Lima", "Rome", "Quito", "Dakar")
USED: set = set()           # each exchange its own question
EXAMPLE = ('You answer by calling a tool. Example call:\n<tool_call>\n'
           '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
OA_TOOLS = [{"type": "function", "name": "get_weather", "description": "Get the weather for a city",
             "parameters": PARAMS}]
AN_TOOLS = [{"name": "get_weather", "description": "Get the weather for a city", "input_schema": PARAMS}]


def tag() -> str:
    """A word no other request carries."""
    return uuid.uuid4().hex[:8]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    kv = tmp_path_factory.mktemp("kv")
    # min 32: the two APIs' conversations share ~218 tokens of tools prefix and differ in ~60,
    # so the first one's session is evict-saved when the second replaces it (docs/kv-format.md section 6)
    env = {"RICORDO_KV_DISK_DIR": str(kv), "RICORDO_KV_CACHE_MIN_TOKENS": "32",
           "RICORDO_KV_CACHE_BOUNDARY_ALIGN_TOKENS": "32", "RICORDO_KV_CACHE_BOUNDARY_TRIM_TOKENS": "4"}
    with Server(env=env, name="ricordo-agents") as srv:
        yield srv


def oa(srv: Server):
    return srv.client()


def an(srv: Server, **kw):
    kw.setdefault("timeout", 180.0)
    kw.setdefault("max_retries", 0)
    return anthropic.Anthropic(base_url=srv.base_url, api_key="x", **kw)


# -- text, whole and streamed ------------------------------------------------------------------

def test_responses_text_whole_and_streamed(server):
    model = server.health["model"]
    ask = dict(model=model, instructions="Be brief.", input=f"Name a color, {tag()}.", max_output_tokens=8,
               temperature=0)
    r = oa(server).responses.create(**ask)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == model
    assert r.status in ("completed", "incomplete") and r.output_text
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    u = r.usage
    assert u.input_tokens > 0 and 0 < u.output_tokens <= 8 and u.total_tokens == u.input_tokens + u.output_tokens
    assert u.input_tokens_details.cached_tokens == 0 and u.output_tokens_details.reasoning_tokens == 0
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"

    events = list(oa(server).responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] == ("response.completed" if r.status == "completed" else "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text
    final = events[-1].response
    assert final.output_text == r.output_text and final.usage.output_tokens == u.output_tokens
    assert final.usage.input_tokens == u.input_tokens


def test_messages_text_whole_and_streamed(server):
    model = server.health["model"]
    ask = dict(model=model, system="Be brief.", max_tokens=8,
               messages=[{"role": "user", "content": f"Name a fruit, {tag()}."}])
    m = an(server).messages.create(**ask)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == model
    assert m.stop_reason in ("end_turn", "max_tokens") and m.content[0].type == "text" and m.content[0].text
    assert m.usage.input_tokens > 0 and 0 < m.usage.output_tokens <= 8
    assert m.usage.cache_read_input_tokens == 0

    with an(server).messages.stream(**ask) as st:
        kinds = [e.type for e in st]
        final = st.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.content[0].text == m.content[0].text and final.stop_reason == m.stop_reason
    u = final.usage
    assert u.output_tokens == m.usage.output_tokens
    assert u.input_tokens + u.cache_read_input_tokens == m.usage.input_tokens      # the whole prompt


def test_messages_stop_sequence(server):
    """A stop sequence taken from the answer the same server gives without one: the answer
    ends right before it, whole and streamed (no word of the model's is assumed)."""
    base = dict(model=server.health["model"], max_tokens=24,
                messages=[{"role": "user", "content": "Count from 1 to 10, separated by commas."}])
    free = an(server).messages.create(**base).content[0].text
    stop = next((c for c in free[len(free) // 3:] if not c.isspace() and free.index(c) > 0), None)
    assert stop is not None, free
    ask = dict(base, stop_sequences=["\x01never\x01", stop])
    m = an(server).messages.create(**ask)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop), (m, free)
    assert m.content[0].text == free[:free.index(stop)], (m.content[0].text, free)
    with an(server).messages.stream(**ask) as st:
        final = st.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == ("stop_sequence", stop,
                                                                               m.content[0].text)


# -- a two-turn agent exchange -------------------------------------------------------------------

def responses_turn2(srv: Server, first: list, r1) -> object:
    call = [o for o in r1.output if o.type == "function_call"][-1]
    items = first + [o.model_dump(exclude_none=True) for o in r1.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    return oa(srv).responses.create(model=srv.health["model"], instructions=EXAMPLE, input=items, tools=OA_TOOLS,
                                    max_output_tokens=6, temperature=0)


def first_call(ask, has_call):
    """(question, answer) of a question whose answer must be a closed call: the call is
    forced by name and constrained by the tool's schema, so it is one on any CPU."""
    city = next(c for c in CITIES if c not in USED)
    USED.add(city)
    first = [{"role": "user", "content": f"What is the weather in {city}?"}]
    answer = ask(first)
    assert has_call(answer), answer
    return first, answer


def responses_turn1(srv: Server):
    def ask(first):
        return oa(srv).responses.create(model=srv.health["model"], instructions=EXAMPLE, input=first,
                                        tools=OA_TOOLS, tool_choice={"type": "function", "name": "get_weather"},
                                        max_output_tokens=CALL_TOKENS, temperature=0)
    first, r1 = first_call(ask, lambda r: any(o.type == "function_call" for o in r.output))
    c = [o for o in r1.output if o.type == "function_call"][0]
    assert c.name == "get_weather" and c.call_id.startswith("call_") and c.id.startswith("fc_")
    assert isinstance(json.loads(c.arguments)["city"], str)     # the schema's required key
    assert r1.status == "completed"
    return first, r1


def responses_cached_turn1(r1, r2) -> None:
    u1, u2 = r1.usage, r2.usage
    assert r2.status in ("completed", "incomplete")
    assert u2.input_tokens > u1.input_tokens + u1.output_tokens
    assert u2.input_tokens_details.cached_tokens >= u1.input_tokens + u1.output_tokens - SLACK, (u1, u2)


def test_responses_agent_exchange(server):
    first, r1 = responses_turn1(server)
    assert r1.usage.input_tokens_details.cached_tokens == 0
    responses_cached_turn1(r1, responses_turn2(server, first, r1))


def messages_turn2(srv: Server, first: list, m1):
    use = [b for b in m1.content if b.type == "tool_use"][-1]
    msgs = first + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m1.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                  "content": "sunny, 21 C"}]}]
    return an(srv).messages.create(model=srv.health["model"], system=EXAMPLE, messages=msgs, tools=AN_TOOLS,
                                   max_tokens=6)


def messages_turn1(srv: Server):
    def ask(first):
        with an(srv).messages.stream(model=srv.health["model"], system=EXAMPLE, messages=first,
                                     tools=AN_TOOLS, tool_choice={"type": "tool", "name": "get_weather"},
                                     max_tokens=CALL_TOKENS) as st:
            return st.get_final_message()
    first, m1 = first_call(ask, lambda m: m.stop_reason == "tool_use")
    uses = [b for b in m1.content if b.type == "tool_use"]
    assert uses[0].name == "get_weather" and uses[0].id.startswith("toolu_") and isinstance(uses[0].input["city"], str)
    return first, m1


def messages_cached_turn1(m1, m2) -> None:
    u1, u2 = m1.usage, m2.usage
    turn1 = u1.input_tokens + u1.cache_read_input_tokens + u1.output_tokens
    assert u2.cache_read_input_tokens >= turn1 - SLACK, (u1, u2)
    assert u2.input_tokens + u2.cache_read_input_tokens > turn1


def test_messages_agent_exchange(server):
    first, m1 = messages_turn1(server)
    messages_cached_turn1(m1, messages_turn2(server, first, m1))


def test_calls_stream_while_they_are_written(server):
    """A forced call streams its arguments in pieces as the model writes them, on both agent
    APIs (Codex and Claude Code show a call growing); the pieces are the final arguments."""
    def responses(first):
        deltas, done = [], None
        for ev in oa(server).responses.create(model=server.health["model"], instructions=EXAMPLE, input=first,
                                              tools=OA_TOOLS, tool_choice={"type": "function", "name": "get_weather"},
                                              max_output_tokens=CALL_TOKENS, temperature=0, stream=True):
            if ev.type == "response.function_call_arguments.delta":
                deltas.append(ev.delta)
            elif ev.type == "response.completed":
                done = ev.response
        return deltas, done
    _, (deltas, r) = first_call(responses, lambda a: a[1] is not None)
    [c] = [o for o in r.output if o.type == "function_call"]
    assert len(deltas) >= 3 and "".join(deltas) == c.arguments, deltas
    assert isinstance(json.loads(c.arguments)["city"], str)

    def messages(first):
        parts = []
        with an(server).messages.stream(model=server.health["model"], system=EXAMPLE, messages=first,
                                        tools=AN_TOOLS, tool_choice={"type": "tool", "name": "get_weather"},
                                        max_tokens=CALL_TOKENS) as st:
            for ev in st:
                if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta":
                    parts.append(ev.delta.partial_json)
            return parts, st.get_final_message()
    _, (parts, m) = first_call(messages, lambda a: a[1].stop_reason == "tool_use")
    [use] = [b for b in m.content if b.type == "tool_use"]
    assert len(parts) >= 3 and json.loads("".join(parts)) == use.input, parts
    assert isinstance(use.input["city"], str)


def test_a_call_the_limit_cuts_reads_alike_whole_and_streamed(server):
    """A forced call cut by max_tokens inside its arguments: the tool_use input of the whole
    answer is what the anthropic SDK assembles from the stream of the same answer (a value
    not finished left out, as its partial JSON reading does). Before, the whole answer said
    {"arguments": "<the text so far>"}."""
    seen = set()
    for max_tokens in (3, 5, 7, 9):
        kw = dict(model=server.health["model"], system=EXAMPLE, tools=AN_TOOLS, max_tokens=max_tokens,
                  tool_choice={"type": "tool", "name": "get_weather"},
                  messages=[{"role": "user", "content": f"What is the weather in Oslo? {tag()}"}])
        whole = an(server).messages.create(**kw)
        with an(server).messages.stream(**kw) as st:
            streamed = st.get_final_message()
        [a] = [b for b in whole.content if b.type == "tool_use"]
        [b] = [b for b in streamed.content if b.type == "tool_use"]
        assert whole.stop_reason == streamed.stop_reason
        assert a.input == b.input and "arguments" not in a.input, (max_tokens, a.input, b.input)
        seen.add(whole.stop_reason)
    assert "max_tokens" in seen


def test_messages_prefill_is_continued(server, text_model):
    """A trailing assistant text is continued: the prompt ends with it (no end of turn, no
    new assistant header: a few tokens more than the question alone, not the ~5 of a turn's
    frame more) and the answer does not repeat it."""
    client = an(server)
    q = [{"role": "user", "content": f"Name a color. {tag()}"}]
    prefill = "My favourite color is"
    pre = q + [{"role": "assistant", "content": prefill}]
    n_q = client.messages.count_tokens(model=server.health["model"], messages=q).input_tokens
    n_pre = client.messages.count_tokens(model=server.health["model"], messages=pre).input_tokens
    assert 0 < n_pre - n_q <= len(text_model.encode(prefill)) + 1, (n_q, n_pre)
    m = client.messages.create(model=server.health["model"], messages=pre, max_tokens=6)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == n_pre
    assert not any(b.text.startswith(prefill) for b in m.content if b.type == "text")


def test_messages_thread_of_the_sdk_sends_the_whole_conversation(server):
    """The anthropic SDK's beta thread (its tool_runner's default): the server keeps no
    threads, so the second turn's `continue` is refused and the SDK resends the history;
    before, the turn was answered without the history or the system prompt."""
    seen = []
    http = anthropic.DefaultHttpxClient(event_hooks={"request": [
        lambda r: seen.append(json.loads(r.content)) if r.method == "POST" else None]})
    client = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0, http_client=http)
    if not hasattr(client.beta.messages, "thread"):
        pytest.skip(f"anthropic {anthropic.__version__} has no message threads")
    t = client.beta.messages.thread(model=server.health["model"], max_tokens=4, system=f"Be brief. {tag()}")
    t.send({"role": "user", "content": "My name is Zed."})
    r2 = t.send({"role": "user", "content": "What is my name?"})
    assert r2.content is not None
    last = seen[-1]
    assert last.get("thread", {}).get("type") != "continue", last
    assert [x["role"] for x in last["messages"]] == ["user", "assistant", "user"] and last["system"], last


# -- bad input, each in its own API's shape ----------------------------------------------------

def test_bad_input_shapes(server):
    model = server.health["model"]
    with pytest.raises(openai.BadRequestError) as ei:
        oa(server).responses.create(model=model, input="hi", previous_response_id="resp_123")
    assert ei.value.param == "previous_response_id"
    with pytest.raises(anthropic.BadRequestError) as ai:
        an(server).messages.create(model=model, max_tokens=4, messages=[{"role": "robot", "content": "x"}])
    assert ai.value.body["type"] == "error" and ai.value.body["error"]["type"] == "invalid_request_error"
    other = an(server).messages.create(model="claude-none", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert other.model == model         # any name is served by the loaded model (no --strict-model-names)
    with server.http() as c:
        r = c.post("/v1/messages", json={"model": model, "messages": [{"role": "user", "content": "x"}]},
                   headers={"anthropic-version": "2023-06-01"})
        assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert "max_tokens" in body["error"]["message"]
        r = c.post("/v1/responses", json={"model": model, "input": [{"type": "input_image"}]})
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        r = c.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


# -- the same across a full restart -------------------------------------------------------------

def test_agent_exchanges_across_a_restart(server):
    """Turn 1 of each API, a restart (stop, start on the same cache dir), then turn 2: the first
    exchange's session went to disk when the second began (evict), the second's at shutdown."""
    first_r, r1 = responses_turn1(server)
    first_m, m1 = messages_turn1(server)
    server.restart()
    responses_cached_turn1(r1, responses_turn2(server, first_r, r1))
    messages_cached_turn1(m1, messages_turn2(server, first_m, m1))
