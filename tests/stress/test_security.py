"""6. Security: the listening address, the API key on every endpoint but /health, the modes
of the cache directory and its files, no request-controlled path on the file system, and
no pickle anywhere in the product code.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

import httpx
import psutil
import pytest

from .conftest import Stats, scale
from .harness import REPO, entries, settle, unique_prompt

ENDPOINTS = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/responses"),
             ("POST", "/v1/messages"), ("GET", "/v1/models"), ("GET", "/v1/models/x"), ("GET", "/metrics"),
             ("GET", "/slots"), ("GET", "/nope"), ("DELETE", "/v1/models"), ("GET", "/health")]


def test_binds_loopback_by_default(healthy):
    c = healthy
    listening = []
    for p in c.processes("web"):
        try:
            conns = p.net_connections(kind="inet") if hasattr(p, "net_connections") else p.connections(kind="inet")
        except psutil.Error:
            continue
        listening += [x.laddr for x in conns if x.status == psutil.CONN_LISTEN]
    assert listening, "no listening socket found"
    assert {a.ip for a in listening} == {"127.0.0.1"} and {a.port for a in listening} == {c.port}, listening
    assert "RICORDO_HOST" not in c.env("web")
    Stats.add("security: default bind address", listening=sorted({f"{a.ip}:{a.port}" for a in listening}))


def test_api_key_on_every_endpoint_but_health(healthy):
    c = healthy
    key = "s3cret-key-for-stress"
    c.kill("web")
    c.start("web", env={"RICORDO_API_KEY": key})
    counts = {"unauthorized_401": 0, "authorized": 0}
    try:
        body = {"model": c.model, "max_tokens": 1, "prompt": "hi", "input": "hi", "max_output_tokens": 1,
                "messages": [{"role": "user", "content": "hi"}]}
        bad_headers = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {key}"},
                       {"Authorization": f"Bearer {key}x"}, {"Authorization": "Bearer"}, {"x-api-key": "wrong"},
                       {"Authorization": f"bearer{key}"}]
        with c.http(timeout=300) as h:
            for method, path in ENDPOINTS:
                for hd in bad_headers:
                    r = h.request(method, path, json=body if method == "POST" else None, headers=hd)
                    if path == "/health":
                        assert r.status_code == 200, (path, hd, r.status_code)
                        continue
                    assert r.status_code == 401, (method, path, hd, r.status_code, r.text[:200])
                    assert r.headers.get("www-authenticate", "").lower().startswith("bearer")
                    counts["unauthorized_401"] += 1
                r = h.request(method, path, json=body if method == "POST" else None,
                              headers={"Authorization": f"Bearer {key}"})
                assert r.status_code != 401, (method, path)
                if path not in ("/nope", "/v1/models/x") and method != "DELETE":
                    assert r.status_code == 200, (method, path, r.status_code, r.text[:200])
                counts["authorized"] += 1
        ok = c.client(api_key=key).completions.create(model=c.model, prompt="hi", max_tokens=1)
        assert ok.choices
    finally:
        c.kill("web")
        c.start("web", env={"RICORDO_API_KEY": None})
    Stats.add("security: RICORDO_API_KEY", endpoints=len(ENDPOINTS), **counts)


def test_cache_directory_and_file_modes(healthy):
    c = healthy
    d = c.kv_dir
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    # a checkpoint of its own: run alone, or after a test that left the directory empty
    c.client().completions.create(model=c.model, prompt=unique_prompt("modes", 1), max_tokens=2, temperature=0)
    settle(d, c.trace_path)
    modes = {}
    for sha in entries(d):
        try:
            modes[sha] = stat.S_IMODE(os.stat(d / f"{sha}.kv").st_mode)
        except FileNotFoundError:
            pass
    assert modes, "no checkpoint to look at"
    assert set(modes.values()) == {0o600}, {k: oct(v) for k, v in modes.items() if v != 0o600}
    others = {}
    for path in [c.trace_path, c.run_dir, c.run_dir / "metrics"]:
        if path.exists():
            others[str(path.relative_to(c.tmp))] = oct(stat.S_IMODE(os.stat(path).st_mode))
    from shm.slots import SHM_DIR, prefix
    for p in Path(SHM_DIR).glob(prefix(str(c.run_dir)) + "-*"):
        others[f"shm slot {p.name[-2:]}"] = oct(stat.S_IMODE(os.stat(p).st_mode))
    for sock in c.run_dir.glob("*.sock"):
        others[f"run/{sock.name}"] = oct(stat.S_IMODE(os.stat(sock).st_mode))
    assert others["trace"] == "0o600" and others["run"] == "0o700"
    assert all(v == "0o600" for k, v in others.items() if k.startswith("shm")), others
    Stats.add("security: modes", cache_dir="0o700", files_checked=len(modes), files_0600=len(modes), others=others)


FS_SYSCALLS = re.compile(r'(open|openat|openat2|stat|newfstatat|statx|lstat|access|faccessat2?|mkdir|mkdirat|'
                         r'unlink|unlinkat|rename|renameat2?|readlink|readlinkat|chmod|fchmodat|truncate|'
                         r'creat|symlink|link|linkat|execve)\((?:[A-Z_]+, )?"([^"]*)"')
MARKER = "zq9evil"


def test_request_controlled_names_never_reach_the_file_system(healthy):
    """Model names, tool-call ids, tool names, message names, paths with ../ and a marker:
    traced with strace on every process while the requests run, no file-system call ever
    names a path with the marker (and no such file appears)."""
    c = healthy
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    evil = [f"../../../../tmp/{MARKER}", f"..%2f..%2f{MARKER}", f"/etc/{MARKER}", f"{MARKER}/../../x"]
    evil = evil[:scale(2, len(evil))]
    pids = [p.pid for name in ("web", "renderer", "inference", "persister") for p in c.processes(name)]
    log = c.tmp / "strace.out"
    tracer = subprocess.Popen(["strace", "-f", "-qq", "-e", "trace=%file", "-o", str(log)]
                              + [a for pid in pids for a in ("-p", str(pid))],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(2.0)
    if tracer.poll() is not None:
        pytest.skip(f"strace cannot attach: {tracer.stderr.read().decode()[:200]}")
    statuses = []
    try:
        with c.http(timeout=300) as h:
            for e in evil:
                reqs = [
                    ("POST", "/v1/chat/completions", {"model": e, "messages": [{"role": "user", "content": "hi"}]}),
                    ("GET", f"/v1/models/{e}", None),
                    ("POST", "/v1/chat/completions", {"model": c.model, "max_tokens": 1, "messages": [
                        {"role": "user", "content": "hi", "name": e},
                        {"role": "assistant", "content": None, "tool_calls": [
                            {"id": e, "type": "function", "function": {"name": e, "arguments": '{"path": "%s"}' % e}}]},
                        {"role": "tool", "tool_call_id": e, "content": e}]}),
                    ("POST", "/v1/responses", {"model": c.model, "max_output_tokens": 1, "input": [
                        {"type": "message", "role": "user", "content": "hi"},
                        {"type": "function_call", "call_id": e, "name": "f", "arguments": "{}"},
                        {"type": "function_call_output", "call_id": e, "output": e}]}),
                    ("POST", "/v1/messages", {"model": c.model, "max_tokens": 1, "messages": [
                        {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": [{"type": "tool_use", "id": e, "name": "f", "input": {}}]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": e, "content": e}]}]}),
                    ("POST", "/v1/completions", {"model": c.model, "max_tokens": 1, "prompt": e, "user": e}),
                ]
                for method, path, body in reqs:
                    r = h.request(method, path, json=body, headers={"x-request-id": e, "OpenAI-Organization": e})
                    statuses.append(r.status_code)
                    assert r.status_code < 500, (path, r.status_code, r.text[:200])
        time.sleep(1.0)
    finally:
        tracer.send_signal(signal.SIGINT)
        try:
            tracer.wait(20)
        except subprocess.TimeoutExpired:
            tracer.kill()
    text = log.read_text(errors="replace") if log.exists() else ""
    paths = [m.group(2) for m in FS_SYSCALLS.finditer(text)]
    assert paths, "strace saw no file-system call at all (not attached?)"
    touched = [p for p in paths if MARKER in p]
    found = [str(p) for p in (Path("/tmp") / MARKER, Path("/etc") / MARKER, REPO / MARKER) if p.exists()]
    found += [str(p) for p in c.tmp.rglob(f"*{MARKER}*")]
    Stats.add("security: request-controlled paths (strace)", requests=len(statuses), fs_calls_traced=len(paths),
              fs_calls_with_marker=len(touched), files_with_marker=len(found),
              statuses=sorted(set(statuses)))
    assert not touched, touched[:10]
    assert not found, found


def test_file_paths_in_code_come_from_checked_names():
    """Static: every place that builds a cache path joins a name the code has checked (the
    40-hex SHA1 pattern, or a name from the persister's own listing)."""
    hits = subprocess.run(["git", "grep", "-n", "-E", r"kv_disk_dir|self\.kv_dir|entry_path\(|self\.dir\b",
                           "--", "*.py", ":!tests", ":!bench"], cwd=REPO, capture_output=True, text=True).stdout
    joins = [line for line in hits.splitlines() if "os.path.join" in line]
    assert joins, hits
    for line in joins:
        assert "sha1" in line or "tmp" in line or "name" in line, line
    # the one path from a message (Disk.restore) is checked against the pattern first
    src = (REPO / "procs/inference/disk.py").read_text()
    assert re.search(r'not _SHA1\.fullmatch\(sha1\)', src)
    Stats.add("security: static path audit", joins=len(joins))


PICKLE = re.compile(r"^\s*(import|from)\s+(pickle|cPickle|dill|shelve|marshal|joblib)\b|pickle\.(loads?|dumps?)|"
                    r"(send|recv)_pyobj|torch\.load\(|allow_pickle\s*=\s*True|np\.load\(")


def test_no_pickle_in_product_code():
    out = subprocess.run(["git", "grep", "-n", "-i", "pickle", "--", "*.py"], cwd=REPO, capture_output=True,
                         text=True).stdout.splitlines()
    product = [line for line in out if not line.startswith(("tests/", "bench/"))]
    code = subprocess.run(["git", "grep", "-n", "-E", PICKLE.pattern, "--", "*.py", ":!tests", ":!bench"],
                          cwd=REPO, capture_output=True, text=True).stdout.splitlines()
    Stats.add("security: pickle", mentions_in_product=product, uses=code)
    assert not code, code
    # the only mention is the docstring that says there is none
    assert all("No pickle anywhere" in line for line in product), product


def test_loose_run_directory_is_refused_or_tightened(tmp_path):
    """A pre-created world-writable run dir (the default name is predictable) is tightened to
    0700; a symlink in its place is refused."""
    run = tmp_path / "run"
    run.mkdir()
    os.chmod(run, 0o777)
    from common.config import Settings
    from common.sockets import run_dir
    run_dir(Settings(run_dir=str(run)))
    mode = stat.S_IMODE(os.stat(run).st_mode)
    Stats.add("security: pre-created run dir 0777", mode_after=oct(mode))
    assert mode == 0o700
    link = tmp_path / "link"
    link.symlink_to(run)
    with pytest.raises(SystemExit, match="not a directory"):
        run_dir(Settings(run_dir=str(link)))
