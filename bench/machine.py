"""What every benchmark needs of the machine it runs on: the CPU named next to each figure,
memory (current and peak RSS), and how much other processes took of the CPUs while a sample
ran (run-queue wait), with a wait for a quiet machine before each timed sample. Light: it
imports no model code, so any bench names its CPU without loading torch's kernels."""
from __future__ import annotations

import os
import platform
import resource
import time


def rss_mb() -> tuple[float, float]:
    """(current, peak) resident set size in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0   # KiB on Linux
    try:
        import psutil
        cur = psutil.Process().memory_info().rss / 2**20
    except ImportError:
        with open("/proc/self/statm") as f:
            cur = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return cur, peak


def run_delay_s() -> float:
    """Seconds this process's threads have spent runnable but waiting for a CPU."""
    tot = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                tot += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            pass
    return tot / 1e9


def cpu_idle(window: float) -> float:
    """Machine-wide idle fraction over `window` seconds (/proc/stat; 1.0 when unreadable).
    Called only by benches that time the model, so the import costs nothing there."""
    from procs.inference.threads import cpu_ticks
    i0, t0 = cpu_ticks()
    time.sleep(window)
    i1, t1 = cpu_ticks()
    return (i1 - i0) / (t1 - t0) if t1 > t0 else 1.0


QUIET = {"max_s": 0.0, "idle": 0.7, "waited_s": 0.0}


def wait_quiet() -> None:
    """Before a timed sample: wait (at most --wait-quiet s) until other processes leave the
    CPUs mostly idle, so that fewer samples land in someone else's test run."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < QUIET["max_s"]:
        if cpu_idle(0.5) >= QUIET["idle"]:
            break
    QUIET["waited_s"] += time.perf_counter() - t0


class Timer:
    """Wall time plus contention: run-queue wait / (wall * threads), 0 = had the CPUs to itself."""

    def __init__(self, quiet: bool = True):
        self.quiet = quiet

    def __enter__(self):
        if self.quiet:
            wait_quiet()
        self.d0, self.t0 = run_delay_s(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.s = time.perf_counter() - self.t0
        import torch   # the threads the timed code ran on (loaded already by whoever times it)
        self.wait = (run_delay_s() - self.d0) / max(self.s * torch.get_num_threads(), 1e-9)


def cpu_name() -> str:
    """The CPU model and the flags that decide the kernels (named next to every figure)."""
    try:
        info = open("/proc/cpuinfo").read().split("\n\n")[0]
    except OSError:
        return platform.processor()
    fields = dict(ln.split(":", 1) for ln in info.splitlines() if ":" in ln)
    flags = [f for f in fields.get("flags\t\t", "").split() if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")]
    name = fields.get("model name\t", "?").strip()
    out = f"{name} ({' '.join(flags) or 'no avx2'})"
    march, aten = os.environ.get("RICORDO_KERNEL_MARCH", "native"), os.environ.get("ATEN_CPU_CAPABILITY", "")
    if march != "native" or aten:   # `make bench-avx2`: another machine class emulated on this one
        out += f", emulating a narrower CPU: kernels -march={march}, torch {aten or 'default'}"
        try:
            import llama_cpp
            info = llama_cpp.llama_print_system_info().decode()
            out += ", llama.cpp " + " ".join(f.split(" =")[0].strip() for f in info.split("|")
                                             if f.strip().endswith("= 1") and "AVX" in f)
        except Exception:   # noqa: BLE001 - no peer installed: nothing to name
            pass
    return out
