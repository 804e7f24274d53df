"""Fixtures that start real servers (slow: each start loads the model), and a hook that adds
the servers' log tail to the report of a failed test."""
from __future__ import annotations

import pytest

from .server import Server


@pytest.fixture(scope="module")
def server():
    """The default settings with two web workers, shared by the tests of a module."""
    with Server(env={"WEB_CONCURRENCY": "2"}, name="ricordo-main") as srv:
        yield srv


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report gets the log tail of every server it used: its fixtures' by
    name, then any other still open (a fixture that yields a client, a server made inline)."""
    rep = yield
    if rep.failed:
        args = getattr(item, "funcargs", {}) or {}
        named = {id(v): k for k, v in args.items() if isinstance(v, Server)}
        for srv in [v for v in args.values() if isinstance(v, Server)] + \
                [s for s in list(Server.started) if id(s) not in named]:
            rep.sections.append((f"server log ({named.get(id(srv), srv.tmp.name)})", srv.tail()))
    return rep
