"""gguf_tensors.Lazy: a load's dict whose values are made when first read. Every way of
reading values makes them (no unmade placeholder escapes), each once; names alone make none."""
from __future__ import annotations

import pytest

from procs.inference.gguf_tensors import Lazy

READS = {
    "index": lambda d: {k: d[k] for k in list(d)},
    "get": lambda d: {k: d.get(k) for k in list(d)},
    "items": lambda d: dict(d.items()),
    "values": lambda d: dict(zip(list(d), d.values())),
    "copy": lambda d: d.copy(),
    "dict": lambda d: dict(d),
    "unpack": lambda d: {**d},
    "comprehension": lambda d: {k: v for k, v in d.items()},
}


def _lazy(made: list) -> Lazy:
    d = Lazy()
    d["plain"] = 0
    for i in (1, 2):
        d.later(f"made{i}", lambda i=i: made.append(i) or i * 10)
    return d


@pytest.mark.parametrize("read", sorted(READS))
def test_every_read_makes_the_values_once(read):
    made = []
    d = _lazy(made)
    assert READS[read](d) == {"plain": 0, "made1": 10, "made2": 20}
    assert sorted(made) == [1, 2]
    READS[read](d)
    assert sorted(made) == [1, 2]          # made once, then kept


def test_names_make_nothing_and_pop_makes_one():
    made = []
    d = _lazy(made)
    assert list(d) == ["plain", "made1", "made2"] and len(d) == 3 and "made2" in d
    assert made == []
    assert d.pop("made2") == 20 and made == [2] and "made2" not in d
    del d["made1"]
    assert made == [2] and dict(d) == {"plain": 0}
