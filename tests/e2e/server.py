"""Starting and stopping the real thing: `honcho start -f Procfile` with every process
(web, renderer, inference, ...), on a free port and a fresh run directory, as a context
manager.

    with Server(env={"RICORDO_CTX_SIZE": "256"}) as srv:
        srv.client().chat.completions.create(...)
        srv.stop()      # seconds until every process exited

Knows processes, ports and HTTP; nothing of the model. Every start gets its own temp
directory (run dir for the sockets, log file, honcho env file), so servers run side by
side with each other and with a `make serve` on the same machine.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = REPO / ".venv" / "bin"

START_TIMEOUT_S = 120.0     # model load takes ~20 s on a slow shared machine
KILL_AFTER_S = 10.0         # stop(): processes still there after this long are killed
LOG_TAIL = 80

# settings from the caller's environment that say where the model is or how to run it; every
# other RICORDO_* (and PORT, WEB_CONCURRENCY) is dropped so a test sees only what it asked for
KEEP_ENV = {"RICORDO_MODEL", "RICORDO_MODELS", "RICORDO_MODELS_DIR", "RICORDO_DEVICE", "RICORDO_DTYPE",
            "RICORDO_THREADS", "RICORDO_DETERMINISTIC", "RICORDO_KERNEL_MARCH", "RICORDO_CUDA_GRAPHS",
            "RICORDO_PREFILL_MATH"}


def child_env(port: int, run_dir, extra: dict) -> dict[str, str]:
    """The environment of a server started from here (honcho, or one Procfile process):
    the caller's, less its other RICORDO_* / PORT / WEB_CONCURRENCY, the venv first on
    PATH, then `extra` (a None value removes the variable)."""
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("RICORDO_") and k not in KEEP_ENV) and k not in ("PORT", "WEB_CONCURRENCY")}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(VENV_BIN.parent)
    env["PORT"] = str(port)
    env["RICORDO_RUN_DIR"] = str(run_dir)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}



def samples(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text -> {(sample name, sorted labels): value}."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            out[smp.name, tuple(sorted(smp.labels.items()))] = smp.value
    return out


def value(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)

class ServerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Clients:
    """Clients of a server at `self.port`: `timeout_s` long, no retries."""
    port: int
    timeout_s = 120.0
    _client = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kw):
        """An `openai.OpenAI` for this server. Without arguments, the same one each time (it
        stays usable across a restart: same port)."""
        import openai
        if not kw and self._client is not None:
            return self._client
        c = openai.OpenAI(base_url=self.base_url + "/v1", **{"api_key": "x", "timeout": self.timeout_s,
                                                            "max_retries": 0, **kw})
        if not kw:
            self._client = c
        return c

    def http(self, **kw) -> httpx.Client:
        kw.setdefault("timeout", self.timeout_s)
        return httpx.Client(base_url=self.base_url, **kw)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """GET /metrics parsed by prometheus-client: {(sample name, sorted labels): value}."""
        return samples(self.http().get("/metrics").text)

    def metric(self, name: str, **labels) -> float:
        """One sample of /metrics (0 when absent), e.g. metric("ricordo_x_total", phase="decode")."""
        return value(self.metrics(), name, **labels)

    def tail(self) -> str:
        return ""

    def poll_health(self, timeout: float, dead, error: type[Exception], every: float = 0.3) -> dict:
        """GET /health until it is 200 (its JSON). `dead()` names what exited early, if anything;
        that, or no 200 within `timeout`, raises `error` with the logs' tail."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        with httpx.Client(timeout=5.0) as c:
            while time.monotonic() < deadline:
                gone = dead()
                if gone:
                    raise error(f"{gone} before /health was 200\n" + self.tail())
                try:
                    r = c.get(self.base_url + "/health")
                    if r.status_code == 200:
                        return r.json()
                    last = f"{r.status_code} {r.text[:200]}"
                except httpx.HTTPError as e:
                    last = repr(e)
                time.sleep(every)
        raise error(f"/health not 200 after {timeout:.0f} s (last: {last})\n" + self.tail())


class Server(Clients):
    """One `honcho start` of the Procfile. `env` adds to (and overrides) the environment,
    e.g. WEB_CONCURRENCY, RICORDO_CTX_SIZE, RICORDO_KV_DISK_DIR; `concurrency` maps a
    process type to its count (honcho's `-c web=2`)."""
    started: "weakref.WeakSet[Server]" = weakref.WeakSet()   # not yet closed: their logs go with a failure

    def __init__(self, env: dict[str, str] | None = None, concurrency: dict[str, int] | None = None,
                 procfile: str | os.PathLike = REPO / "Procfile", start_timeout: float = START_TIMEOUT_S,
                 name: str = "ricordo"):
        self.extra_env = {k: str(v) for k, v in (env or {}).items()}
        self.concurrency = dict(concurrency or {})
        self.procfile = Path(procfile)
        self.start_timeout = start_timeout
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{name}-e2e-"))
        self.run_dir = self.tmp / "run"
        self.log_path = self.tmp / "honcho.log"
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.health: dict | None = None
        self._log = None
        self._known: dict[int, psutil.Process] = {}

    # -- lifecycle --
    def env(self) -> dict[str, str]:
        return child_env(self.port, self.run_dir, self.extra_env)

    def command(self) -> list[str]:
        envfile = self.tmp / "empty.env"          # no repo .env leaks into a test
        envfile.touch()
        cmd = [str(VENV_BIN / "honcho"), "start", "-f", str(self.procfile), "-d", str(REPO),
               "-e", str(envfile), "--no-colour"]
        if self.concurrency:
            cmd += ["-c", ",".join(f"{k}={v}" for k, v in self.concurrency.items())]
        return cmd

    def start(self, wait: bool = True) -> "Server":
        """Start honcho; with `wait`, return once /health is 200 (else at once)."""
        if self.running():
            raise ServerError("already started")
        self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self._log.write(f"==== start {time.strftime('%H:%M:%S')} port {self.port}\n".encode())
        self._log.flush()
        self._known = {}
        Server.started.add(self)
        self.proc = subprocess.Popen(self.command(), cwd=REPO, env=self.env(), stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        if not wait:
            return self
        try:
            self.wait_healthy(self.start_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self, timeout: float) -> dict:
        def dead():
            if self.proc.poll() is not None:
                return f"honcho exited with {self.proc.returncode}"
        self.health = self.poll_health(timeout, dead, ServerError)
        self.processes()        # remember every process while all are up
        return self.health

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def processes(self) -> list[psutil.Process]:
        """honcho and every process under it (its children, their children, and anything in
        its process group), as seen now; also remembered for stop()."""
        if self.proc is None:
            return []
        found: dict[int, psutil.Process] = {}
        try:
            root = psutil.Process(self.proc.pid)
            found[root.pid] = root
            for c in root.children(recursive=True):
                found[c.pid] = c
        except psutil.NoSuchProcess:
            pass
        pgid = self.proc.pid                      # start_new_session: honcho leads its group
        for p in psutil.process_iter():
            try:
                if p.pid not in found and os.getpgid(p.pid) == pgid:
                    found[p.pid] = p
            except (ProcessLookupError, psutil.Error, OSError):
                pass
        self._known.update(found)
        return [p for p in found.values() if _alive(p)]

    def children(self) -> list[psutil.Process]:
        """The live processes under honcho (not honcho itself)."""
        return [p for p in self.processes() if self.proc is None or p.pid != self.proc.pid]

    def stop(self, kill_after: float = KILL_AFTER_S) -> float:
        """SIGTERM to honcho; the seconds until honcho and every process under it exited.
        Whatever is left after `kill_after` seconds is killed (and the time returned is then
        at least kill_after)."""
        if self.proc is None:
            return 0.0
        self.processes()
        t0 = time.monotonic()
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        while True:
            self.proc.poll()                      # reap honcho as soon as it exits
            self.processes()                      # late children (a respawned worker) count too
            alive = [p for p in self._known.values() if _alive(p)]
            elapsed = time.monotonic() - t0
            if not alive:
                break
            if elapsed > kill_after:
                self._kill(alive)
                break
            time.sleep(0.02)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self.proc = None
        if self._log is not None:
            self._log.write(f"==== stopped in {elapsed:.2f} s\n".encode())
            self._log.close()
            self._log = None
        return elapsed

    def _kill(self, alive: list[psutil.Process]) -> None:
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        psutil.wait_procs(alive, timeout=5)

    def restart(self, **env) -> "Server":
        """stop(), then start() again on the same port and run dir (with `env` added)."""
        self.stop()
        self.extra_env.update({k: str(v) for k, v in env.items()})
        return self.start()

    def close(self) -> None:
        Server.started.discard(self)
        self.stop()
        if self._client is not None:
            self._client.close()
            self._client = None
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- the log --
    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, n: int = LOG_TAIL) -> str:
        lines = self.log_text().splitlines()[-n:]
        return f"---- last {len(lines)} lines of {self.log_path} ----\n" + "\n".join(lines)

    def wait_log(self, pattern: str, timeout: float = 30.0) -> re.Match:
        """The first match of the regular expression `pattern` in a log line, waiting for it
        up to `timeout` seconds."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            for line in self.log_text().splitlines():
                found = rx.search(line)
                if found:
                    return found
            if time.monotonic() > deadline:
                raise AssertionError(f"{pattern!r} not in the log after {timeout:.0f} s\n" + self.tail())
            time.sleep(0.2)

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        if exc[0] is not None and exc[0] is not ServerError:
            print(self.tail())
        self.close()


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
