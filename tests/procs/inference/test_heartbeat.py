"""The inference loop's heartbeat (server.Heartbeat): while a step runs, a thread sends
InferenceBusy on its own socket every BUSY_EVERY_S, with the step's age; between steps it is
silent. Real ZMQ sockets on a temp ipc path."""
from __future__ import annotations

import time

import zmq

from common import messages as m
from procs.inference import server


def test_a_running_step_is_announced_and_an_idle_loop_is_silent(tmp_path, monkeypatch):
    monkeypatch.setattr(server, "BUSY_EVERY_S", 0.2)
    endpoint = f"ipc://{tmp_path}/events.sock"
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.bind(endpoint)
    dec = m.decoder(m.EventsIn)
    beat = server.Heartbeat(endpoint, "boot-1")
    try:
        with beat.step():
            time.sleep(1.1)
        got = []
        while pull.poll(300):
            got.append(dec.decode(pull.recv()))
        assert len(got) >= 3 and all(isinstance(x, m.InferenceBusy) and x.boot == "boot-1" for x in got)
        ages = [x.step_s for x in got]
        assert ages == sorted(ages) and 0.1 < ages[0] < ages[-1] <= 1.2, ages
        time.sleep(0.5)                                  # idle: nothing more
        assert not pull.poll(100)
    finally:
        beat.close()
        pull.close(0)
    assert not beat.thread.is_alive()
