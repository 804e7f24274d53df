"""bench_cache.py's in-process parts: the restore read speed of a real checkpoint (Disk.restore,
kvfile.read, the copy into a session) and decode speed alone against decode while another
process writes that checkpoint with the persister's own code (Store.write from a shared-memory
slot that Disk.save filled)."""
from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import time
import warnings

from bench.bench_pipeline import med
from bench.report import log


class Null:
    def __getattr__(self, _):
        return lambda *a, **k: None


def restore_speed(path: str, n_runs: int) -> dict:
    import torch
    from common import kvfile
    from common.config import Settings
    from procs.inference.disk import Disk
    from procs.inference.kvsession import KVSession
    from procs.inference.runtime import build
    cache_dir = os.path.dirname(path)
    sha1 = os.path.basename(path)[:-3]
    s = Settings.load("inference", ["--kv-disk-dir", cache_dir])
    model, n_ctx, _ = build(s)
    run_dir = tempfile.mkdtemp(prefix="ricordo-bench-run-")
    disk = Disk(s, model, n_ctx, run_dir, lambda msg: None, lambda t=0: None, Null())
    sess = KVSession(model, n_ctx, s.chunk_size)
    size = os.path.getsize(path)
    with open(path, "rb") as f:          # into the page cache
        while f.read(1 << 24):
            pass
    out = {"file_bytes": size, "restore_s": [], "read_s": [], "import_s": []}
    try:
        n = disk.restore(sess, sha1)      # warm-up (also first-touches the session's rows)
        out["tokens"] = n
        for _ in range(n_runs):
            t0 = time.perf_counter()
            disk.restore(sess, sha1)
            out["restore_s"].append(time.perf_counter() - t0)
        for _ in range(n_runs):
            t0 = time.perf_counter()
            e = kvfile.read(path, expect_geometry=disk.geometry, expect_fingerprint=model.fingerprint)
            t1 = time.perf_counter()
            with warnings.catch_warnings():       # views of the read-only mmap, as Disk.restore
                warnings.simplefilter("ignore")
                k, v = torch.from_numpy(e.k), torch.from_numpy(e.v)
            if model.dtype == torch.bfloat16:
                k, v = k.view(model.dtype), v.view(model.dtype)
            sess.import_([int(t) for t in e.tokens], torch.from_numpy(e.logits.copy()), k, v)
            t2 = time.perf_counter()
            out["read_s"].append(t1 - t0)
            out["import_s"].append(t2 - t1)
            del e, k, v
        # what one save costs inference (the copy into a shm slot), for the generation section
        out["save_copy_s"] = []
        for _ in range(max(3, n_runs // 2)):
            t0 = time.perf_counter()
            disk.save(sess, len(sess), sess.logits, kvfile.CONTINUED)
            out["save_copy_s"].append(time.perf_counter() - t0)
            for i, seq in list(disk.pool.busy.items()):   # no persister here: free it
                disk.slot_freed(i, seq)
    finally:
        disk.close(0)
        shutil.rmtree(run_dir, ignore_errors=True)
    for k in ("restore_s", "read_s", "import_s", "save_copy_s"):
        out[k + "_median"] = med(out[k])
    out["restore_gb_s"] = size / out["restore_s_median"] / 1e9
    out["read_gb_s"] = size / out["read_s_median"] / 1e9
    out["threads"] = torch.get_num_threads()
    return out


def make_checkpoint(conv, n_tokens: int, out_dir: str) -> str:
    """A real checkpoint without the server: a conversation of about n_tokens, prefilled
    in-process, handed over with Disk.save and written with Store.write (what inference and
    the persister do); conv: bench_cache.Conversations. Returns its path."""
    from common import kvfile
    from common.config import Settings
    from procs.inference.disk import Disk
    from procs.inference.kvsession import KVSession
    from procs.inference.runtime import build
    from procs.persister.store import Store
    from shm.slots import read_slot
    t = conv.text
    msgs = conv.turn1(7, n_tokens)
    prompt = t.bos_text() + t.render_chat(msgs, add_generation_prompt=True).encode()
    ids = t.encode(prompt)
    s = Settings.load("inference", ["--kv-disk-dir", out_dir])
    model, n_ctx, _ = build(s)
    run_dir = tempfile.mkdtemp(prefix="ricordo-bench-run-")
    sent = []
    disk = Disk(s, model, n_ctx, run_dir, sent.append, lambda t=0: None, Null())
    try:
        sess = KVSession(model, n_ctx, s.chunk_size)
        t0 = time.perf_counter()
        sess.prefill(ids)
        log(f"  prefilled {len(ids)} tokens in {time.perf_counter() - t0:.1f} s")
        disk.save(sess, len(sess), sess.logits, kvfile.SHUTDOWN)
        msg = sent[-1]
        mm, body = read_slot(msg.slot_path, msg.nbytes)
        sha1 = Store(out_dir, 1 << 20, Null(), Null()).write(msg, body, t.piece_bytes(msg.tokens), {})
        body.release()
        mm.close()
    finally:
        disk.close(0)
        shutil.rmtree(run_dir, ignore_errors=True)
    return os.path.join(out_dir, sha1 + ".kv")


def _writer(slot_path: str, nbytes: int, save_fields: dict, text: bytes, out_dir: str, ready, stop, results):
    """The persister's work in a loop: Store.write of one slot to out_dir, until told to stop."""
    from common import messages as m
    from procs.persister.store import Store
    from shm.slots import read_slot
    store = Store(out_dir, 1 << 20, Null(), Null())
    msg = m.SaveCheckpoint(slot=0, slot_path=slot_path, nbytes=nbytes, **save_fields)
    mm, body = read_slot(slot_path, nbytes)
    ready.set()
    i, times = 0, []
    while not stop.is_set():
        t0 = time.perf_counter()
        sha1 = store.write(msg, body, text + str(i).encode(), {})
        times.append(time.perf_counter() - t0)
        store.remove(sha1, "bench")
        i += 1
    results.put(times)
    body.release()
    mm.close()


def generation_during_write(path: str, decode_tokens: int, rounds: int) -> dict:
    """Decode tokens/s alone vs while another process runs Store.write over and over."""
    import torch
    from common.config import Settings
    from procs.inference.disk import Disk
    from procs.inference.kvsession import KVSession
    from procs.inference.runtime import build
    cache_dir = os.path.dirname(path)
    sha1 = os.path.basename(path)[:-3]
    s = Settings.load("inference", ["--kv-disk-dir", cache_dir])
    model, n_ctx, _ = build(s)
    run_dir = tempfile.mkdtemp(prefix="ricordo-bench-run-")
    out_dir = tempfile.mkdtemp(prefix="ricordo-bench-write-", dir=os.path.dirname(cache_dir))
    sent = []
    disk = Disk(s, model, n_ctx, run_dir, sent.append, lambda t=0: None, Null())
    sess = KVSession(model, n_ctx, s.chunk_size)
    n = disk.restore(sess, sha1)
    if n + decode_tokens + 1 > n_ctx:          # room for the decoded tokens
        keep = n_ctx - decode_tokens - 1
        last = sess.tokens[keep - 1]
        sess.truncate(keep - 1)
        sess.prefill([last])
    from common import kvfile
    disk.save(sess, len(sess), sess.logits, kvfile.CONTINUED)
    msg = sent[-1]
    fields = {f: getattr(msg, f) for f in msg.__struct_fields__ if f not in ("slot", "slot_path", "nbytes")}
    from common.models import load_text, resolve
    text = load_text(resolve(s.model, s.models_path())).piece_bytes(msg.tokens)
    base = len(sess)

    def decode_run() -> float:
        sess.truncate(base)
        tok = 13
        t0 = time.perf_counter()
        for _ in range(decode_tokens):
            lg = sess.decode(tok)
            tok = int(lg.argmax())
        return decode_tokens / (time.perf_counter() - t0)

    ctx = mp.get_context("spawn")
    res = {"context": base, "decode_tokens": decode_tokens, "alone": [], "during": [], "write_s": [],
           "checkpoint_bytes": msg.nbytes, "threads": torch.get_num_threads()}
    decode_run()        # warm-up
    try:
        for _ in range(rounds):
            res["alone"].append(decode_run())
            ready, stop, results = ctx.Event(), ctx.Event(), ctx.Queue()
            p = ctx.Process(target=_writer, args=(msg.slot_path, msg.nbytes, fields, text, out_dir, ready,
                                                  stop, results))
            p.start()
            ready.wait(120)
            time.sleep(0.2)      # the first write is under way
            res["during"].append(decode_run())
            stop.set()
            res["write_s"] += results.get(timeout=300)
            p.join(60)
            res["alone"].append(decode_run())
    finally:
        disk.close(0)
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(out_dir, ignore_errors=True)
    res["alone_median"] = med(res["alone"])
    res["during_median"] = med(res["during"])
    res["ratio"] = res["during_median"] / res["alone_median"]
    res["write_s_median"] = med(res["write_s"])
    res["write_gb_s"] = msg.nbytes / res["write_s_median"] / 1e9 if res["write_s"] else float("nan")
    return res
