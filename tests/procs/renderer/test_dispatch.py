"""The renderer sends up to --parallel jobs to inference at once: unrelated requests run
together, a request that continues a running job's conversation waits for that job (so it
finds the whole turn in the job's session), and a session a running job uses is never
planned in place for another. The real Renderer on a temp run dir, messages captured."""
from __future__ import annotations

from pathlib import Path

import pytest

from common import messages as m
from common.config import Settings
from common.policy import common_prefix
from procs.renderer import server as rs

from .test_readiness import Captured, LOG, inference_up, keep_signals  # noqa: F401 (a fixture)

SYSTEM = "You are a careful assistant for the railway museum. " * 12


@pytest.fixture
def make(tmp_path, keep_signals):
    made = []

    def build(parallel: int, **kw) -> rs.Renderer:
        s = Settings(run_dir=str(tmp_path / f"run{len(made)}"), kv_cache_min_tokens=kw.pop("min_tokens", 16),
                     parallel=parallel, **kw)
        r = rs.Renderer(s, LOG)
        r.out = Captured()
        r.to_web = lambda route, msg: r.out.web.append(msg)
        r.to_inference = r.out.inference.append
        r.send_persister = r.out.persister.append
        inference_up(r)
        r.on_event(m.LiveState(rid="", boot="inf-1", sessions=()))
        made.append(r)
        return r
    yield build
    for r in made:
        for sock in (r.router, r.events, r.jobs, r.to_persister):
            sock.close(0)


def chat(r, rid: str, *turns: str) -> None:
    msgs = [m.ChatMessage(role="system", content=SYSTEM)]
    for i, t in enumerate(turns):
        msgs.append(m.ChatMessage(role="user" if i % 2 == 0 else "assistant", content=t))
    req = m.GenerateRequest(rid=rid, kind="chat", sampling=m.SamplingParams(max_tokens=4), messages=tuple(msgs))
    r.on_request(b"web-1", req)


def jobs(r) -> list[str]:
    return [j.rid for j in r.out.of("inference", m.Job)]


def done(r, rid: str, sid: int, answer=(7, 8)) -> None:
    """Inference's JobDone for rid: its session sid holds the job's prompt and answer."""
    job = next(j for j in r.out.of("inference", m.Job) if j.rid == rid)
    resident = tuple(sorted(set(r.live or ()) | {sid}))
    r.on_event(m.JobDone(rid=rid, reason="stop", live=job.ids + tuple(answer), session=sid, resident=resident))


def test_shared_prefix_length():
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([1, 2, 3], [1, 9, 3]) == 1
    assert common_prefix([], [1]) == 0
    assert common_prefix(list(range(1000)), list(range(700)) + [-1] * 300) == 700


def test_requests_on_one_system_prompt_run_together_up_to_parallel(make):
    r = make(parallel=2)
    chat(r, "a", "Opening hours?")
    chat(r, "b", "Ticket prices?")
    chat(r, "c", "Is there a cafe?")
    assert jobs(r) == ["a"]           # b shares a's cold system prompt (> min tokens): it waits for a's session
    done(r, "a", 1)
    assert jobs(r) == ["a", "b", "c"]
    b, c = r.out.of("inference", m.Job)[1:]
    assert b.session == 1 and b.reuse > 0           # b drops a few tokens of a's turn: in place
    assert c.source == 1 and c.session == 0 and c.reuse == b.reuse   # session 1 is b's now: c copies it
    assert set(r.running) == {"b", "c"}
    chat(r, "d", "Where is the station?")
    assert jobs(r)[-1] == "c"         # two run: d waits for a free slot
    done(r, "c", 2)
    assert jobs(r)[-1] == "d"


def test_the_next_turn_waits_for_its_running_job_and_then_continues_its_session(make):
    r = make(parallel=4)
    chat(r, "t1", "Opening hours?")
    done(r, "t1", 1)
    other = m.GenerateRequest(rid="other", kind="completion", sampling=m.SamplingParams(max_tokens=2),
                              prompt="A completely unrelated prompt about pottery.")
    r.on_request(b"web-1", other)
    assert jobs(r) == ["t1", "other"] and r.out.of("inference", m.Job)[-1].reuse == 0
    chat(r, "t2", "Opening hours?", "Nine to five.", "And on Sunday?")
    # the continuation's plan is session 1 in place; it does not wait for "other", which
    # runs in a session of its own
    j = r.out.of("inference", m.Job)[-1]
    assert j.rid == "t2" and j.session == 1 and j.reuse > 0
    chat(r, "t3", "Opening hours?", "Nine to five.", "And on Sunday?", "Closed.", "Thanks!")
    assert jobs(r)[-1] == "t2"        # t2 runs in session 1: t3 (its next turn) waits for it
    done(r, "t2", 1)
    j = r.out.of("inference", m.Job)[-1]
    assert j.rid == "t3" and j.session == 1


def test_one_at_a_time_with_parallel_one(make):
    r = make(parallel=1)
    chat(r, "a", "Opening hours?")
    req = m.GenerateRequest(rid="x", kind="completion", sampling=m.SamplingParams(max_tokens=2),
                            prompt="A completely unrelated prompt about pottery.")
    r.on_request(b"web-1", req)
    assert jobs(r) == ["a"]
    done(r, "a", 1)
    assert jobs(r) == ["a", "x"]


def test_a_calls_end_heard_after_its_job_ended_is_mirrored_cut(make):
    """Llama 3's call ends with its JSON object: the renderer sends the keep (CancelJob) at
    the closing token, and inference may have sampled and run the stop token before the keep
    reaches it. JobDone then lists the session with that token; inference cuts it when the
    keep arrives, so the mirror is cut too, and the next turn (whose template renders its own
    end of turn, not the sampled token) continues the session in place. Before, the mirror
    kept the token, and a prompt under --kv-cache-min-tokens went cold."""
    import json
    r = make(parallel=4, min_tokens=512,
             chat_template_file=str(Path(__file__).resolve().parents[2] / "data" / "templates" / "llama3.jinja"))
    tools = json.dumps([{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}])
    msgs = (m.ChatMessage(role="user", content="What time is it?"),)
    req = m.GenerateRequest(rid="t1", kind="chat", sampling=m.SamplingParams(max_tokens=40), messages=msgs,
                            tools=tools, tool_choice='"required"')
    r.on_request(b"web-1", req)
    [job] = r.out.of("inference", m.Job)
    text = '{"name": "get_time", "parameters": {}}'
    opened = r.running["t1"].calls.block     # the opener the prompt ends with
    answer = tuple(r.text.encode(text[len(opened):].encode()))
    stop = min(r.text.stop_ids)
    for t in answer + (stop,):
        r.on_event(m.Token(rid="t1", id=t, logprob=0.0, finish="stop" if t == stop else ""))
    [cancel] = [c for c in r.out.of("inference", m.CancelJob) if c.rid == "t1"]
    assert cancel.keep == len(job.ids) + len(answer)
    r.on_event(m.JobDone(rid="t1", reason="stop", live=job.ids + answer + (stop,), session=1, resident=(1,)))
    assert r.live[1].tokens == job.ids + answer
    [fin] = r.out.of("web", m.Finished)
    assert fin.finish_reason == "tool_calls"
    call = m.ToolCall(id=[d for d in r.out.of("web", m.Delta) if d.tool_calls][0].tool_calls[0].id,
                      function=m.ToolCallFunction(name="get_time", arguments="{}"))
    turn2 = msgs + (m.ChatMessage(role="assistant", content="", tool_calls=(call,)),
                    m.ChatMessage(role="tool", tool_call_id=call.id, content="12:00"))
    r.on_request(b"web-1", m.GenerateRequest(rid="t2", kind="chat", sampling=m.SamplingParams(max_tokens=4),
                                             messages=turn2, tools=tools))
    j2 = r.out.of("inference", m.Job)[-1]
    assert j2.rid == "t2" and j2.session == 1 and j2.reuse == len(job.ids) + len(answer)


def test_tool_choice_none_bans_a_one_token_call_opener(text_model):
    """Qwen's `<tool_call>` is one token: under tool_choice none it is banned (a model that
    saw calls in the history wrote one as text); SmolLM2's generic opener is several tokens
    and left to the model. The client's own logit_bias is kept."""
    import types

    from common.models import ModelError, load_text, resolve
    from procs.renderer import toolfmt
    from procs.renderer.dispatch import Dispatch
    try:
        qwen = load_text(resolve("qwen2.5-coder-0.5b", Settings().models_path()), "")
    except ModelError as e:
        pytest.skip(f"qwen2.5-coder-0.5b is not fetched: {e}")
    opener = qwen.encode(b"<tool_call>")
    assert len(opener) == 1
    own = m.SamplingParams(logit_bias=((5, 2.0),))
    got = Dispatch.no_calls(types.SimpleNamespace(text=qwen, call_format=toolfmt.HERMES), own)
    assert got.logit_bias == tuple(sorted({5: 2.0, opener[0]: -100.0}.items()))
    assert Dispatch.no_calls(types.SimpleNamespace(text=text_model, call_format=toolfmt.GENERIC), own) is own


def test_a_job_says_when_another_request_is_in_hand(make):
    """Job.more: a job sent while another request to generate has arrived (read from the
    router's socket, not yet handled) says so, and inference holds its prefill for it
    briefly to share one step; the last of a burst, a ping behind it, or no slot left for
    the next does not."""
    import time

    import msgspec
    import zmq

    from common.sockets import RENDERER, address
    r = make(4)
    web = zmq.Context.instance().socket(zmq.DEALER)
    web.connect(address(r.s, RENDERER))
    try:
        def arrive(msg) -> None:
            web.send(r.enc.encode(msg))
            assert r.router.poll(2000)
        req = lambda rid: m.GenerateRequest(rid=rid, kind="completion", sampling=m.SamplingParams(max_tokens=2),
                                            prompt=f"A prompt about {rid}, unrelated to the others.")
        arrive(req("b"))
        r.on_request(b"web-1", req("a"))               # b is at the socket: read and counted
        assert [(j.rid, j.more) for j in r.out.of("inference", m.Job)] == [("a", True)]
        assert [x.rid for _, x in r.inbox] == ["b"]
        arrive(m.PingRequest(rid="h"))
        arrive(msgspec.structs.replace(req("count"), count_only=True))    # makes no job
        deadline = time.monotonic() + 5                # (poll says one is there, not both)
        while len(r.inbox) < 3 and time.monotonic() < deadline:
            r.read_requests()
        assert [type(x).__name__ for _, x in r.inbox] == ["GenerateRequest", "PingRequest", "GenerateRequest"]
        while r.inbox:
            r.on_request(*r.inbox.popleft())
        assert [(j.rid, j.more) for j in r.out.of("inference", m.Job)] == [("a", True), ("b", False)]
        assert r.out.web[-1].finish_reason == "count"
    finally:
        web.close(0)
    one = make(1)
    one.inbox.append((b"web-1", req("d")))            # read, but c fills the only slot
    one.on_request(b"web-1", req("c"))
    assert [(j.rid, j.more) for j in one.out.of("inference", m.Job)] == [("c", False)]


def test_a_request_read_while_a_job_was_planned_is_served_without_another_message(make):
    """Requests read from the router's socket while a job is planned (Job.more, from an
    event's dispatch too) wait in the inbox; the loop serves them at once, not only when the
    socket has something new."""
    import threading
    import time

    r = make(4)
    r.inbox.append((b"web-1", m.GenerateRequest(rid="late", kind="completion", prompt="About pottery.",
                                                sampling=m.SamplingParams(max_tokens=2))))
    loop = threading.Thread(target=r.run)
    loop.start()
    try:
        deadline = time.monotonic() + 5
        while not jobs(r) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert jobs(r) == ["late"] and not r.inbox
    finally:
        r.stop.stop = True
        loop.join(5)
