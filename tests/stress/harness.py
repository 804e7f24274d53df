"""The four processes of the Procfile started one by one (not by honcho, which stops
everything when one exits), so that a test can kill -9 any one of them and start it again
alone: `Cluster`.

    with Cluster(env=CACHE_ENV) as c:          # web, renderer, inference, persister
        c.kill("persister")                     # SIGKILL to its process group
        c.start("persister", env={"RICORDO_KV_DISK_SPACE_MB": "1"})
        c.client().completions.create(...)

Every process runs the exact command line of its Procfile entry (`sh -c 'exec <line>'`, so
the pid is the process itself), in the repository, with the same environment honcho would
give it: PORT, RICORDO_RUN_DIR (shared), and the RICORDO_* of the test. Each process has
its own log file (`<tmp>/<name>.log`, appended across restarts).

When the tests run as root, every process runs under `setpriv` without CAP_DAC_OVERRIDE,
CAP_DAC_READ_SEARCH and CAP_FOWNER, so file modes (a read-only cache directory) bind them
as they bind an ordinary user.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from tests.e2e.cachedir import entries, longest_prefix_entry, temp_files, text_model  # noqa: F401 (for the tests)
from tests.e2e.cachedir import settle as _settle
from tests.e2e.server import REPO, Clients, child_env, free_port

PROCS = ("web", "renderer", "inference", "persister")
START_TIMEOUT_S = float(os.environ.get("RICORDO_STRESS_START_TIMEOUT", "240"))
KILL_AFTER_S = 10.0

# small cache settings (as tests/e2e/test_disk_cache.py): prompts of ~70 tokens get every kind
# of checkpoint
CACHE_ENV = {
    "RICORDO_KV_CACHE_MIN_TOKENS": "32",
    "RICORDO_KV_CACHE_BOUNDARY_ALIGN_TOKENS": "32",
    "RICORDO_KV_CACHE_BOUNDARY_TRIM_TOKENS": "4",
    "RICORDO_KV_CACHE_CONTINUED_INTERVAL_TOKENS": "64",
}
DROP_CAPS = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"]


def procfile_commands(path: Path = REPO / "Procfile") -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        name, sep, cmd = line.partition(":")
        if sep and name.strip() and not name.lstrip().startswith("#"):
            out[name.strip()] = cmd.strip()
    return out


def unprivileged() -> bool:
    """True when file modes bind this process's children (not root, or setpriv works)."""
    return os.geteuid() != 0 or shutil.which("setpriv") is not None


class ClusterError(RuntimeError):
    pass


class Cluster(Clients):
    timeout_s = 300.0

    def __init__(self, env: dict[str, str] | None = None, name: str = "stress", kv: bool = True,
                 trace: bool = True):
        self.tmp = Path(tempfile.mkdtemp(prefix=f"ricordo-{name}-"))
        self.run_dir = self.tmp / "run"
        self.kv_dir = self.tmp / "kv"
        self.trace_path = self.tmp / "trace"
        self.port = free_port()
        self.extra = {k: str(v) for k, v in (env or {}).items()}
        # one resident session: the campaign's tests drive conversations to disk by sending
        # another prompt ("the live session moves on"); several sessions are tests/e2e/test_sessions.py's
        self.extra.setdefault("RICORDO_MAX_LIVE_SESSIONS", "1")
        if kv:
            self.extra.setdefault("RICORDO_KV_DISK_DIR", str(self.kv_dir))
        if trace:
            self.extra.setdefault("RICORDO_TRACE", str(self.trace_path))
        self.overrides: dict[str, dict[str, str]] = {p: {} for p in PROCS}
        self.commands = procfile_commands()
        self.procs: dict[str, subprocess.Popen] = {}
        self.known: dict[str, list[psutil.Process]] = {}
        self.starts = {p: 0 for p in PROCS}
        self.health: dict | None = None

    @property
    def model(self) -> str:
        return (self.health or {}).get("model", "")

    # -- processes --
    def env(self, name: str) -> dict[str, str]:
        return child_env(self.port, self.run_dir, {**self.extra, **self.overrides[name]})

    def log_path(self, name: str) -> Path:
        return self.tmp / f"{name}.log"

    def log(self, name: str) -> str:
        try:
            return self.log_path(name).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_size(self, name: str) -> int:
        try:
            return self.log_path(name).stat().st_size
        except FileNotFoundError:
            return 0

    def tail(self, n: int = 40) -> str:
        out = []
        for p in PROCS:
            lines = self.log(p).splitlines()[-n:]
            out.append(f"---- {p} ({self.log_path(p)}) ----\n" + "\n".join(lines))
        return "\n".join(out)

    def start(self, *names: str, env: dict[str, str | None] | None = None, wait: bool = True,
              timeout: float = START_TIMEOUT_S) -> "Cluster":
        """Start the named processes (all four by default). `env` overrides the settings of
        these processes from now on (a value None drops an override)."""
        names = names or PROCS
        self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for name in names:
            if self.alive(name):
                raise ClusterError(f"{name} is already running")
            for k, v in (env or {}).items():
                if v is None:
                    self.overrides[name].pop(k, None)
                else:
                    self.overrides[name][k] = str(v)
            cmd = ["sh", "-c", "exec " + self.commands[name]]
            if os.geteuid() == 0 and shutil.which("setpriv"):
                cmd = DROP_CAPS + cmd
            logf = open(self.log_path(name), "ab")
            logf.write(f"==== start {time.strftime('%H:%M:%S')} ({self.starts[name] + 1})\n".encode())
            logf.flush()
            self.procs[name] = subprocess.Popen(cmd, cwd=REPO, env=self.env(name), stdin=subprocess.DEVNULL,
                                                stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
            logf.close()
            self.starts[name] += 1
        if wait:
            self.wait_ready(timeout)
        return self

    def alive(self, name: str) -> bool:
        p = self.procs.get(name)
        return p is not None and p.poll() is None

    def all_alive(self) -> bool:
        return all(self.alive(p) for p in PROCS)

    def dead(self) -> list[str]:
        return [p for p in PROCS if not self.alive(p)]

    def processes(self, name: str) -> list[psutil.Process]:
        """The process and everything in its process group (gunicorn's workers)."""
        p = self.procs.get(name)
        if p is None or p.poll() is not None:
            return []
        found = {}
        try:
            root = psutil.Process(p.pid)
            found[root.pid] = root
            for c in root.children(recursive=True):
                found[c.pid] = c
        except psutil.NoSuchProcess:
            pass
        self.known.setdefault(name, [])
        self.known[name] = [x for x in {**{q.pid: q for q in self.known[name]}, **found}.values()]
        return [x for x in found.values() if _alive(x)]

    def rss(self) -> dict[str, int]:
        """Resident bytes of every process (a web's workers as web/<pid>)."""
        out = {}
        for name in PROCS:
            for p in self.processes(name):
                try:
                    key = name if p.pid == self.procs[name].pid else f"{name}/{p.pid}"
                    out[key] = p.memory_info().rss
                except psutil.Error:
                    pass
        return out

    def kill(self, name: str, sig: int = signal.SIGKILL, timeout: float = KILL_AFTER_S) -> None:
        """Signal the process group of `name` and wait until every process of it is gone."""
        p = self.procs.get(name)
        if p is None:
            return
        members = self.processes(name) + self.known.get(name, [])
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)
        left = [m for m in members if _alive(m)]
        if left:
            psutil.wait_procs(left, timeout=timeout)
            for m in left:
                if _alive(m):
                    m.kill()
        self.known[name] = []

    def stop(self) -> None:
        for name in PROCS:
            if self.alive(name):
                try:
                    os.killpg(self.procs[name].pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + KILL_AFTER_S
        for name in PROCS:
            p = self.procs.get(name)
            if p is None:
                continue
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
            self.kill(name)

    def close(self) -> None:
        self.stop()
        if self._client is not None:
            self._client.close()
            self._client = None
        if self.kv_dir.exists():
            os.chmod(self.kv_dir, 0o700)
        if os.environ.get("RICORDO_STRESS_KEEP"):
            print(f"kept {self.tmp}")
            return
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "Cluster":
        try:
            return self.start()
        except BaseException:
            print(self.tail())
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        if exc[0] is not None:
            print(self.tail())
        self.close()

    # -- waiting --
    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> dict:
        """/health 200: web up, renderer answering, inference heard from lately."""
        def dead():
            gone = self.dead()
            return f"{gone} exited" if gone else None
        self.health = self.poll_health(timeout, dead, ClusterError)
        for n in PROCS:
            self.processes(n)
        return self.health

    def wait_answering(self, timeout: float = START_TIMEOUT_S) -> float:
        """Until the web answers anything (any status of GET /health): the first moment a
        client can send; the seconds that took."""
        t0 = time.monotonic()
        with httpx.Client(timeout=5.0) as c:
            while time.monotonic() - t0 < timeout:
                gone = self.dead()
                if gone:
                    raise ClusterError(f"{gone} exited before the web answered\n" + self.tail())
                try:
                    c.get(self.base_url + "/health")
                    return time.monotonic() - t0
                except httpx.HTTPError:
                    time.sleep(0.01)
        raise ClusterError(f"the web did not answer in {timeout:.0f} s\n" + self.tail())

    def wait_log(self, name: str, pattern: str, since: int = 0, timeout: float = 60.0) -> re.Match:
        """The first match of `pattern` in the log of `name` after byte offset `since`."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with open(self.log_path(name), "rb") as f:
                    f.seek(since)
                    text = f.read().decode(errors="replace")
            except FileNotFoundError:
                text = ""
            found = rx.search(text)
            if found:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(f"{pattern!r} not in the {name} log after {timeout:.0f} s\n" + self.tail())
            if not self.alive(name):
                raise AssertionError(f"{name} exited while waiting for {pattern!r}\n" + self.tail())
            time.sleep(0.1)

    def start_persister(self, env=None, timeout: float = 60.0) -> None:
        """Start the persister alone and wait for its startup line (the scan is done)."""
        since = self.log_size("persister")
        self.start("persister", env=env, wait=False)
        self.wait_log("persister", r"cache dir .*entries|stopping", since, timeout)

    def trace(self) -> str:
        try:
            return self.trace_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ------------------------------------------------------------------ the cache directory

def settle(d, trace_path, quiet: float = 1.5, timeout: float = 120.0) -> None:
    """cachedir.settle with the patience a loaded stress run needs."""
    _settle(d, trace_path, quiet, timeout)


def check_dir(d) -> tuple[int, list[tuple[str, list[str]]]]:
    """(entries checked, [(name, problems)] for every torn or partial entry): every
    `<sha1>.kv` must pass kvfile.verify (which also checks SHA1(text) == the name)."""
    from common import kvfile
    bad, n = [], 0
    for sha in entries(d):
        path = os.path.join(d, sha + ".kv")
        problems = kvfile.verify(path)
        if problems == [] or (len(problems) == 1 and problems[0].startswith("unreadable") and not os.path.exists(path)):
            n += problems == []
            continue
        n += 1
        bad.append((sha, problems))
    return n, bad


WORDS = ("harbour lantern orchard copper violin meadow glacier pepper saddle canyon thimble "
         "quarry falcon biscuit marble tundra walnut ribbon furnace pebble comet satchel "
         "cobalt trellis juniper anchor velvet cinder hazel mosaic parsley beacon granite "
         "ferry lagoon tinsel cactus sparrow timber olive rocket basket summit willow").split()


def prose(seed: int, n_words: int) -> str:
    """Deterministic filler text: different seeds differ from the first word on."""
    import random
    rnd = random.Random(seed)
    return " ".join(rnd.choice(WORDS) for _ in range(n_words))


def unique_prompt(tag: str, seed: int, n_words: int = 90) -> str:
    return f"Log {tag}-{seed}: " + prose(seed, n_words) + ". Summary:"
