"""Decode's thread count chosen by measurement (procs/inference/threads.py): the controller on
given step times, and the invariant that makes it safe, on the real model: a decode step's
logits are bit for bit the same at any thread count, single and batched, bf16 and f32."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from procs.inference import threads as th
from procs.inference.kvsession import KVSession
from procs.inference.steps import decode_many
from procs.inference.loader import load
from procs.inference.model import Llama
from procs.inference.threads import DecodeThreads, candidates


class Machine:
    """/proc/stat's first line as the controller reads it: ticks (100 a second a CPU) in all
    and idle, advanced by the steps drive() runs."""

    def __init__(self, n_cpus: int):
        self.n, self.idle, self.total = n_cpus, 0.0, 0.0

    def ticks(self) -> tuple[int, int]:
        return int(self.idle), int(self.total)

    def run(self, seconds: float, busy_cores: int) -> None:
        self.total += 100 * seconds * self.n
        self.idle += 100 * seconds * max(self.n - busy_cores, 0)


def controller(full: int = 2, **kw) -> DecodeThreads:
    mach = Machine(full)
    ctl = DecodeThreads(full, ticks=mach.ticks, n_cpus=full, **kw)
    ctl.machine = mach
    return ctl


@dataclasses.dataclass
class Load:
    """A decode step's time on n threads, with `others` cores kept busy by other processes."""
    cost: object
    others: int = 0

    def __call__(self, n: int) -> float:
        return self.cost[n] if isinstance(self.cost, dict) else self.cost(n)


def drive(ctl: DecodeThreads, load: Load, seconds: float, shape=1) -> dict[int, float]:
    """Decode for `seconds` of decode time; the seconds spent at each count."""
    spent: dict[int, float] = {}
    end = ctl.clock + seconds
    while ctl.clock < end:
        n = ctl.pick(shape)
        dt = load(n)
        spent[n] = spent.get(n, 0.0) + dt
        ctl.machine.run(dt, n + load.others)
        ctl.record(n, dt)
    return spent


QUIET = Load({2: 3.0e-3, 1: 4.5e-3})               # 2 cores, nothing else running
BUSY = Load({2: 9.0e-3, 1: 4.6e-3}, others=1)      # one core taken: 2 threads wait at their barriers


def test_candidates_halve_down_to_one():
    assert candidates(16) == [16, 8, 4, 2, 1]
    assert candidates(6) == [6, 3, 1]
    assert candidates(1) == [1] and candidates(0) == [1]


def test_a_quiet_machine_keeps_every_thread_and_probes_ever_less():
    ctl = controller(2)
    spent = drive(ctl, QUIET, 120)
    assert ctl.current == 2 and ctl.switches == 0
    assert ctl.period == th.MAX_PERIOD_S
    # probes cost their one-thread blocks only: little once the period has grown
    assert spent[1] < 0.03 * 120, spent


def test_a_busy_core_moves_decode_to_one_thread_and_back_when_it_is_free():
    ctl = controller(2)
    drive(ctl, BUSY, th.MIN_PERIOD_S * (1 + th.JITTER) + th.BLOCKS * th.BLOCK_S + 0.05)
    assert ctl.current == 1
    spent = drive(ctl, BUSY, 60)
    assert spent[1] > 0.9 * sum(spent.values()), spent
    drive(ctl, QUIET, th.MAX_PERIOD_S * (1 + th.JITTER) + th.BLOCKS * th.BLOCK_S + 0.05)   # the core is free again
    assert ctl.current == 2 and ctl.switches == 2


def test_more_threads_are_tried_only_on_idle_cores():
    """Held at 1 thread beside a process that keeps the other core busy, a probe of 2 threads
    would stall (one step of 1.5 s seen): none is run until a core is idle again."""
    ctl = controller(2)
    ctl.i = 1                                          # at 1 thread already
    spent = drive(ctl, BUSY, 60)
    assert set(spent) == {1} and ctl.period == th.MAX_PERIOD_S
    drive(ctl, QUIET, th.MAX_PERIOD_S * (1 + th.JITTER) + th.BLOCKS * th.BLOCK_S + 0.05)   # it left
    assert ctl.current == 2


def test_a_short_slowdown_does_not_start_a_probe():
    """Another server's probe (two blocks of more threads) slows this one for a moment only."""
    ctl = controller(2)
    drive(ctl, QUIET, 60)
    while ctl.probe is not None:                       # one under way ends first (periods are
        drive(ctl, QUIET, 0.05)                        # random: 2 seeds in 300 had one at 60 s)
    ctl.next_probe = before = ctl.clock + 100          # no probe due
    ctl.watch = [0.0, 0]                               # a window begins with the slowdown
    drive(ctl, BUSY, th.WATCH_S * (th.SLOW_WINDOWS - 1))
    drive(ctl, QUIET, 1.0)
    assert ctl.next_probe == before and ctl.probe is None


def test_periods_vary_so_that_two_servers_do_not_probe_in_step():
    a, b = controller(2), controller(2)
    drive(a, QUIET, 5)
    drive(b, QUIET, 5)
    assert a.next_probe != b.next_probe


def test_a_process_that_begins_is_noticed_before_the_period_ends():
    ctl = controller(2)
    drive(ctl, QUIET, 60)
    assert ctl.period == th.MAX_PERIOD_S and ctl.current == 2
    drive(ctl, BUSY, th.WATCH_S * (th.SLOW_WINDOWS + 1) + th.BLOCKS * th.BLOCK_S + 0.05)   # << MAX_PERIOD_S
    assert ctl.current == 1


def test_rare_long_stalls_count_against_a_count():
    """What a busy core does to 2 threads: most steps fast, one in ten held up a time slice."""
    stalls = iter(range(10**9))
    ctl = controller(2)
    drive(ctl, Load(lambda n: 4.6e-3 if n == 1 else (100e-3 if next(stalls) % 10 == 9 else 3.3e-3), others=1), 30)
    assert ctl.current == 1


def test_a_clearly_slower_first_block_ends_the_probe():
    ctl = controller(2)
    drive(ctl, QUIET, 30)
    assert ctl.period == th.MAX_PERIOD_S
    ctl.next_probe = ctl.clock + 1.0
    drive(ctl, QUIET, 1.0 + th.BLOCK_S + 0.01)           # a watch window, then one block at 1 thread
    assert ctl.probe is None and ctl.next_probe > ctl.clock + th.MIN_PERIOD_S


def test_a_growing_context_does_not_probe_at_every_window():
    """Steps slow down as the context grows (attention reads more rows): a probe each time
    they are 1.5x slower than at the last probe, not one a window once they are."""
    ctl = controller(2)
    drive(ctl, QUIET, 30)
    probes = []
    orig = ctl._decided
    ctl._decided = lambda *a, **k: (probes.append(ctl.clock), orig(*a, **k))
    for k in range(1, 41):        # 40 s of decode, steps 3 -> 9 ms
        drive(ctl, Load({2: 3.0e-3 * (1 + k / 20), 1: 4.5e-3 * (1 + k / 20)}), 1.0)
    assert len(probes) <= 8, probes


def test_a_close_call_keeps_the_count_and_probes_again_soon():
    ctl = controller(2)
    drive(ctl, Load({2: 3.0e-3, 1: 3.1e-3}), 5)
    assert ctl.current == 2 and ctl.period == th.MIN_PERIOD_S


def test_a_batch_that_changes_mid_probe_starts_the_probe_again():
    ctl = controller(2)
    ctl.next_probe = 0.0
    drive(ctl, BUSY, 2.5 * th.BLOCK_S)   # most of a probe at batch 1
    assert ctl.probe
    # at batch 2 both counts cost the same: the probe begun at batch 1 must not decide
    drive(ctl, Load({2: 5e-3, 1: 5e-3}), th.BLOCKS * th.BLOCK_S + 0.05, shape=2)
    assert ctl.current == 2 and ctl.switches == 0


def test_drafted_steps_give_way_to_probes_and_are_not_timed(monkeypatch):
    """A decode that drafts (lookup.speculate) runs steps of 2-9 rows, whose times are not
    comparable: they run untimed at the current count, only moving the clock, and while a
    probe is due or running the decode takes plain steps (`due`), which the probe times. A
    busy core still moves decode to one thread, the drafted steps with it."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    ctl = controller(2)
    rng = random.Random(5)
    plain = drafted = 0
    seen = set()
    try:
        while ctl.clock < 3.0:
            if ctl.due:
                n = ctl.pick(1)
                ctl.machine.run(BUSY(n), n + 1)
                ctl.record(n, BUSY(n))
                plain += 1
            else:
                rows = rng.randint(2, 9)
                monkeypatch.setattr(th.time, "perf_counter", iter([0.0, rows * BUSY(ctl.current)]).__next__)
                seen.add(ctl.untimed(torch.get_num_threads))
                monkeypatch.undo()
                drafted += 1
    finally:
        torch.set_num_threads(before)
    assert ctl.current == 1 and ctl.switches == 1 and plain and drafted > plain
    assert seen == {1, 2} and torch.get_num_threads() == before


def test_many_cores_climb_to_the_fastest_count():
    ctl = controller(16)
    drive(ctl, Load({16: 20e-3, 8: 9e-3, 4: 5e-3, 2: 6e-3, 1: 10e-3}, others=10), 60)   # 10 busy cores of 16
    assert ctl.current == 4, ctl.current


def test_off_or_one_thread_never_probes():
    for ctl in (controller(2, enabled=False), controller(1)):
        assert set(drive(ctl, Load({2: 9e-3, 1: 1e-3}), 10)) == {ctl.counts[0]}


def test_step_runs_on_the_picked_count_and_restores_the_configured_one():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ctl = controller(2)
        ctl.clock = ctl.next_probe                  # a probe begins with the next step
        seen = [ctl.step(torch.get_num_threads) for _ in range(2)]
        assert seen == [1, 1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_decode_logits_do_not_depend_on_the_thread_count(model_path, dtype):
    model = Llama(load(model_path, dtype, "cpu"), 2048)
    before = torch.get_num_threads()

    def answer(counts) -> list[torch.Tensor]:
        rng = random.Random(0)
        sessions = [KVSession(model, 2048, 256) for _ in range(3)]
        for i, s in enumerate(sessions):
            s.prefill([rng.randrange(100, 40000) for _ in range(200 + 61 * i)])
        out = []
        for step, n in enumerate(counts):
            torch.set_num_threads(n)
            tokens = [rng.randrange(100, 40000) for _ in sessions]
            if step % 2:
                out += [x.clone() for x in decode_many(sessions, tokens)]
            else:
                out.append(sessions[0].decode(tokens[0]).clone())
        return out
    try:
        torch.set_num_threads(2)
        fixed = answer([2] * 6)
        mixed = answer([1, 2, 1, 1, 2, 1])
    finally:
        torch.set_num_threads(before)
    assert len(fixed) == len(mixed) == 12
    assert all(torch.equal(a, b) for a, b in zip(fixed, mixed))


def test_a_core_that_comes_free_is_noticed_before_the_period_ends():
    """At 1 thread beside a busy process, the probes have grown to MAX_PERIOD_S; when the
    process ends, the idle core brings a probe of 2 threads within a few windows."""
    ctl = controller(2)
    ctl.i = 1
    drive(ctl, BUSY, 60)
    assert ctl.current == 1 and ctl.period == th.MAX_PERIOD_S
    drive(ctl, QUIET, th.WATCH_S * (th.FREE_WINDOWS + 1) + th.BLOCKS * th.BLOCK_S + 0.05)   # << MAX_PERIOD_S
    assert ctl.current == 2


def test_idle_time_more_threads_cannot_use_does_not_probe_at_every_window():
    """Idle cores all along, yet 2 threads slower (say a process that wakes often): only the
    periodic probes, which grow apart, try 2 threads."""
    ctl = controller(2)
    ctl.i = 1
    spent = drive(ctl, Load({2: 9.0e-3, 1: 4.6e-3}), 120)
    assert ctl.current == 1 and spent[2] < 0.03 * 120, spent
