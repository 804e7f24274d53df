"""The stress campaign: crashes, disk faults, corrupted checkpoints, bad HTTP input,
load, security.

Scale: `RICORDO_STRESS=full` runs the whole campaign (`make stress`); by default (`make test`)
a fast subset runs: a few kills, ~100 mutations, a few hundred HTTP examples, a tiny load.
Tests marked `full_only` are skipped in the fast subset.

Most tests share one `cluster` (the four processes started one by one, see harness.py) for
the whole session, because every start loads the model; a test that restarts a process
with other settings puts it back as it was. Every test appends what it measured to
`Stats`, printed at the end of the run (the numbers of bench/RESULTS-stress.md).
"""
from __future__ import annotations

import json
import os
import time

import pytest

from .harness import CACHE_ENV, Cluster

FULL = os.environ.get("RICORDO_STRESS", "").strip().lower() in ("full", "1", "yes")


def scale(fast, full):
    return full if FULL else fast


full_only = pytest.mark.skipif(not FULL, reason="full stress campaign only (RICORDO_STRESS=full)")

# the shared cluster: the small cache settings, a budget that the load test makes LRU evict
CLUSTER_ENV = dict(CACHE_ENV, RICORDO_KV_DISK_SPACE_MB="1024", WEB_CONCURRENCY="2")


class Stats:
    """Counts and measurements of the campaign, printed at the end (and to
    $RICORDO_STRESS_REPORT as JSON when that is set)."""
    rows: dict[str, dict] = {}
    t0 = time.monotonic()

    @classmethod
    def add(cls, key: str, **values) -> None:
        row = cls.rows.setdefault(key, {})
        for k, v in values.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(row.get(k), (int, float)):
                row[k] += v
            else:
                row[k] = v


@pytest.fixture(scope="session")
def cluster():
    c = Cluster(env=CLUSTER_ENV, name="stress")
    t0 = time.monotonic()
    with c:
        Stats.add("cluster", start_s=round(time.monotonic() - t0, 1))
        yield c


@pytest.fixture
def healthy(cluster):
    """The cluster, checked whole before and after the test (a test that kills a process
    starts it again; one that fails to is reported here)."""
    dead = cluster.dead()
    for name in dead:
        cluster.start(name, wait=False)
    if dead:
        cluster.wait_ready()
    yield cluster
    assert cluster.all_alive(), f"processes died during the test: {cluster.dead()}\n" + cluster.tail()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    if rep.failed and hasattr(item, "funcargs"):
        for name in ("cluster", "healthy"):
            c = item.funcargs.get(name)
            if isinstance(c, Cluster):
                rep.sections.append(("cluster logs", c.tail()))
                break
    return rep


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not Stats.rows:
        return
    tr = terminalreporter
    tr.section(f"stress campaign ({'full' if FULL else 'fast subset'}): "
               f"{time.monotonic() - Stats.t0:.0f} s")
    for key, row in Stats.rows.items():
        tr.write_line(f"{key}: " + ", ".join(f"{k}={v}" for k, v in row.items()))
    out = os.environ.get("RICORDO_STRESS_REPORT")
    if out:
        with open(out, "w") as f:
            json.dump({"full": FULL, "rows": Stats.rows}, f, indent=1, default=str)
