"""Tool input cut by the token limit, read as the Anthropic SDK reads a stream of it:
outline.partial_json against jiter's partial mode (what anthropic's stream assembly calls)
on every prefix of several JSON texts, and parse_json_object's wrapping of what is not JSON."""
from __future__ import annotations

import json

import pytest

from procs.frontend.outline import parse_json_object, partial_json

jiter = pytest.importorskip("jiter")

DOCS = [json.dumps({"city": "Paris", "n": 12.5, "tags": ["a", 'b"c', "\\u00e9"], "deep": {"x": [1, {"y": None}],
                                                                                        "t": True}, "e": "é"},
                   ensure_ascii=False),
        json.dumps([1, "two", {"three": [3, False]}, -0.5e3, 1e5]),
        '{"path": "a.py", "edits": [{"old": "x = {1: \\"}\\"}", "new": ""}]}',
        '{ "spaced" : [ 1 , 2 ] , "k" : null }']


@pytest.mark.parametrize("doc", DOCS)
def test_every_prefix_reads_as_the_sdk_reads_it(doc):
    for k in range(1, len(doc) + 1):
        cut = doc[:k]
        try:
            want = jiter.from_json(cut.encode(), partial_mode=True)
        except ValueError:
            want = ValueError
        try:
            got = partial_json(cut)
        except ValueError:
            got = ValueError
        assert got == want, cut


def test_what_is_not_an_object_is_wrapped():
    assert parse_json_object('{"city": "Par') == {}
    assert parse_json_object('{"city": "Paris", "unit": "C') == {"city": "Paris"}
    assert parse_json_object("not json") == {"arguments": "not json"}
    assert parse_json_object('"a string"') == {"arguments": "a string"}
    assert parse_json_object("") == {}
