"""Decode's CPU thread count, chosen by measuring decode steps while the server runs.

A decode step is a few hundred short OpenMP regions, each ended by a barrier; when another
process takes one of the cores (a build or test run an agent started, a second server), the
thread that lost its core holds every barrier up for a scheduler time slice. Measured on a
2-core Zen 4 (SmolLM2-135M, bf16, 512 context): 2 threads 293 tok/s alone, 112 with one busy
process beside it, 76 each for two servers at once; 1 thread 216 alone, 216 beside the busy
process, 200 each for two servers. So the thread count is not fixed: the loop runs decode at the
current count, and now and then (a probe) alternates it with a neighbouring count in blocks of
decode time and keeps whichever took less time a step (a first block far slower than the current
count's last window ends it there). A probe that confirms the current count by a wide margin
makes the wait before the next one GROW times longer (up to MAX_PERIOD_S of decode time); a
switch, or a close call, brings it back to MIN_PERIOD_S; steps that turn much slower than the
last probe measured (a process that just began) bring the next probe forward, and so do
cores that come free while decode runs on fewer threads than configured (the other process
ended: /proc/stat shows the idle time, FREE_WINDOWS in a row after a window without it). A
probe of more threads waits for idle CPU time to try them on: with none, it counts as one
that confirmed the current count.

Invariant that makes this safe: the decode kernels' results do not depend on the thread count
(every output row, and every attention chunk's partial, is computed by one thread and combined
in a fixed order; tests/procs/inference/test_threads.py checks the logits bit for bit), so an
answer is the same whichever count its steps ran on, with --deterministic too. Prefill keeps
the configured count: its GEMMs are not held to that invariant.
"""
from __future__ import annotations

import os
import random
import time
from typing import Callable, TypeVar

import torch

from common import metrics

T = TypeVar("T")

FIRST_PROBE_S = 0.1   # decode seconds before the first probe: a server learns the machine early
MIN_PERIOD_S = 0.5    # decode seconds between probes after a switch or a close call
MAX_PERIOD_S = 16.0   # ... at most, while probes keep confirming the current count (x GROW each)
GROW = 4
BLOCK_S = 0.1         # a probe: blocks of at least this many decode seconds (one step where
BLOCKS = 4            # a step takes longer), other count, current, other, current: a thread
                      # that lost its core stalls a step for a time slice now and then, which
                      # single alternated steps would miss
SWITCH = 0.92         # the other count's time a step below this fraction of the current's: switch
CONFIRM = 1.25        # ... above this multiple: the current count is clearly right (wait longer)
WATCH_S = 0.25        # between probes, steps are timed in windows of this many seconds;
SLOWER = 1.5          # SLOW_WINDOWS in a row this much slower a step than the last probe found:
SLOW_WINDOWS = 2      # probe at once (not for one probe of another server, which lasts < 2)
JITTER = 0.25         # periods vary this much either way: two servers on one machine do not
                      # probe in step (both on more threads at once is the worst case of all)
FREE_WINDOWS = 2      # watch windows in a row with idle cores for more threads, after one
                      # without: probe more threads at once (only on that change, so that
                      # idle time more threads cannot use does not probe at every window)
FREE_SHARE = 0.5      # a probe of more threads needs this share of the extra threads' cores
                      # idle over the last window: on a machine that others keep busy, one
                      # step on more threads took 1.5 s (two f32 servers on 2 cores)


def cpu_ticks() -> tuple[int, int]:
    """(idle, total) ticks of the whole machine so far (/proc/stat); (0, 0) where unreadable."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return 0, 0
    return v[3] + v[4], sum(v)


def candidates(full: int) -> list[int]:
    """full, then halves down to 1: the counts a probe moves between (16 -> 16 8 4 2 1)."""
    out = [max(full, 1)]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


class DecodeThreads:
    """step() runs one decode step on the count pick() gives (torch.set_num_threads: the
    native kernels share torch's OpenMP runtime) and records its wall time; everything else
    (prefill, sampling) keeps the configured count. Periods count decode time only."""

    @classmethod
    def for_model(cls, s, model, log=None) -> "DecodeThreads":
        """The configured count (torch's, as build() set it), adapting where --adapt-threads
        is on and the model runs on the CPU."""
        return cls(torch.get_num_threads(), s.adapt_threads and model.device.type == "cpu", log)

    def __init__(self, full: int, enabled: bool = True, log=None, ticks=cpu_ticks, n_cpus: int = 0):
        self.counts = candidates(full)
        self.ticks, self.n_cpus = ticks, n_cpus or os.cpu_count() or 1
        self.stat = self.last_stat = ticks()   # at the start of the last two watch windows
        self.enabled = enabled and len(self.counts) > 1
        self.i = 0                       # index of the current count in self.counts
        self.clock = 0.0                 # decode seconds recorded so far
        self.period = MIN_PERIOD_S
        self.next_probe = FIRST_PROBE_S  # on self.clock
        self.down = True                 # the direction of the next probe
        self.probe: list[list] | None = None   # blocks: [count index, seconds, steps]
        self.other = 0
        self.shape = None                # the shape of the steps being timed (batch size)
        # (seconds a step, shape) at the current count: last measured by a probe, and in the
        # last watch window
        self.ref: tuple[float, object] | None = None
        self.recent: tuple[float, object] | None = None
        self.watch = [0.0, 0]            # seconds, steps of the current window
        self.slow = 0                    # windows in a row slower than SLOWER * ref
        self.freed = -1                  # windows in a row with idle cores for more threads
                                         # since one without (-1: none without yet)
        self.rng = random.Random()
        self.log = log
        self.switches = 0
        metrics.M.decode_threads.set(self.current)

    @property
    def current(self) -> int:
        return self.counts[self.i]

    def _neighbour(self) -> int:
        """The index a probe tries: one step in self.down's direction, else the other way."""
        j = self.i + 1 if self.down else self.i - 1
        if not 0 <= j < len(self.counts):
            j = self.i - 1 if self.down else self.i + 1
        return j

    def pick(self, shape=None) -> int:
        """The thread count for the next decode step of this shape (its batch size: steps of
        another shape are not compared with each other)."""
        if not self.enabled:
            return self.counts[0]
        if shape != self.shape:
            self.watch, self.recent = [0.0, 0], None
            if self.probe is not None:   # the batch changed mid-probe: start it again
                self.probe, self.next_probe = None, self.clock
        self.shape = shape
        if self.probe is None:
            if self.clock < self.next_probe:
                return self.current
            self.other = self._neighbour()
            if self.other < self.i and not self._free(self.counts[self.other] - self.current):
                self._decided(switch=False, confirmed=True, outcome="no idle core")
                return self.current
            self.probe = [[self.other, 0.0, 0]]
        return self.counts[self.probe[-1][0]]

    def _free(self, extra: int, now: tuple[int, int] | None = None) -> bool:
        """Whether FREE_SHARE of `extra` cores were idle lately: since the last watch window
        began, or the one before where that is under 0.2 s (ticks are 10 ms a CPU)."""
        idle, total = now or self.ticks()
        since = self.stat if total - self.stat[1] >= 20 * self.n_cpus else self.last_stat
        d_total = total - since[1]
        if d_total <= 0:
            return True          # nothing to tell by: try
        return (idle - since[0]) / d_total * self.n_cpus >= FREE_SHARE * extra

    def record(self, n: int, seconds: float) -> None:
        """The step just run on n threads took seconds."""
        self.clock += seconds
        if self.probe is None:
            self._watch(seconds)
            return
        block = self.probe[-1]
        block[1] += seconds
        block[2] += 1
        if block[1] < BLOCK_S:
            return
        recent = self.recent
        if len(self.probe) == 1 and recent and recent[1] == self.shape and block[1] / block[2] > CONFIRM * recent[0]:
            # the other count is clearly slower than the current one was a moment ago: the
            # rest of the probe (which guards against a change in between) would only cost
            self.probe = None
            self._decided(switch=False, confirmed=True)
            return
        if len(self.probe) < BLOCKS:
            self.probe.append([self.i if block[0] == self.other else self.other, 0.0, 0])
            return
        self._decide()

    def _watch(self, seconds: float) -> None:
        """A step at the current count much slower than the last probe measured (another
        process began taking CPU time): probe at the next step."""
        self.watch[0] += seconds
        self.watch[1] += 1
        if self.watch[0] < WATCH_S:
            return
        per = self.watch[0] / self.watch[1]
        self.watch = [0.0, 0]
        self.last_stat, self.stat = self.stat, self.ticks()
        self.recent = per, self.shape
        slow = self.ref is not None and self.ref[1] == self.shape and per > SLOWER * self.ref[0]
        self.slow = self.slow + 1 if slow else 0
        if self.slow >= SLOW_WINDOWS:
            self.next_probe, self.slow = self.clock, 0
        if self.i > 0:
            if not self._free(self.counts[self.i - 1] - self.current, self.stat):   # read just now
                self.freed = 0
            elif self.freed >= 0:
                self.freed += 1
                if self.freed >= FREE_WINDOWS:
                    self.next_probe, self.down, self.freed = self.clock, False, -1

    def _decide(self) -> None:
        def per_step(idx: int) -> float:
            blocks = [b for b in self.probe if b[0] == idx]
            return sum(b[1] for b in blocks) / sum(b[2] for b in blocks)
        here, there = per_step(self.i), per_step(self.other)
        self.probe = None
        switch = there < SWITCH * here
        if switch and self.log:
            self.log.info("decode threads %d -> %d: %.2f ms a step against %.2f (another process "
                          "takes CPU time, or it left)", self.current, self.counts[self.other],
                          1e3 * there, 1e3 * here)
        self._decided(switch, there > CONFIRM * here, ref=(there if switch else here, self.shape))

    def _decided(self, switch: bool, confirmed: bool, outcome: str = "", ref=None) -> None:
        """A probe's end (or its skip). ref: what it measured at the count kept; without one,
        the last watch window's, so that steps a growing context slowed are the reference
        (else every window after it would ask for a probe)."""
        metrics.M.thread_probes.labels(outcome or ("switched" if switch else "kept")).inc()
        if ref is None and not switch and self.recent and self.recent[1] == self.shape:
            ref = self.recent
        if ref is not None:
            self.ref = ref
        if switch:
            self.down = self.other > self.i      # go on the same way next time
            self.i = self.other
            self.period = MIN_PERIOD_S
            self.recent = None                   # it timed the other count
            self.switches += 1
            metrics.M.decode_threads.set(self.current)
        elif confirmed:
            self.period = min(GROW * self.period, MAX_PERIOD_S)
            if len(self.counts) > 2:
                self.down = not self.down
        else:
            self.period = MIN_PERIOD_S
            self.down = not self.down
        self.next_probe = self.clock + self.period * self.rng.uniform(1 - JITTER, 1 + JITTER)
        self.watch, self.slow = [0.0, 0], 0

    @property
    def due(self) -> bool:
        """Whether a probe runs or is due: a step that would not be timed (a drafted step,
        whose rows vary from step to step: lookup.speculate) gives way to plain ones."""
        return self.enabled and (self.probe is not None or self.clock >= self.next_probe)

    def untimed(self, fn: Callable[[], T]) -> T:
        """A step at the current count that no probe or watch compares: its time only
        moves the clock on to the next probe."""
        return self._run(fn, self.current, timed=False)

    def step(self, fn: Callable[[], T], shape=None) -> T:
        return self._run(fn, self.pick(shape), timed=True)

    def _run(self, fn: Callable[[], T], n: int, timed: bool) -> T:
        full = self.counts[0]
        if n != full:
            torch.set_num_threads(n)
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            dt = time.perf_counter() - t0
            if n != full:
                torch.set_num_threads(full)
            if timed:
                self.record(n, dt)
            else:
                self.clock += dt
