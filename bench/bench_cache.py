"""Disk KV cache benchmark.

1. Time to first token (TTFT) of a conversation's next turn: earlier turns of about 2000, 4000
   and 8000 tokens (the last one is capped so that prompt + new turn + answer fit the model's
   context) plus a new user message of about 200 tokens, through the whole server (`honcho
   start` of the Procfile, default cache flags, --trace on), streamed, time to the first
   chunk that carries content (or the finish reason):
     cold      fresh server, empty cache dir, a conversation never seen
     live      same server right after turn 1 (the live session is reused)
     restored  after a full restart (every process stopped, started again on the same cache
               dir): turn 1's state comes back from the shutdown checkpoint on disk
   Every measured request's `cached_tokens` says which path it took; it is checked.
   One cycle per size and repeat:
     fresh server, empty dir: cold X (measured); a tiny request (the live session of X is
     evicted to disk outside any measurement); turn 1 of conversation A (16 tokens of answer);
     turn 2 of A with --live different new messages (measured); turn 1 of A again (fully
     cached: the live session is turn 1's state again; its answer can differ from the first,
     so the restored turn 2 is built on this one); stop (shutdown checkpoint = turn 1).
     Then --restores times: start on the same dir, turn 2 of A with a new message never sent
     (measured), stop.
   After every server start: 3 s (the persister's index reaches the renderer), then one tiny
   unmeasured request (the process's first forward passes; --no-warmup measures them too).
   Before each measured request the bench waits until the persister has no write in flight.
2. Restore read speed from the page cache: procs.inference.disk.Disk.restore of a real
   checkpoint written by the server in step 1 (the largest), in-process, file read once
   before (page cache), median of several; also kvfile.read alone (mmap + checksum) and the
   copy into the session.
3. Generation while the persister writes: in-process, a session restored from that checkpoint
   decodes --decode-tokens tokens (a) alone and (b) while another process -- the persister's
   own code, procs.persister.store.Store.write from a shared-memory slot that
   procs.inference.disk.Disk.save filled -- writes that checkpoint to a cache dir over and
   over; tokens/s (b)/(a) is the figure (target >= 90%). The inference-side cost of a save
   (Disk.save: copying the rows into the slot, on the generation thread) is timed separately.
4. bench/cache_ttft.svg: the three TTFT curves against context size.

    .venv/bin/python bench/bench_cache.py [--sizes 2000 4000 8000] [--repeats 2] [--live 3]
        [--restores 2] [--threads N] [--json] [--plot bench/cache_ttft.svg]
    .venv/bin/python bench/bench_cache.py --checkpoint make|FILE.kv   # only parts 2 and 3
    .venv/bin/python bench/bench_cache.py --replot RUN.json           # redraw from a --json output

Medians everywhere; the machine is shared and noisy, so ratios are taken within a cycle.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_pipeline import Server, med  # noqa: E402
from bench.cache_inproc import generation_during_write, make_checkpoint, restore_speed  # noqa: E402
from bench.report import emit, log  # noqa: E402

SYSTEM = "You are a careful reading assistant. Answer questions about the notes the user shares."
NEW_TOKENS = 200
REPLY_TOKENS = 16
HEADROOM = 40        # tokens of the context left free beyond prompt + new turn + answer

WORDS = ("river mountain lantern harbor orchard violin meadow glacier compass archive canyon "
         "festival granite horizon island journey kettle library marble needle observatory "
         "pepper quartz railway saddle thunder umbrella valley window yarn zephyr amber beacon "
         "cobalt dune ember fable garnet hollow ivory jasmine kelp lagoon mosaic nectar onyx "
         "prairie quiver ribbon sapphire tundra velvet willow anchor bramble cedar delta "
         "engine falcon gravel harvest inlet juniper kiln lumber mill nomad oasis pebble "
         "quarry reef summit timber upland vessel wharf").split()
VERBS = ("carried measured painted followed repaired described counted borrowed traded "
         "guarded studied crossed mapped gathered polished weighed remembered sketched").split()
PEOPLE = ("the baker", "a sailor", "the mayor", "my aunt", "the engineer", "a shepherd", "the clerk",
          "an old poet", "the twins", "a courier", "the gardener", "the captain")


def prose_line(rng: random.Random, label: str, i: int) -> str:
    w = lambda: rng.choice(WORDS)  # noqa: E731
    return (f"{label} {i}: On day {rng.randint(1, 365)}, {rng.choice(PEOPLE)} {rng.choice(VERBS)} the {w()} "
            f"near the {w()} and the {w()}, then wrote {rng.randint(2, 99)} words about a {w()} "
            f"that {rng.choice(VERBS)} a {w()}.")


class Conversations:
    """Chat prompts of a given size, from numbered lines of varied prose. Token counts come
    from the model's own template and tokenizer (what the renderer does)."""

    def __init__(self):
        from common.config import Settings
        from common.models import context_size, load_text, resolve
        s = Settings.load("renderer", [])
        path = resolve(s.model, s.models_path())
        self.text = load_text(path)
        self.n_ctx = context_size(path, s.ctx_size)

    def count(self, messages: list[dict]) -> int:
        t = self.text
        return len(t.encode(t.bos_text() + t.render_chat(messages, add_generation_prompt=True).encode()))

    def turn1(self, seed: int, n_tokens: int) -> list[dict]:
        """[system, (user, assistant)*, user]: about n_tokens tokens rendered, ending with a
        question. The conversation's text differs from every other seed's from the first
        user message on."""
        rng = random.Random(seed)
        label = f"Note{seed}"
        msgs = [{"role": "system", "content": SYSTEM}]
        line = 0

        def lines(k):
            nonlocal line
            out = []
            for _ in range(k):
                line += 1
                out.append(prose_line(rng, label, line))
            return "\n".join(out)
        # whole turns of ~16 lines (~560 tokens) while far from the target
        while self.count(msgs + [{"role": "user", "content": "x"}]) < n_tokens - 1400:
            msgs.append({"role": "user", "content": "Here are more of my notes:\n" + lines(10)})
            msgs.append({"role": "assistant", "content": "Thank you, I have read them. In short:\n" + lines(6)})
        # the last user message: as many lines as fit, then the question
        pool = [prose_line(rng, label, line + j + 1) for j in range(80)]
        question = "\nWhich of these notes mention a river?"

        def last(k):
            return msgs + [{"role": "user", "content": "Last notes:\n" + "\n".join(pool[:k]) + question}]
        lo, hi = 0, len(pool)
        while lo < hi:                      # the largest k with count <= n_tokens
            mid = (lo + hi + 1) // 2
            if self.count(last(mid)) <= n_tokens:
                lo = mid
            else:
                hi = mid - 1
        return last(lo)

    def new_message(self, seed: int) -> dict:
        rng = random.Random(10_000 + seed)
        body, i = [], 0
        while True:
            i += 1
            body.append(prose_line(rng, f"Extra{seed}", i))
            if len(self.text.encode("\n".join(body))) >= NEW_TOKENS - 20:
                break
        return {"role": "user", "content": "Some more notes:\n" + "\n".join(body) +
                "\nWhat did the last note say?"}

    def turn2(self, t1: list[dict], reply: str, seed: int) -> list[dict]:
        return t1 + [{"role": "assistant", "content": reply}, self.new_message(seed)]


# --- talking to the server ----------------------------------------------------------------

def ttft(client, model: str, msgs: list[dict]) -> dict:
    """Streamed, max_tokens 1, temperature 0: seconds to the first chunk with content or a
    finish reason; prompt and cached tokens from the usage chunk."""
    t0 = time.perf_counter()
    first, usage = None, None
    for ch in client.chat.completions.create(model=model, messages=msgs, max_tokens=1, temperature=0,
                                             stream=True, stream_options={"include_usage": True}):
        if first is None and ch.choices and (ch.choices[0].delta.content or ch.choices[0].finish_reason):
            first = time.perf_counter() - t0
        if ch.usage is not None:
            usage = ch.usage
    total = time.perf_counter() - t0
    cached = usage.prompt_tokens_details.cached_tokens if usage and usage.prompt_tokens_details else None
    return {"ttft": first, "total": total, "prompt_tokens": usage.prompt_tokens if usage else None,
            "cached_tokens": cached}


def answer(client, model: str, msgs: list[dict], max_tokens: int) -> str:
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content or ""


def wait_persister_idle(cache_dir: Path, quiet_s: float = 1.5, timeout: float = 120.0) -> float:
    """Until no temp file is in the cache dir and its listing (names, sizes) has not changed for
    quiet_s seconds. Returns the seconds waited."""
    t0 = time.monotonic()

    def state():
        try:
            return sorted((e.name, e.stat().st_size) for e in os.scandir(cache_dir))
        except (FileNotFoundError, OSError):
            return []
    last, since = state(), time.monotonic()
    while time.monotonic() - t0 < timeout:
        time.sleep(0.2)
        cur = state()
        if cur != last or any(".tmp." in n for n, _ in cur):
            last, since = cur, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return time.monotonic() - t0


def trace_since(path: Path, offset: int) -> tuple[list[str], int]:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    return data.decode(errors="replace").splitlines(), offset + len(data)


def restore_log_s(srv: Server) -> float | None:
    """The inference log's 'restored <sha1>: <n> tokens in <s> s' of the last restore."""
    got = None
    for line in srv.log_text().splitlines():
        if "restored " in line and " tokens in " in line:
            try:
                got = float(line.rsplit(" in ", 1)[1].split()[0])
            except (IndexError, ValueError):
                pass
    return got


def cycle(conv: Conversations, size: int, rep: int, args, keep_dir: Path | None) -> dict:
    """One cold / live / restored cycle for one size (see the module doc)."""
    seed = 1000 * size + 10 * rep
    tmp = Path(tempfile.mkdtemp(prefix=f"ricordo-bench-cache-{size}-"))
    cache_dir = tmp / "kv"
    trace = tmp / "trace.log"
    env = {"RICORDO_KV_DISK_DIR": cache_dir, "RICORDO_TRACE": trace}
    res = {"size": size, "rep": rep, "cold": [], "live": [], "restored": [], "notes": [], "log": [],
           "first_request_s": []}
    srv = Server(env)
    toff = 0

    def measured(kind: str, msgs, expect) -> None:
        nonlocal toff
        waited = wait_persister_idle(cache_dir)
        _, toff = trace_since(trace, toff)
        r = ttft(client, model, msgs)
        time.sleep(0.3)
        lines, toff = trace_since(trace, toff)
        r["trace"] = [x.split("] ", 1)[-1] for x in lines if "KV cache" in x]
        r["waited_s"] = waited
        ok = expect(r)
        r["path_ok"] = ok
        res[kind].append(r)
        log(f"  {size} #{rep} {kind}: TTFT {r['ttft']:.3f} s, prompt {r['prompt_tokens']}, cached "
            f"{r['cached_tokens']}{'' if ok else '  <-- UNEXPECTED PATH'}")
        for x in r["trace"]:
            log(f"      trace: {x[:150]}")

    def up(server: Server):
        res["start_s"].append(server.start())
        c, mdl = server.client(), server.health["model"]
        time.sleep(3)   # the persister's first index snapshot reaches the renderer
        if not args.no_warmup:   # the process's first forward passes, outside the measurement
            t0 = time.perf_counter()
            answer(c, mdl, [{"role": "user", "content": "Hi."}], 1)
            res["first_request_s"].append(time.perf_counter() - t0)
        return c, mdl

    def down(server: Server):
        res["stop_s"].append(server.stop())
        res["log"] += [x for x in server.log_text().splitlines()
                       if any(k in x for k in ("inference INFO job", "restored", "shutdown", "stored",
                                               "WARNING", "ERROR", "Traceback"))]
        server.close()

    res["start_s"], res["stop_s"] = [], []
    try:
        log(f"  {size} #{rep}: fresh server, empty cache dir {cache_dir}")
        client, model = up(srv)
        # cold: a conversation never seen, same shape as turn 2 below
        x1 = conv.turn1(seed + 1, size)
        xmsgs = conv.turn2(x1, "Thank you. " * 5, seed + 1)
        measured("cold", xmsgs, lambda r: r["cached_tokens"] == 0)
        answer(client, model, [{"role": "user", "content": "Hi."}], 1)     # X's session goes to disk (evict)
        # turn 1 of A, then turn 2 with different new messages: the live session
        a1 = conv.turn1(seed + 2, size)
        wait_persister_idle(cache_dir)
        reply = answer(client, model, a1, REPLY_TOKENS)
        res["turn1_tokens"] = conv.count(a1)
        for k in range(args.live):
            msgs = conv.turn2(a1, reply, seed + 100 + k)
            measured("live", msgs, lambda r: (r["cached_tokens"] or 0) >= res["turn1_tokens"])
        # the live session = turn 1's state again. Its answer can differ from the first one (the last
        # prompt token now runs alone, through the decode kernels, not in a prefill chunk), so the
        # restored turn 2 below is built on this answer: the shutdown checkpoint's text is its prefix
        again = answer(client, model, a1, REPLY_TOKENS)
        if again != reply:
            res["notes"].append(f"turn 1 answered differently the second time: {reply!r} vs {again!r}")
        wait_persister_idle(cache_dir)
        down(srv)
        # restored: a full restart on the same dir, a new message never sent
        for k in range(args.restores):
            srv = Server(env)
            client, model = up(srv)
            msgs = conv.turn2(a1, again, seed + 200 + k)
            measured("restored", msgs, lambda r: (r["cached_tokens"] or 0) >= res["turn1_tokens"])
            res["restored"][-1]["restore_log_s"] = restore_log_s(srv)
            down(srv)
        res["files"] = sorted((e.name, e.stat().st_size) for e in os.scandir(cache_dir) if e.name.endswith(".kv"))
        if keep_dir is not None:     # the largest checkpoint, for the in-process measurements
            big = max(res["files"], key=lambda f: f[1])[0]
            keep_dir.mkdir(parents=True, exist_ok=True)
            for old in keep_dir.glob("*.kv"):
                old.unlink()
            shutil.copy2(cache_dir / big, keep_dir / big)
            res["kept"] = str(keep_dir / big)
    finally:
        srv.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return res


# --- output ---------------------------------------------------------------------------------

def summarize(cycles: list[dict]) -> dict:
    by = {}
    for c in cycles:
        d = by.setdefault(c["size"], {"cold": [], "live": [], "restored": [], "ratios": [],
                                      "turn1": c.get("turn1_tokens"), "prompt": None, "bad": 0})
        for k in ("cold", "live", "restored"):
            d[k] += [r["ttft"] for r in c[k]]
            d["bad"] += sum(not r["path_ok"] for r in c[k])
        d["prompt"] = c["cold"][0]["prompt_tokens"] if c["cold"] else None
        if c["cold"] and c["restored"]:
            d["ratios"].append(med([r["ttft"] for r in c["restored"]]) / c["cold"][0]["ttft"])
    return {k: {**v, **{f"{x}_median": med(v[x]) for x in ("cold", "live", "restored")},
                "ratio_median": med(v["ratios"])} for k, v in sorted(by.items())}


def table(res: dict) -> str:
    out = []
    s = res.get("summary", {})
    if s:
        out.append("TTFT (s, median; streamed, max_tokens 1; individual samples in brackets)")
        out.append("")
        out += ["| earlier turns (tokens) | prompt (tokens) | cold | live session | restored from disk "
                "| restored / cold (same cycle) | target <= 0.10 |", "|---|---|---|---|---|---|---|"]
        for size, d in s.items():
            f = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
            out.append(f"| {d['turn1']} | {d['prompt']} | {d['cold_median']:.2f} [{f(d['cold'])}] | "
                       f"{d['live_median']:.2f} [{f(d['live'])}] | {d['restored_median']:.2f} [{f(d['restored'])}] | "
                       f"{d['ratio_median']:.3f} [{', '.join(f'{x:.3f}' for x in d['ratios'])}] | "
                       f"{'yes' if d['ratio_median'] <= 0.1 else 'NO'} |")
        bad = sum(d["bad"] for d in s.values())
        out.append("")
        out.append("every measured request took the expected path (cached_tokens checked)" if not bad
                   else f"{bad} measured requests took an unexpected path (see the JSON)")
        rl = [r.get("restore_log_s") for c in res["cycles"] for r in c["restored"] if r.get("restore_log_s")]
        if rl:
            out.append("inference log 'restored ... in X s' per restored request: " +
                       ", ".join(f"{c['size']}: " + ", ".join(f"{r['restore_log_s']:.3f}" for r in c["restored"]
                                                               if r.get("restore_log_s")) for c in res["cycles"]))
        out.append("")
    r = res.get("restore")
    if r:
        out.append(f"restore read speed, page cache, {r['tokens']} tokens, {r['file_bytes'] / 1e6:.1f} MB file, "
                   f"{len(r['restore_s'])} runs")
        out.append("")
        out += ["| step | median s | GB/s | target |", "|---|---|---|---|"]
        out.append(f"| Disk.restore (read + checks + copy into the session) | {r['restore_s_median']:.3f} | "
                   f"{r['restore_gb_s']:.2f} | >= 1 GB/s: {'yes' if r['restore_gb_s'] >= 1 else 'NO'} |")
        out.append(f"| kvfile.read alone (mmap, checksum) | {r['read_s_median']:.3f} | {r['read_gb_s']:.2f} | |")
        out.append(f"| copy into the session (import_) | {r['import_s_median']:.3f} | "
                   f"{r['file_bytes'] / r['import_s_median'] / 1e9:.2f} | |")
        out.append(f"| Disk.save (copy into a shm slot; inference's share of a save) | "
                   f"{r['save_copy_s_median']:.3f} | {r['file_bytes'] / r['save_copy_s_median'] / 1e9:.2f} | |")
        out.append("")
    g = res.get("generation")
    if g:
        out.append(f"generation while the persister writes: decode {g['decode_tokens']} tokens at context "
                   f"{g['context']}, {len(g['alone'])} runs alone / {len(g['during'])} during; the writer is "
                   f"another process running Store.write of a {g['checkpoint_bytes'] / 1e6:.0f} MB checkpoint "
                   f"in a loop (median write {g['write_s_median']:.2f} s, {g['write_gb_s']:.2f} GB/s)")
        out.append("")
        out += ["| decode | tok/s median | samples |", "|---|---|---|"]
        out.append(f"| no save in flight | {g['alone_median']:.1f} | {', '.join(f'{x:.1f}' for x in g['alone'])} |")
        out.append(f"| persister writing | {g['during_median']:.1f} | {', '.join(f'{x:.1f}' for x in g['during'])} |")
        out.append(f"| ratio (target >= 0.90) | {g['ratio']:.2f} | {'yes' if g['ratio'] >= 0.9 else 'NO'} |")
        out.append("")
    m = res["machine"]
    out.append(f"machine: {m['cpus']} CPUs, loadavg {m['loadavg_start']:.2f} -> {m['loadavg_end']:.2f}, "
               f"wall {res['wall_s']:.0f} s")
    return "\n".join(out)


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams["svg.fonttype"] = "none"     # text stays text: a small, diffable SVG
    plt.rcParams["svg.hashsalt"] = "ricordo"
    s = res["summary"]
    xs = [d["prompt"] for d in s.values()]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label, mk in (("cold", "cold (fresh server, empty cache)", "o"),
                           ("live", "live session reused", "s"),
                           ("restored", "restored from disk after a restart", "^")):
        ys = [d[f"{key}_median"] for d in s.values()]
        ax.plot(xs, ys, marker=mk, label=label)
        for x, d in zip(xs, s.values()):
            ax.scatter([x] * len(d[key]), d[key], marker=mk, s=10, alpha=0.35, color=ax.lines[-1].get_color())
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens (earlier turns + ~200 new)")
    ax.set_ylabel("time to first token (s, log scale)")
    th = res.get("settings", {}).get("threads") or "default"
    ax.set_title("ricordo time to first token: cold / live / restored\n"
                 f"(medians, dots = samples; 2 shared CPU cores, torch threads {th})", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, metadata={"Date": None} if path.endswith(".svg") else None)
    log(f"plot written to {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="*", default=[2000, 4000, 8000],
                    help="earlier-turn tokens (capped to fit the context)")
    ap.add_argument("--repeats", type=int, default=2, help="cycles per size")
    ap.add_argument("--live", type=int, default=3, help="live-session samples per cycle")
    ap.add_argument("--restores", type=int, default=2, help="restarts (restored samples) per cycle")
    ap.add_argument("--restore-runs", type=int, default=7, help="in-process restore timings")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--decode-rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="RICORDO_THREADS for the server (0 = default)")
    ap.add_argument("--no-warmup", action="store_true",
                    help="measure the first request of each fresh server process (default: a tiny request "
                         "first, so cold and restored both exclude the process's own first-forward warm-up)")
    ap.add_argument("--checkpoint", default="", help="skip the server part; in-process parts on this .kv file "
                    "('make': write one of the largest size in-process first)")
    ap.add_argument("--skip-inproc", action="store_true")
    ap.add_argument("--plot", default=str(Path(__file__).with_name("cache_ttft.svg")))
    ap.add_argument("--replot", default="", help="only redraw the plot and the table from a saved --json output")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            res = json.load(f)
        res["summary"] = {int(k): v for k, v in res["summary"].items()}
        plot(res, args.plot)
        print(table(res))
        return 0
    if args.threads:
        os.environ["RICORDO_THREADS"] = str(args.threads)    # Server keeps it, Settings reads it
    res = {"settings": vars(args), "machine": {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()[0]},
           "cycles": []}
    t0 = time.perf_counter()
    keep = Path(tempfile.mkdtemp(prefix="ricordo-bench-ckpt-"))
    try:
        ckpt = args.checkpoint
        if ckpt == "make":
            conv = Conversations()
            n = min(max(args.sizes), conv.n_ctx - NEW_TOKENS - REPLY_TOKENS - 60 - HEADROOM)
            log(f"in-process: making a checkpoint of about {n} tokens")
            ckpt = make_checkpoint(conv, n, str(keep / "kv"))
        elif not ckpt:
            conv = Conversations()
            limit = conv.n_ctx - NEW_TOKENS - REPLY_TOKENS - 60 - HEADROOM
            sizes = sorted({min(x, limit) for x in args.sizes})
            for rep in range(args.repeats):
                for size in sizes:
                    c = cycle(conv, size, rep, args, keep if size == max(sizes) else None)
                    res["cycles"].append(c)
                    ckpt = c.get("kept", ckpt)
            res["summary"] = summarize(res["cycles"])
            if args.plot:
                try:
                    plot(res, args.plot)
                except ImportError:
                    log("matplotlib is not installed; no plot")
        if ckpt and not args.skip_inproc:
            log(f"in-process: restore speed of {ckpt}")
            res["restore"] = restore_speed(ckpt, args.restore_runs)
            log("in-process: decode alone vs during a persister write")
            res["generation"] = generation_during_write(ckpt, args.decode_tokens, args.decode_rounds)
    finally:
        shutil.rmtree(keep, ignore_errors=True)
    res["machine"]["loadavg_end"] = os.getloadavg()[0]
    res["wall_s"] = time.perf_counter() - t0
    return emit(table(res), res, args.json)


if __name__ == "__main__":
    sys.exit(main())
