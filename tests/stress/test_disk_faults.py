"""2. Disk faults: the cache directory read-only or deleted while the server runs, writable
by others at start, a budget below one file. The server keeps serving, the persister says
so in one clear warning, and no process dies.

The processes run without CAP_DAC_OVERRIDE (harness.py), so chmod 0500 binds them even
when the tests run as root.
"""
from __future__ import annotations

import os
import re
import shutil
import stat
import time

import pytest

from .conftest import FULL, Stats, full_only, scale
from .harness import check_dir, entries, longest_prefix_entry, settle, unique_prompt, unprivileged

pytestmark = pytest.mark.skipif(not unprivileged(), reason="root without setpriv: file modes do not bind")


def ask(c, prompt: str, max_tokens: int = 2):
    r = c.client().completions.create(model=c.model, prompt=prompt, max_tokens=max_tokens, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    return r


def warnings(c, since: int, name: str = "persister") -> list[str]:
    return [line for line in c.log(name)[since:].splitlines() if " WARNING " in line or " ERROR " in line
            or "Traceback" in line]


def restore_dir(c) -> None:
    os.makedirs(c.kv_dir, mode=0o700, exist_ok=True)
    os.chmod(c.kv_dir, 0o700)


def test_read_only_while_running(healthy):
    c = healthy
    settle(c.kv_dir, c.trace_path)
    before = entries(c.kv_dir)
    since = c.log_size("persister")
    requests = scale(2, 12)
    os.chmod(c.kv_dir, 0o500)
    try:
        for i in range(requests):
            ask(c, unique_prompt("ro", i, n_words=45))
        settle(c.kv_dir, c.trace_path)
        assert c.all_alive(), c.dead()
        assert entries(c.kv_dir) == before or set(entries(c.kv_dir)) <= set(before)
        w = warnings(c, since)
    finally:
        restore_dir(c)
    assert len(w) == 1 and "checkpoint not written" in w[0] and "Permission denied" in w[0], w
    assert c.trace().count("store failed") >= 1
    # writable again: the next checkpoints are written
    stored = c.trace().count("KV cache: stored")
    ask(c, unique_prompt("ro-after", 1, n_words=45))
    settle(c.kv_dir, c.trace_path)
    assert c.trace().count("KV cache: stored") > stored
    Stats.add("disk: read-only (0500) while running", requests=requests + 1, failed_requests=0,
              warnings=len(w), warning=w[0].split(" WARNING ")[-1][:90])


def test_deleted_while_running(healthy):
    c = healthy
    settle(c.kv_dir, c.trace_path)
    since = c.log_size("persister")
    requests = scale(2, 10)
    deletions = 1
    shutil.rmtree(c.kv_dir)
    for i in range(requests):
        ask(c, unique_prompt("gone", i, n_words=45))
        if FULL and i == requests // 2:      # once more, while it has entries again
            shutil.rmtree(c.kv_dir, ignore_errors=True)
            deletions += 1
    settle(c.kv_dir, c.trace_path)
    assert c.all_alive(), c.dead()
    w = warnings(c, since)
    assert os.path.isdir(c.kv_dir) and stat.S_IMODE(os.stat(c.kv_dir).st_mode) == 0o700
    n, bad = check_dir(c.kv_dir)
    assert n > 0 and not bad
    assert 1 <= len(w) <= 2 * deletions and all("vanished" in x or "checkpoint not written" in x for x in w), w
    Stats.add("disk: directory deleted while running", deletions=deletions, requests=requests, failed_requests=0,
              warnings=len(w),
              warning=w[0].split(" WARNING ")[-1][:90], entries_after=n)


def test_writable_by_others_at_start(healthy):
    c = healthy
    settle(c.kv_dir, c.trace_path)
    c.kill("persister")
    os.chmod(c.kv_dir, 0o777)
    since = c.log_size("persister")
    try:
        c.start_persister()
        before = entries(c.kv_dir)
        for i in range(scale(2, 6)):
            ask(c, unique_prompt("open", i, n_words=45))
        time.sleep(2)
        assert c.all_alive(), c.dead()
        assert entries(c.kv_dir) == before, "the persister wrote into a world-writable directory"
        assert stat.S_IMODE(os.stat(c.kv_dir).st_mode) == 0o777
        w = warnings(c, since)
    finally:
        c.kill("persister")
        restore_dir(c)
        c.start_persister()
    assert len(w) == 1 and "writable by others" in w[0], w
    Stats.add("disk: directory 0777 at start", requests=scale(2, 6), failed_requests=0, warnings=len(w),
              warning=w[0].split(" WARNING ")[-1][:90])


def test_read_only_at_start(healthy):
    """0500 before the persister starts: it takes the directory back to 0700 (it owns it)."""
    c = healthy
    c.kill("persister")
    os.chmod(c.kv_dir, 0o500)
    try:
        c.start_persister()
        assert stat.S_IMODE(os.stat(c.kv_dir).st_mode) == 0o700
        if FULL:
            ask(c, unique_prompt("ro-start", 1, n_words=45))
        assert c.all_alive()
    finally:
        restore_dir(c)
    Stats.add("disk: directory 0500 at start", requests=int(FULL), failed_requests=0, result="persister sets 0700 again")


def test_budget_below_one_file(healthy):
    """A 1 MB budget, every checkpoint bigger: none is written (it would be evicted at once),
    one warning says why; requests succeed; the directory stays within the budget."""
    c = healthy
    settle(c.kv_dir, c.trace_path)
    c.kill("persister")
    since = c.log_size("persister")
    requests = scale(2, 8)
    try:
        c.start_persister(env={"RICORDO_KV_DISK_SPACE_MB": "1"})
        for i in range(requests):
            ask(c, unique_prompt("tiny", i, n_words=45))
        settle(c.kv_dir, c.trace_path)
        assert c.all_alive(), c.dead()
        total = sum(entries(c.kv_dir).values())
        assert total <= 1 << 20, total
        w = warnings(c, since)
    finally:
        c.kill("persister")
        c.start_persister(env={"RICORDO_KV_DISK_SPACE_MB": None})
    skipped = len(re.findall(r"not stored sha1=\w+ \(\d+ tokens, \d+ bytes alone exceed", c.trace()))
    assert skipped >= 1
    assert not any("Traceback" in x for x in w)
    assert len(w) == 1 and "alone exceeds the disk budget" in w[0], w
    Stats.add("disk: budget (1 MB) below one file", requests=requests, failed_requests=0, dir_bytes_after=total,
              not_stored=skipped, warnings=len(w))


@full_only
def test_read_only_directory_and_a_corrupt_checkpoint(healthy):
    """A corrupt checkpoint rejected on restore while the directory is read-only: the
    persister cannot delete it, says so, drops it from the index and lives."""
    c = healthy
    base = unique_prompt("ro-corrupt", 1, n_words=80)
    ask(c, base)
    ask(c, unique_prompt("ro-corrupt-other", 2, n_words=30))      # the live session moves on
    settle(c.kv_dir, c.trace_path)
    prompt = base + " And then"
    target = longest_prefix_entry(c.kv_dir, prompt.encode())
    assert target, "no checkpoint of the prompt"
    path = c.kv_dir / f"{target}.kv"
    blob = bytearray(path.read_bytes())
    blob[len(blob) * 2 // 3] ^= 0x10                                # K/V bits: checksum mismatch
    path.write_bytes(bytes(blob))
    os.chmod(c.kv_dir, 0o500)
    try:
        ask(c, prompt)
        time.sleep(3)
        alive = c.alive("persister")
        Stats.add("disk: read-only dir + corrupt checkpoint rejected", requests=1, failed_requests=0,
                  persister_alive=alive)
        assert f"rejected sha1={target} (reason: checksum mismatch)" in c.trace()
        assert alive, "the persister died:\n" + "\n".join(c.log("persister").splitlines()[-12:])
        assert f"could not evict sha1={target} (rejected on restore: checksum mismatch)" in c.trace()
    finally:
        restore_dir(c)
        path.unlink(missing_ok=True)          # not for the directory checks of later tests
        if not c.alive("persister"):
            c.start_persister()
