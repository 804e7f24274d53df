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
    rep = yield
    if rep.failed:
        for name in getattr(item, "fixturenames", ()):
            srv = item.funcargs.get(name) if hasattr(item, "funcargs") else None
            if isinstance(srv, Server):
                rep.sections.append((f"server log ({name})", srv.tail()))
    return rep
