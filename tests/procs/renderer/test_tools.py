"""Tool calls without processes: the CallParser on streamed fragments, the call opener of a
forced tool_choice, prepare_messages (tools in the system message, exact replay of known
call ids, JSON for the rest, the trace counts), and ToolMemory (LRU bound, ids from the
cache files' KTM sections).

The KTM reader itself (stops at the first malformed entry, keeps those before it; the count
limit) is covered in tests/common/test_kvfile.py and not repeated here.
"""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from common import kvfile as kf
from common import messages as m
from procs.renderer import tools as t
from procs.renderer.tools import CLOSE, OPEN

ID_RE = re.compile(r"call_[0-9a-f]{32}")
TRACE_RE = re.compile(r"tool calls: (\d+) replayed from memory, (\d+) from disk, "
                      r"(\d+) rendered from JSON \((\d+) ids unknown\)")


def feed(parser: t.CallParser, fragments) -> tuple[str, list[m.ToolCallDelta]]:
    """All content and call pieces of the fragments pushed one by one."""
    text, pieces = "", []
    for f in fragments:
        out, got = parser.push(f)
        text += out
        pieces += got
    return text, pieces


def whole_calls(pieces) -> list[tuple[str, str, str]]:
    calls: dict[int, list[str]] = {}
    for p in pieces:
        c = calls.setdefault(p.index, ["", "", ""])
        c[0] = c[0] or p.id
        c[1] = c[1] or p.name
        c[2] += p.arguments
    return [tuple(calls[i]) for i in sorted(calls)]


def chars(s: str) -> list[str]:
    return list(s)


# -- CallParser -----------------------------------------------------------------------------------

CALL_A = OPEN + '\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n' + CLOSE
CALL_B = OPEN + '\n{"arguments": {"q": "x"}, "name": "search"}\n' + CLOSE


@pytest.mark.parametrize("split", [chars, lambda s: [s], lambda s: [s[i:i + 5] for i in range(0, len(s), 5)]],
                         ids=["by-char", "whole", "by-5"])
def test_content_then_one_call(split):
    sampled = "Let me check. " + CALL_A
    p = t.CallParser()
    text, pieces = feed(p, split(sampled))
    assert text == "Let me check. "                  # nothing of the tag leaks into the content
    [(cid, name, args)] = whole_calls(pieces)
    assert ID_RE.fullmatch(cid) and name == "get_weather"
    assert json.loads(args) == {"city": "Oslo", "unit": "C"}
    assert pieces[0].id == cid and pieces[0].name == "get_weather" and pieces[0].arguments == ""
    assert all(x.id == "" and x.name == "" for x in pieces[1:])     # later pieces: argument fragments
    assert p.calls == [(cid, name, args)]
    assert text + p.block == sampled                 # the replay invariant
    assert p.flush() == "" and not p.done


def test_split_tags_are_held_back_until_known():
    p = t.CallParser()
    assert p.push("Hi <") == ("Hi ", [])             # could open a call: held
    assert p.push("tool_") == ("", [])
    assert p.push("cal") == ("", [])
    out, pieces = p.push('l>\n{"name": "f", "arguments": {}}\n</tool')
    assert out == "" and pieces == []                # the closing tag is not complete yet
    out, pieces = p.push("_call>")
    assert out == "" and [x.name for x in pieces if x.id] == ["f"] and whole_calls(pieces)[0][2] == "{}"

    q = t.CallParser()                               # a held "<" that opens nothing is content after all
    assert q.push("a <") == ("a ", [])
    assert q.push("b> c") == ("<b> c", [])
    assert q.push(" <tool_ca") == (" ", [])
    assert q.flush() == "<tool_ca"                   # held back at the end: content
    assert q.calls == [] and q.block == ""


def test_two_calls_in_one_block():
    sampled = "Two things. " + CALL_A + "\n" + CALL_B
    p = t.CallParser()
    text, pieces = feed(p, chars(sampled))
    assert text == "Two things. "
    calls = whole_calls(pieces)
    assert [c[1] for c in calls] == ["get_weather", "search"]
    assert [x.index for x in pieces if x.id] == [0, 1]
    assert len({c[0] for c in calls}) == 2 and all(ID_RE.fullmatch(c[0]) for c in calls)
    assert json.loads(calls[1][2]) == {"q": "x"}
    assert p.block == CALL_A + "\n" + CALL_B and text + p.block == sampled


def test_long_arguments_come_in_64_character_fragments():
    args = {"text": "x" * 150}
    p = t.CallParser()
    _, pieces = feed(p, [OPEN + "\n" + json.dumps({"name": "f", "arguments": args}) + "\n" + CLOSE])
    frags = [x.arguments for x in pieces[1:]]
    assert [len(f) for f in frags[:-1]] == [64] * (len(frags) - 1) and 0 < len(frags[-1]) <= 64
    assert json.loads("".join(frags)) == args


def test_string_arguments_are_passed_as_they_are():
    p = t.CallParser()
    _, pieces = feed(p, [OPEN + '{"name": "f", "arguments": "raw text"}' + CLOSE])
    assert whole_calls(pieces)[0][1:] == ("f", "raw text")


@pytest.mark.parametrize("body", ['{"name": "f", "arguments": {"a": 1}',     # unbalanced
                                  '{"arguments": {}}',                        # no name
                                  '{"name": 3, "arguments": {}}',             # name not a string
                                  '["f", {}]',                                # not an object
                                  'call f(a=1)'])
def test_malformed_call_is_left_as_text(body):
    sampled = "Sure. " + OPEN + "\n" + body + "\n" + CLOSE + " done"
    p = t.CallParser()
    text, pieces = feed(p, chars(sampled))
    assert pieces == [] and p.calls == [] and not p.done
    assert text + p.flush() == sampled               # nothing lost, nothing turned into a call


def test_done_after_trailing_junk_and_close_block():
    p = t.CallParser()
    feed(p, chars("ok " + CALL_A))
    assert not p.done
    for more in ("\n", "\n", " ", "<", "tool"):      # whitespace, or what may open another call
        p.push(more)
        assert not p.done, repr(p.buf[p.scan:])
    p.push("s")                                      # "<tools" opens nothing: the answer is over
    assert p.done
    p.close_block()
    assert p.block == CALL_A                         # cut after the last closed call
    assert p.push("The weather is") == ("", []) and p.block == CALL_A   # nothing more is taken
    assert p.flush() == "" and len(p.calls) == 1

    q = t.CallParser()
    feed(q, [CALL_A, "\n\nThe"])
    assert q.done
    q.close_block()
    assert q.block == CALL_A and not q.done

    r = t.CallParser()                               # no call yet: never done
    feed(r, ["no call at all, just text"])
    assert not r.done


def test_another_call_after_a_closed_one_is_not_junk():
    p = t.CallParser()
    feed(p, [CALL_A, "\n"])
    _, pieces = feed(p, chars(CALL_B))
    assert not p.done and [x.name for x in pieces if x.id] == ["search"]


@pytest.mark.parametrize("choice,want", [
    ("auto", ""), ("none", ""), ("required", OPEN + "\n"),
    ({"type": "function", "function": {"name": "get_weather"}}, OPEN + '\n{"name": "get_weather", "arguments": '),
])
def test_opener(choice, want):
    assert t.opener(choice) == want


def test_opened_parser_completes_a_forced_call():
    opened = t.opener({"type": "function", "function": {"name": "get_weather"}})
    sampled = '\n{"city": "Oslo"}}\n' + CLOSE
    p = t.CallParser(opened=opened)
    text, pieces = feed(p, chars(sampled))
    assert text == ""
    [(cid, name, args)] = whole_calls(pieces)
    assert ID_RE.fullmatch(cid) and name == "get_weather" and json.loads(args) == {"city": "Oslo"}
    assert p.block == opened + sampled               # what replay renders: the opener was in the prompt

    r = t.CallParser(opened=t.opener("required"))    # a forced call the model never closes: its text
    feed(r, ['{"name": "f", "argu'])                 # without the opener, which was prompt
    assert r.calls == [] and r.flush() == '{"name": "f", "argu'

    n = t.CallParser(opened=opened)                  # cut inside the arguments of a named call
    feed(n, ['{"city": "Os'])
    assert n.flush() == "" and n.cut[1:3] == ("get_weather", '{"city": "Os')


# -- prepare_messages ----------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
ID1, ID2, ID3 = ("call_" + c * 32 for c in "abc")


def call(cid, name="get_weather", arguments='{"city": "Oslo"}'):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


def convo(calls, content=""):
    return [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": content, "tool_calls": calls},
            *({"role": "tool", "tool_call_id": c["id"], "content": "sunny"} for c in calls)]


def call_block(body: str) -> bytes:
    """A call block as the model samples it: the tags around one line."""
    return f"{OPEN}\n{body}\n{CLOSE}".encode()


def memory(tmp_path=None, max_ids=100):
    return t.ToolMemory(max_ids, str(tmp_path) if tmp_path else "")


def counts(stats: t.Rendered) -> tuple[int, int, int, int]:
    found = TRACE_RE.fullmatch(stats.line())
    assert found, stats.line()
    return tuple(int(x) for x in found.groups())


def test_tools_go_into_the_system_message_first():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    stats = t.Rendered()
    out = t.prepare_messages(msgs, TOOLS, memory(), (), stats)
    assert [d["role"] for d in out] == ["system", "user"]
    assert out[0]["content"] == "Be brief.\n\n" + t.tools_text(TOOLS)
    assert json.loads(t.tools_text(TOOLS).split("<tools>\n")[1].split("\n</tools>")[0]) == TOOLS[0]
    assert msgs[0]["content"] == "Be brief."         # the caller's messages are not changed

    out = t.prepare_messages([{"role": "user", "content": "hi"}], TOOLS, None, (), stats)
    assert out[0] == {"role": "system", "content": t.tools_text(TOOLS)} and out[1]["content"] == "hi"
    out = t.prepare_messages([{"role": "system", "content": ""}, {"role": "user", "content": "hi"}],
                             TOOLS, None, (), stats)
    assert out[0]["content"] == t.tools_text(TOOLS)
    out = t.prepare_messages(msgs, [], None, (), stats)   # no tools: the messages as they are
    assert out == msgs
    assert counts(stats) == (0, 0, 0, 0)


def test_known_ids_sharing_a_block_replay_the_exact_bytes():
    block = OPEN + '\n{"name": "get_weather", "arguments": \n{"city":"Oslo" }}\n' + CLOSE + "\n" + \
        OPEN + '\n{"name": "get_weather", "arguments": {"city": "Bergen"}}\n' + CLOSE
    mem = memory()
    mem.remember([ID1, ID2], block.encode())
    stats = t.Rendered()
    calls = [call(ID1, arguments='{"city": "Oslo"}'), call(ID2, arguments='{ "city" : "Bergen" }')]
    out = t.prepare_messages(convo(calls, content="Checking."), TOOLS, mem, (), stats)
    assert out[2] == {"role": "assistant", "content": "Checking." + block}   # content + block, no separator
    assert out[3] == {"role": "tool", "content": "sunny"}       # tool_call_id is not rendered
    assert counts(stats) == (2, 0, 0, 0)


def test_unknown_id_renders_from_json():
    mem = memory()
    stats = t.Rendered()
    out = t.prepare_messages(convo([call(ID1, arguments='{"unit": "C",  "city": "Oslo"}')]), TOOLS, mem, (), stats)
    assert out[2]["content"] == OPEN + '\n{"name": "get_weather", "arguments": {"unit": "C", "city": "Oslo"}}\n' + CLOSE
    assert counts(stats) == (0, 0, 1, 1)
    out = t.prepare_messages(convo([call(ID1)], content="Hm."), TOOLS, mem, (), t.Rendered())
    assert out[2]["content"] == "Hm.\n" + t.call_json("get_weather", '{"city": "Oslo"}')


def test_mixed_known_and_unknown_ids_render_from_json():
    mem = memory()
    mem.remember([ID1], call_block("exact"))
    stats = t.Rendered()
    calls = [call(ID1), call(ID2, arguments='{"city": "Bergen"}')]
    out = t.prepare_messages(convo(calls), TOOLS, mem, (), stats)
    assert out[2]["content"] == (t.call_json("get_weather", '{"city": "Oslo"}') + "\n"
                                 + t.call_json("get_weather", '{"city": "Bergen"}'))
    assert counts(stats) == (0, 0, 2, 1)             # both from JSON; one id unknown


def test_known_ids_of_different_blocks_render_from_json():
    mem = memory()
    mem.remember([ID1], call_block("one"))
    mem.remember([ID2], call_block("two"))
    stats = t.Rendered()
    t.prepare_messages(convo([call(ID1), call(ID2)]), TOOLS, mem, (), stats)
    assert counts(stats) == (0, 0, 2, 0)


def test_replay_off_renders_from_json_without_unknown_ids():
    stats = t.Rendered()
    out = t.prepare_messages(convo([call(ID1)]), TOOLS, None, (), stats)
    assert out[2]["content"] == t.call_json("get_weather", '{"city": "Oslo"}')
    assert counts(stats) == (0, 0, 1, 0)


def test_stats_add_up_over_several_assistant_messages():
    mem = memory()
    mem.remember([ID1], call_block("one"))
    msgs = convo([call(ID1)]) + convo([call(ID2)])[2:] + convo([call(ID1)])[2:]
    stats = t.Rendered()
    t.prepare_messages(msgs, TOOLS, mem, (), stats)
    assert counts(stats) == (2, 0, 1, 1)


@pytest.mark.parametrize("arguments,want", [
    ('{"b": 2, "a": 1}', {"b": 2, "a": 1}),          # key order kept, spacing ours
    ("", {}),
    ("  ", {}),
    ("not json", "not json"),                        # passed on as a string
])
def test_call_json(arguments, want):
    text = t.call_json("f", arguments)
    assert text.startswith(OPEN + "\n") and text.endswith("\n" + CLOSE)
    assert json.loads(text[len(OPEN) + 1:-len(CLOSE) - 1]) == {"name": "f", "arguments": want}


# -- ToolMemory ----------------------------------------------------------------------------------

def test_memory_is_an_lru_of_bounded_size():
    mem = memory(max_ids=3)
    for i in range(3):
        mem.remember([f"call_{i}"], b"b%d" % i)
    assert mem.get("call_0") == b"b0"                # now the most recent
    mem.remember(["call_3"], b"b3")
    assert list(mem.mem) == ["call_2", "call_0", "call_3"] and mem.get("call_1") is None
    mem.remember(["call_2", "call_4"], b"b24")       # one block for two ids; call_2 refreshed
    assert list(mem.mem) == ["call_3", "call_2", "call_4"] and mem.get("call_2") == b"b24"
    mem.remember([f"call_x{i}" for i in range(10)], b"many")
    assert len(mem.mem) == 3 and list(mem.mem) == ["call_x7", "call_x8", "call_x9"]
    assert mem.from_disk("call_0", ["0" * 40]) is None   # no cache dir: nothing on disk


GEOM = kf.Geometry(ctx_size=512, chunk_size=64, kv_capacity=512, n_layers=1, kv_heads=1, head_dim=4,
                   vocab_size=8, kv_dtype=kf.KV_F32)


def write_kv(d, text: bytes, ktm: dict[str, bytes]) -> str:
    n = 3
    z = np.zeros((GEOM.n_layers, n, GEOM.kv_heads, GEOM.head_dim), dtype=np.float32)
    blob = kf.pack(text, np.arange(n, dtype=np.uint32), np.zeros(GEOM.vocab_size, dtype=np.float32),
                   z, z, GEOM, bytes(16), 0, kf.SHUTDOWN, ktm=ktm)
    sha1 = kf.entry_name(text)[:-len(kf.SUFFIX)]
    with open(kf.entry_path(str(d), sha1), "wb") as f:
        f.write(blob)
    return sha1


def test_ids_from_the_cache_files_ktm_sections(tmp_path):
    block1, block2 = call_block("{one}"), call_block("{two}")
    s1 = write_kv(tmp_path, b"prompt " + block1 + b" more", {ID1: block1})
    s2 = write_kv(tmp_path, b"other " + block2, {ID2: block2})
    (tmp_path / ("f" * 40 + ".kv")).write_bytes(b"KVC garbage")    # unsound: skipped
    index = ["e" * 40, "f" * 40, s1, s2]                            # the first file is missing: skipped
    mem = memory(tmp_path, max_ids=10)
    stats = t.Rendered()
    out = t.prepare_messages(convo([call(ID2)], content="So: "), TOOLS, mem, index, stats)
    assert out[2]["content"] == "So: " + block2.decode()
    assert counts(stats) == (0, 1, 0, 0)
    assert mem.files_read == {"e" * 40, "f" * 40, s1, s2}
    assert mem.get(ID1) is None and mem.disk[ID1] == block1          # read along, not yet used
    stats = t.Rendered()                                               # now in memory: no file read
    t.prepare_messages(convo([call(ID2)]), TOOLS, mem, index, stats)
    assert counts(stats) == (1, 0, 0, 0)
    stats = t.Rendered()
    t.prepare_messages(convo([call(ID1)]), TOOLS, mem, index, stats)
    assert counts(stats) == (0, 1, 0, 0)
    stats = t.Rendered()
    t.prepare_messages(convo([call(ID3)]), TOOLS, mem, index, stats)
    assert counts(stats) == (0, 0, 1, 1)


def test_a_call_cut_by_the_limit_is_a_truncated_call_not_text():
    """A forced call (the opener is prompt) cut by max_tokens: a call with the arguments so
    far, as OpenAI returns one; the opener never comes back as text."""
    opener = t.opener("required")
    p = t.CallParser(opened=opener)
    text, pieces = feed(p, chars('{"name": "get_weather", "arguments": {"city": "Par'))
    assert (text, pieces) == ("", [])
    assert p.flush() == "" and p.calls == []
    cid, name, args, _, _ = p.cut
    assert name == "get_weather" and args == '{"city": "Par' and ID_RE.fullmatch(cid)
    [head, *rest] = p.cut_pieces()
    assert (head.index, head.id, head.name) == (0, cid, "get_weather")
    assert "".join(x.arguments for x in rest) == args

    q = t.CallParser(opened=opener)                 # cut before the name is whole: no call, no opener
    feed(q, chars('{"na'))
    assert q.flush() == '{"na' and q.cut is None and q.cut_pieces() == []

    r = t.CallParser()                              # the model opened it itself: after a closed call
    feed(r, chars("ok " + CALL_A + '\n<tool_call>\n{"name": "b", "arguments": {'))
    assert r.flush() == "" and len(r.calls) == 1 and r.cut[1:3] == ("b", "{")
    assert r.cut_pieces()[0].index == 1
