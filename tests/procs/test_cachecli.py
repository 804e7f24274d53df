"""`ricordo cache` (procs/cachecli.py) over real .kv files written with kvfile.pack."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from common import kvfile
from procs import cachecli
from tests.helpers import ROOT

G = kvfile.Geometry(ctx_size=256, chunk_size=16, kv_capacity=256, n_layers=2, kv_heads=2,
                    head_dim=8, vocab_size=64, kv_dtype=kvfile.KV_F16)
T0 = 1_700_000_000
# (text, reason, created, n_tokens, ktm)
SPECS = [
    (b"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" * 2, kvfile.COLD, T0, 40, None),
    (b"hello world, continued session", kvfile.CONTINUED, T0 + 100, 60, None),
    (b'user asked; assistant <tool_call>{"name":"f","arguments":{}}</tool_call> ok', kvfile.EVICT,
     T0 + 200, 80, {"call_" + "a" * 32: b'<tool_call>{"name":"f","arguments":{}}</tool_call>'}),
    (b"shutdown state \xe2\x82\xac", kvfile.SHUTDOWN, T0 + 300, 100, None),
]


def make(d, text, reason, now, n, ktm=None, seed=0) -> str:
    rng = np.random.default_rng(seed)
    kv = lambda: rng.standard_normal((G.n_layers, n, G.kv_heads, G.head_dim)).astype(np.float16)  # noqa: E731
    data = kvfile.pack(text, rng.integers(0, G.vocab_size, n), rng.standard_normal(G.vocab_size),
                       kv(), kv(), G, bytes(range(16)), 4, reason, ktm=ktm, now=now)
    sha1 = kvfile.entry_name(text)[:-len(kvfile.SUFFIX)]
    with open(kvfile.entry_path(d, sha1), "wb") as f:
        f.write(data)
    return sha1


@pytest.fixture
def cache(tmp_path):
    d = tmp_path / "kv"
    d.mkdir()
    shas = [make(str(d), *spec, seed=i) for i, spec in enumerate(SPECS)]
    (d / "notes.txt").write_text("not an entry")
    (d / (shas[0] + ".kv.tmp.1234")).write_bytes(b"partial")       # a writer's temp file
    return str(d), shas


def run(*argv):
    """(rc, stdout, stderr) of the entry function with the directory in argv."""
    out, err = io.StringIO(), io.StringIO()
    old, sys.stderr = sys.stderr, err
    try:
        rc = cachecli.main(list(argv), out=out)
    finally:
        sys.stderr = old
    return rc, out.getvalue(), err.getvalue()


def sub(*argv, env=None):
    e = {k: v for k, v in os.environ.items() if not k.startswith("RICORDO_")}
    e.update(env or {})
    p = subprocess.run([sys.executable, "-m", "procs.cli", "cache", *argv], cwd=ROOT, env=e,
                       capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout, p.stderr


def test_ls_json_lists_exactly_the_entries(cache):
    d, shas = cache
    rc, out, _ = run("--kv-disk-dir", d, "ls", "--json")
    assert rc == 0
    rows = json.loads(out)
    assert [r["sha1"] for r in rows] == shas[::-1]                     # newest last-used first
    for r, (text, reason, now, n, _) in zip(rows[::-1], SPECS):
        assert set(r) == {"sha1", "tokens", "reason", "hits", "created", "last_used", "size", "preview"}
        assert r["tokens"] == n and r["reason"] == kvfile.REASON_NAMES[reason] and r["hits"] == 0
        assert r["created"] == r["last_used"] == now
        assert r["size"] == os.path.getsize(os.path.join(d, r["sha1"] + ".kv"))
    assert rows[-1]["preview"].startswith("<|im_start|>system\\nYou are")
    assert rows[0]["preview"] == "shutdown state \u20ac"


def test_ls_human_table_and_bump_order(cache):
    d, shas = cache
    kvfile.bump_hits(os.path.join(d, shas[0] + ".kv"), now=T0 + 1000)
    rc, out, _ = run("--kv-disk-dir", d, "ls")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["SHA1", "TOKENS", "REASON"]
    assert lines[1].startswith(shas[0][:12]) and " cold " in lines[1]
    assert len(lines) == 1 + len(shas) + 1 and lines[-1].startswith(f"{len(shas)} entries, ")
    total = sum(os.path.getsize(os.path.join(d, s + ".kv")) for s in shas)
    assert f"{total} bytes" in lines[-1]
    col = lines[0].index("SIZE")
    assert all(line[col - 2:col] == "  " for line in lines[1:-1])          # aligned columns


def test_corrupt_entry_listed_with_error(cache):
    d, shas = cache
    bad = "f" * 40
    with open(os.path.join(d, bad + ".kv"), "wb") as f:
        f.write(b"KVC\x01 not a checkpoint")
    rc, out, _ = run("--kv-disk-dir", d, "ls", "--json")
    assert rc == 0
    rows = {r["sha1"]: r for r in json.loads(out)}
    assert set(rows) == set(shas) | {bad} and "truncated" in rows[bad]["error"]
    rc, out, _ = run("--kv-disk-dir", d, "ls")
    assert rc == 0 and "ERROR" in out and "1 unsound" in out


def test_inspect_shows_header_payload_and_ktm(cache):
    d, shas = cache
    rc, out, _ = run("--kv-disk-dir", d, "inspect", shas[2][:8])
    assert rc == 0
    for s in ("quant_bits", "payload_bytes", "created", "last_used", "reason               3  (evict)",
              "flags                1  (KTM)", "kv_capacity", "compressed_capacity", "vocab_size",
              "kv_dtype             2  (f16)", "fingerprint  000102030405060708090a0b0c0d0e0f",
              "(ok)", "matches name", "KTM          1 entries", "call_" + "a" * 32, "<tool_call>"):
        assert s in out, s
    rc, out, _ = run("--kv-disk-dir", d, "inspect", shas[2], "--json", "--max-text", "9")
    doc = json.loads(out)
    assert doc["header"]["n_tokens"] == 80 and doc["payload"]["n_tokens"] == 80
    assert list(doc["payload"])[:13] == list(cachecli.PAYLOAD_FIELDS) and doc["payload"]["magic"] == "DENS"
    assert doc["ktm"] == [{"id": "call_" + "a" * 32, "block_bytes": 50,
                           "block_preview": '<tool_call>{"name":"f","arguments":{}}</tool_call>'}]
    assert doc["text"] == "user aske" and doc["text_truncated"] and doc["checksum_ok"]


def test_verify_then_flip_one_payload_byte(cache):
    d, shas = cache
    rc, out, _ = run("--kv-disk-dir", d, "verify")
    assert rc == 0 and out.count("OK ") == len(shas) and "0 bad" in out
    path = os.path.join(d, shas[1] + ".kv")
    data = bytearray(open(path, "rb").read())
    data[len(data) - 100] ^= 0x01                          # inside the K/V rows
    open(path, "wb").write(data)
    rc, out, _ = run("--kv-disk-dir", d, "verify")
    assert rc != 0 and f"BAD  {shas[1]}: checksum mismatch" in out and f"1 bad: {shas[1]}.kv" in out
    rc, out, _ = run("--kv-disk-dir", d, "verify", "--json")
    doc = json.loads(out)
    assert rc != 0 and doc["bad"] == [shas[1]] and doc["checked"] == len(shas)


def test_prune_lru_within_budget(cache):
    d, shas = cache
    kvfile.bump_hits(os.path.join(d, shas[0] + ".kv"), now=T0 + 1000)   # oldest becomes newest
    sizes = {s: os.path.getsize(os.path.join(d, s + ".kv")) for s in shas}
    budget = sizes[shas[0]] + sizes[shas[3]] + 10
    mb = budget / (1024 * 1024)
    rc, out, _ = run("--kv-disk-dir", d, "prune", "--max-mb", repr(mb), "--dry-run")
    assert rc == 0 and "would remove" in out and len(os.listdir(d)) == len(shas) + 2
    rc, out, _ = run("--kv-disk-dir", d, "prune", "--max-mb", repr(mb), "--json")
    doc = json.loads(out)
    assert rc == 0 and [v["sha1"] for v in doc["victims"]] == [shas[1], shas[2]]   # LRU first
    left = sorted(n for n in os.listdir(d) if kvfile.is_entry_name(n))
    assert left == sorted([shas[0] + ".kv", shas[3] + ".kv"])
    assert sum(os.path.getsize(os.path.join(d, n)) for n in left) <= budget
    assert "notes.txt" in os.listdir(d) and shas[0] + ".kv.tmp.1234" in os.listdir(d)   # untouched
    rc, out, _ = run("--kv-disk-dir", d, "prune", "--max-mb", "0")
    assert rc == 0 and not [n for n in os.listdir(d) if kvfile.is_entry_name(n)]


def test_rm_by_name_and_prefix(cache):
    d, shas = cache
    rc, out, _ = run("--kv-disk-dir", d, "rm", shas[0], shas[1][:7] + ".kv")
    assert rc == 0 and out.count("removed") == 2
    assert not os.path.exists(os.path.join(d, shas[0] + ".kv"))
    assert not os.path.exists(os.path.join(d, shas[1] + ".kv"))
    rc, out, err = run("--kv-disk-dir", d, "rm", shas[2], "abcdef0123")    # unknown: nothing removed
    assert rc == 2 and err.startswith("error: ") and "abcdef0123" in err
    assert os.path.exists(os.path.join(d, shas[2] + ".kv"))


def test_stats(cache):
    d, shas = cache
    rc, out, _ = run("--kv-disk-dir", d, "--kv-disk-space-mb", "1", "stats", "--json")
    doc = json.loads(out)
    total = sum(os.path.getsize(os.path.join(d, s + ".kv")) for s in shas)
    assert rc == 0 and doc["entries"] == 4 and doc["total_bytes"] == total
    assert doc["budget_bytes"] == 1 << 20 and doc["use_pct"] == round(100 * total / (1 << 20), 1)
    assert doc["by_reason"] == {"cold": 1, "continued": 1, "evict": 1, "shutdown": 1}
    assert (doc["tokens_min"], doc["tokens_median"], doc["tokens_max"]) == (40, 70, 100)
    assert (doc["oldest"], doc["newest"]) == (T0, T0 + 300)
    rc, out, _ = run("--kv-disk-dir", d, "stats")
    assert rc == 0 and "by reason:" in out and "min 40, median 70, max 100" in out


def test_env_dir_and_flag_after_subcommand(cache):
    d, shas = cache
    rc, out, err = sub("ls", "--json", env={"RICORDO_KV_DISK_DIR": d})
    assert rc == 0, err
    assert sorted(r["sha1"] for r in json.loads(out)) == sorted(shas)
    rc, out, _ = run("ls", "--json", "--kv-disk-dir", d)
    assert rc == 0 and len(json.loads(out)) == len(shas)


@pytest.mark.parametrize("argv,msg", [
    (["ls"], "no cache directory"),
    (["--kv-disk-dir", "/nonexistent/ricordo-kv", "stats"], "does not exist"),
    (["--kv-disk-dir", "{d}", "inspect", "0123456789"], "no entry"),
    (["--kv-disk-dir", "{d}", "rm", "12"], "not a sha1"),
])
def test_errors_exit_2_without_traceback(cache, argv, msg):
    d, _ = cache
    rc, out, err = sub(*[a.format(d=d) for a in argv])
    assert rc == 2 and out == ""
    assert err.startswith("error: ") and msg in err and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_inspect_and_verify_a_windowed_entry(tmp_path):
    """A payload version 2 entry (sliding-window layers): inspect shows its per-layer rows,
    verify finds it sound."""
    import msgspec
    d = tmp_path / "kv"
    d.mkdir()
    g = msgspec.structs.replace(G, windows=(16, 0), sliding_window=16)
    rng = np.random.default_rng(0)
    kv = lambda: rng.standard_normal((2, 40, 2, 8)).astype(np.float16)  # noqa: E731
    data = kvfile.pack(b"windowed", rng.integers(0, 64, 40), rng.standard_normal(64), kv(), kv(), g,
                       bytes(16), 4, kvfile.COLD, now=T0)
    sha1 = kvfile.entry_name(b"windowed")[:-len(kvfile.SUFFIX)]
    (d / f"{sha1}.kv").write_bytes(data)
    rc, out, _ = run("--kv-disk-dir", str(d), "inspect", sha1)
    assert rc == 0 and "layer rows   16 40" in out and "sliding_window       16" in out
    rc, out, _ = run("--kv-disk-dir", str(d), "inspect", sha1, "--json")
    doc = json.loads(out)
    assert doc["payload"]["version"] == 2 and doc["layer_rows"] == [16, 40]
    rc, out, _ = run("--kv-disk-dir", str(d), "verify")
    assert rc == 0, out
