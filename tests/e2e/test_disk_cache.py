"""The disk KV cache end to end: honcho starts every process of the Procfile with the real
default model and a cache directory, and the official `openai` client talks to it.

Small cache settings (min 32 tokens, alignment 32, trim 4, a continued checkpoint every 64
tokens) so that prompts of ~70 tokens get every kind of checkpoint. Greedy, few tokens.

Server starts are what costs (model load), so most tests share one scripted `Flow` whose
phases run once, on demand, in order:

1. fresh directory D1: turn A1, then stop (the shutdown checkpoint of A's state);
2. D1 again: A2 (restored from the shutdown checkpoint, with logprobs), B1, A3, B2 (each
   conversation keeps coming back from disk), then five requests that each hit a checkpoint
   corrupted a different way just before (checksum, magic, version, truncation, name);
3. fresh directory D2 seeded with unsound files (scan-time rejections), then the baseline:
   A1, A2 (live session reused, logprobs), A3, B1, B2, each conversation without the other.

Tests on the flow: checkpoint byte layout and `hexdump -C` (phase 1), restart persistence
(2), alternating conversations, bit-identical restored answers and corrupt files (3). The
eviction test has its own server (a budget of a few MB). About four server starts in all.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import struct
import subprocess
import time
from pathlib import Path

import pytest

from common import kvfile as kf

from .cachedir import entries, longest_prefix_entry, settle, text_model
from .server import Server

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
CACHE_ENV = {
    "RICORDO_KV_CACHE_MIN_TOKENS": "32",
    "RICORDO_KV_CACHE_BOUNDARY_ALIGN_TOKENS": "32",
    "RICORDO_KV_CACHE_BOUNDARY_TRIM_TOKENS": "4",
    "RICORDO_KV_CACHE_CONTINUED_INTERVAL_TOKENS": "64",
    "RICORDO_MAX_LIVE_SESSIONS": "1",   # one resident session: conversations come back from disk
}
MIN_TOKENS = 32

SYS_A = ("You are the assistant of a mountain hut in the Dolomites, at 2,300 metres above Cortina. "
         "Guests ask about rooms, meals, trails, mountain guides and the weather. The hut is open "
         "from June to September. Answer in one short sentence.")
SYS_B = ("You help the readers of a small public library in a seaside town. They ask about opening "
         "hours, loans, the reading room, events and new books for children and teenagers; keep "
         "every answer brief, friendly and precise.")
USER_A = ["Is there a free room for two on Friday?", "What is for dinner tonight?",
          "Which trail is easy for children?"]
USER_B = ["Are you open on Saturday morning?", "How long can I keep a book?"]

STORED = re.compile(r"stored sha1=([0-9a-f]{40}) \((\d+) tokens, reason (\w+), (\d+) bytes")
HIT = re.compile(r"hit for sha1=([0-9a-f]{40}) \(loaded (\d+) tokens\)")


# ------------------------------------------------------------------ helpers

def read_trace(path) -> str:
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        return ""


def stored(trace_path) -> list[tuple[str, int, str, int]]:
    """(sha1, tokens, reason, bytes) of every `stored` trace line, in order."""
    return [(s, int(n), r, int(b)) for s, n, r, b in STORED.findall(read_trace(trace_path))]


def wait_for(pred, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def cached(r) -> int:
    d = r.usage.prompt_tokens_details
    return d.cached_tokens if d is not None and d.cached_tokens is not None else 0


def logprob_rows(r):
    """Every generated token's text, logprob and top alternatives, exactly as received."""
    return [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
            for t in r.choices[0].logprobs.content]


def messages(system: str, users: list[str], answers: list[str]) -> list[dict]:
    out = [{"role": "system", "content": system}]
    for i, u in enumerate(users):
        out.append({"role": "user", "content": u})
        if i < len(answers):
            out.append({"role": "assistant", "content": answers[i]})
    return out


def prompt_bytes(msgs) -> bytes:
    """The rendered prompt, as the renderer makes it (the cache text of any checkpoint of it)."""
    t = text_model()
    return t.bos_text() + t.render_chat(msgs, add_generation_prompt=True).encode("utf-8", "surrogatepass")


# ------------------------------------------------------------------ the shared flow

class Conversation:
    def __init__(self, system: str, users: list[str]):
        self.system, self.users = system, users
        self.answers: list[str] = []
        self.responses = []

    def turn(self, srv: Server, i: int, **kw):
        """Ask turn i (0-based) with the answers received so far in this run."""
        assert len(self.answers) == i
        msgs = messages(self.system, self.users[:i + 1], self.answers)
        kw.setdefault("max_tokens", MAX_TOKENS)
        r = srv.client().chat.completions.create(model=srv.health["model"], messages=msgs,
                                                  temperature=0, **kw)
        assert r.choices[0].message.content is not None
        self.answers.append(r.choices[0].message.content)
        self.responses.append(r)
        return r


CORRUPTIONS = ("checksum mismatch", "bad magic", "wrong version", "truncated", "text does not match the name")


def corrupt(path: Path, how: str, other: Path | None = None) -> None:
    blob = bytearray(path.read_bytes())
    if how == "checksum mismatch":              # one bit in the K/V rows
        blob[len(blob) * 2 // 3] ^= 0x10
    elif how == "bad magic":
        blob[0:3] = b"KVX"
    elif how == "wrong version":
        blob[kf.OFF_VERSION] = 2
    elif how == "truncated":
        del blob[len(blob) // 2:]
    elif how == "text does not match the name":  # a sound file of another text, under this name
        blob = bytearray(other.read_bytes())
    else:
        raise ValueError(how)
    path.write_bytes(bytes(blob))


class Flow:
    def __init__(self, root: Path):
        self.root = root
        self.d1, self.d2 = root / "kv1", root / "kv2"
        self.t1, self.t2, self.t3 = root / "trace1", root / "trace2", root / "trace3"
        self.pristine = root / "pristine"
        self.srv: Server | None = None
        self.done: set[int] = set()
        self.failed: set[int] = set()
        self.res: dict = {}

    def env(self, d: Path, trace: Path) -> dict:
        return dict(CACHE_ENV, RICORDO_KV_DISK_DIR=str(d), RICORDO_TRACE=str(trace))

    def need(self, phase: int) -> None:
        for p in range(1, phase + 1):
            if p in self.failed:
                pytest.fail(f"phase {p} of the flow failed in an earlier test")
            if p not in self.done:
                try:
                    getattr(self, f"phase{p}")()
                except BaseException:
                    self.failed.add(p)
                    if self.srv is not None:
                        print(self.srv.tail())
                    raise
                self.done.add(p)

    def close(self) -> None:
        if self.srv is not None:
            self.srv.close()

    # 1: A1 on a fresh directory, then a clean stop
    def phase1(self) -> None:
        r = self.res
        self.srv = Server(env=self.env(self.d1, self.t1), name="ricordo-disk")
        self.srv.start()
        r["model"] = self.srv.health["model"]
        a = Conversation(SYS_A, USER_A)
        r["A1"] = a.turn(self.srv, 0)
        r["A1_prompt"] = prompt_bytes(messages(SYS_A, USER_A[:1], []))
        settle(self.d1, self.t1)
        r["after_A1"] = stored(self.t1)
        shutil.copytree(self.d1, self.pristine)
        r["stop_s"] = self.srv.stop()
        r["after_stop"] = stored(self.t1)
        r["files_after_stop"] = entries(self.d1)

    # 2: restart on D1; conversations alternate; corrupted checkpoints are hit
    def phase2(self) -> None:
        r = self.res
        self.srv.restart(**self.env(self.d1, self.t2))
        a, b = Conversation(SYS_A, USER_A), Conversation(SYS_B, USER_B)
        a.answers.append(r["A1"].choices[0].message.content)
        a.responses.append(r["A1"])
        r["A2_disk"] = a.turn(self.srv, 1, logprobs=True, top_logprobs=5)
        settle(self.d1, self.t2)
        shut = [x for x in r["after_stop"] if x[2] == "shutdown"]
        if shut:
            r["shut_header"] = kf.Header.unpack((self.d1 / f"{shut[0][0]}.kv").read_bytes()[:kf.HEADER_SIZE])
        r["B1_alt"] = b.turn(self.srv, 0)
        settle(self.d1, self.t2)
        r["A3_alt"] = a.turn(self.srv, 2)
        settle(self.d1, self.t2)
        r["B2_alt"] = b.turn(self.srv, 1)
        settle(self.d1, self.t2)
        r["alt"] = (a, b)
        r["trace2_alt"] = read_trace(self.t2)
        # each request below would restore the longest prefix on disk, corrupted just before
        r["corrupt"] = []
        for i, how in enumerate(CORRUPTIONS):
            conv = (SYS_A, USER_A, a.answers) if i % 2 == 0 else (SYS_B, USER_B, b.answers)
            system, users, answers = conv
            msgs = messages(system, users[:1], answers[:1])
            msgs.append({"role": "user", "content": f"Question {i}: can you say that again, please?"})
            prompt = prompt_bytes(msgs)
            target = longest_prefix_entry(self.d1, prompt)
            assert target is not None, f"nothing on disk for corruption {how!r}"
            other = next(self.d1 / f"{s}.kv" for s in entries(self.d1) if s != target)
            corrupt(self.d1 / f"{target}.kv", how, other)
            resp = self.srv.client().chat.completions.create(model=r["model"], messages=msgs, temperature=0,
                                                             max_tokens=2)
            settle(self.d1, self.t2)
            path = self.d1 / f"{target}.kv"
            # gone, or written anew (sound) by the cold prefill that followed the rejection
            after = kf.verify(str(path)) if path.exists() else None
            r["corrupt"].append((how, target, resp, after))
        r["trace2"] = read_trace(self.t2)

    # 3: fresh D2 seeded with unsound files; each conversation alone, live session reused
    def phase3(self) -> None:
        r = self.res
        self.d2.mkdir(mode=0o700)
        seeds = sorted(self.res["after_A1"], key=lambda x: x[1])   # (sha1, tokens, reason, bytes)
        assert len(seeds) >= 3, seeds
        bad = {}
        for (sha, _, _, _), how in zip(seeds, ("bad magic", "wrong version", "truncated")):
            shutil.copy(self.pristine / f"{sha}.kv", self.d2 / f"{sha}.kv")
            corrupt(self.d2 / f"{sha}.kv", how)
            bad[sha] = how
        # a sound checkpoint under the name of another text: the whole A1 prompt
        liar = hashlib.sha1(r["A1_prompt"]).hexdigest()
        shutil.copy(self.pristine / f"{seeds[-1][0]}.kv", self.d2 / f"{liar}.kv")
        bad[liar] = "name mismatch"
        (self.d2 / f"{seeds[0][0]}.kv.tmp.4242").write_bytes(b"left by a crash")
        (self.d2 / "README").write_text("not a cache entry")
        r["seeded"] = bad
        self.srv.restart(**self.env(self.d2, self.t3))
        r["trace3_start"] = wait_for(lambda: read_trace(self.t3).count("rejected") >= len(bad) and read_trace(self.t3),
                                     what="the startup scan's rejections")
        r["d2_at_start"] = set(os.listdir(self.d2))
        a, b = Conversation(SYS_A, USER_A), Conversation(SYS_B, USER_B)
        r["A1_live"] = a.turn(self.srv, 0)
        r["A2_live"] = a.turn(self.srv, 1, logprobs=True, top_logprobs=5)
        r["A3_live"] = a.turn(self.srv, 2)
        r["B1_live"] = b.turn(self.srv, 0)
        r["B2_live"] = b.turn(self.srv, 1)
        r["alone"] = (a, b)
        r["trace3"] = read_trace(self.t3)
        self.srv.close()
        self.srv = None


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    f = Flow(tmp_path_factory.mktemp("disk-cache"))
    yield f
    f.close()


# ------------------------------------------------------------------ tests on the flow

def hexdump_bytes(out: str) -> tuple[bytes, dict[int, str]]:
    """Bytes and ASCII column per offset from `hexdump -C` output (handles `*` lines)."""
    data, ascii_col, prev, pending_star = bytearray(), {}, None, False
    for line in out.splitlines():
        if line.strip() == "*":
            pending_star = True
            continue
        mo = re.match(r"^([0-9a-f]{8})  ((?:[0-9a-f]{2} {1,2}){0,16})\s*(?:\|(.*)\|)?$", line)
        if not mo:
            continue
        off = int(mo.group(1), 16)
        if pending_star and prev is not None:
            while len(data) < off:
                data += prev
            pending_star = False
        row = bytes(int(x, 16) for x in mo.group(2).split())
        if len(data) != off:
            break
        data += row
        prev = row
        if mo.group(3) is not None:
            ascii_col[off] = mo.group(3)
    return bytes(data), ascii_col


def test_checkpoint_byte_layout(flow):
    flow.need(1)
    r = flow.res
    after = r["after_A1"]
    reasons = sorted(x[2] for x in after)
    assert "cold" in reasons and "continued" in reasons, after
    a1 = r["A1"]
    n_prompt = a1.usage.prompt_tokens
    sizes = {}
    for sha, n, reason, size in after:
        path = flow.pristine / f"{sha}.kv"
        raw = path.read_bytes()
        assert len(raw) == size                                  # the size the trace reported
        assert raw[0:3] == b"KVC" and raw[kf.OFF_VERSION] == 1
        assert raw[kf.OFF_QUANT] == 4                            # Q4_1 weights
        assert raw[kf.OFF_REASON] == {"cold": 1, "continued": 2}[reason]
        assert raw[kf.OFF_FLAGS] == 0 and raw[7] == 0 and raw[20:24] == bytes(4)
        (tokens,) = struct.unpack_from("<I", raw, kf.OFF_TOKENS)
        (hits,) = struct.unpack_from("<I", raw, kf.OFF_HITS)
        (ctx,) = struct.unpack_from("<I", raw, kf.OFF_CTX)
        created, last_used, payload = struct.unpack_from("<QQQ", raw, kf.OFF_CREATED)
        (text_len,) = struct.unpack_from("<I", raw, kf.HEADER_SIZE)
        assert tokens == n and hits == 0 and ctx == 8192
        assert abs(created - time.time()) < 3600 and last_used == created
        assert payload == len(raw) - 52 - text_len               # no KTM section
        text = raw[52:52 + text_len]
        assert r["A1_prompt"].startswith(text)                   # the rendered prompt's bytes
        assert os.path.basename(path) == kf.entry_name(text)
        assert raw[52 + text_len:56 + text_len] == b"DENS"
        f = struct.unpack_from("<13I", raw, 52 + text_len)
        assert f[1] == 1 and f[2] == 8192 and f[7] == n and f[12] in (0, 1, 2)
        per_token = 2 * f[8] * f[9] * f[10] * kf.KV_ITEMSIZE[f[12]] + 4
        assert payload == 52 + 16 + 8 + 4 * f[11] + per_token * n
        assert kf.verify(str(path)) == []
        sizes[reason, n] = (size, per_token)
    # the cold checkpoints: aligned (a multiple of 32, minus 4) and the end of the system part
    cold = sorted(n for _, n, reason, _ in after if reason == "cold")
    assert n_prompt // 32 * 32 - 4 in cold or n_prompt - 4 in cold, (cold, n_prompt)
    sys_part = prompt_bytes([{"role": "system", "content": SYS_A}])[:-len(b"<|im_start|>assistant\n")]
    sys_tokens = len(text_model().encode(sys_part))
    assert sys_tokens in cold, (cold, sys_tokens)
    assert 64 in [n for _, n, reason, _ in after if reason == "continued"]
    # the shutdown checkpoint: the whole live session (every token but the last sampled one,
    # which is never run: the next turn's prefill takes it)
    shut = [x for x in r["after_stop"] if x[2] == "shutdown"]
    assert len(shut) == 1, r["after_stop"]
    assert shut[0][1] == n_prompt + a1.usage.completion_tokens - 1
    assert (flow.d1 / f"{shut[0][0]}.kv").read_bytes()[kf.OFF_REASON] == kf.SHUTDOWN
    print(f"\ncheckpoint sizes (reason, tokens) -> (bytes, K/V bytes per token): {sizes}")


def test_hexdump_shows_the_prompt_text(flow):
    """What a person sees with `hexdump -C file.kv | head -80`: the prompt right after byte 52."""
    if shutil.which("hexdump") is None:
        pytest.skip("hexdump is not installed")
    flow.need(1)
    r = flow.res
    after = r["after_A1"]
    cold_sha = max((x for x in after if x[2] == "cold"), key=lambda x: x[1])[0]
    path = flow.pristine / f"{cold_sha}.kv"
    out = subprocess.run(f"hexdump -C '{path}' | head -80", shell=True, capture_output=True,
                         text=True, check=True).stdout
    assert len(out.splitlines()) == 80
    data, ascii_col = hexdump_bytes(out)
    raw = path.read_bytes()
    assert len(data) >= 1024 and data == raw[:len(data)]
    assert ascii_col[0].startswith("KVC")
    text = r["A1_prompt"]
    assert data[52:52 + 200] == text[:200]
    assert ascii_col[0x30][4:] == text[:12].decode() == "<|im_start|>"
    shown = "".join(ascii_col[o] for o in sorted(ascii_col) if o >= 0x40)
    assert shown.startswith("system.You are the assistant of a mountain hut")


def test_restart_persistence(flow):
    flow.need(2)
    r = flow.res
    largest = max(n for _, n, _, _ in r["after_stop"])
    a2 = r["A2_disk"]
    assert cached(a2) >= largest, (cached(a2), r["after_stop"])
    shut = [x for x in r["after_stop"] if x[2] == "shutdown"][0]
    assert f"KV cache: hit for sha1={shut[0]} (loaded {shut[1]} tokens)" in r["trace2_alt"]
    assert cached(a2) == shut[1]
    assert a2.usage.prompt_tokens > shut[1]
    # the restore bumped the file's hit count and last-used time in place
    h = r.get("shut_header")
    assert h is not None, r["after_stop"]
    assert h.hits == 1 and h.last_used >= h.created and h.reason == kf.SHUTDOWN


def test_alternating_conversations(flow):
    flow.need(3)
    r = flow.res
    a_alt, b_alt = r["alt"]
    a_alone, b_alone = r["alone"]
    t = r["trace2_alt"]
    # A2: from the shutdown checkpoint; B1: nothing of B anywhere; A3 and B2: the other
    # conversation replaced the live session, so each comes back from its evict checkpoint
    assert cached(r["B1_alt"]) < MIN_TOKENS
    for name, prev in (("A3_alt", r["A2_disk"]), ("B2_alt", r["B1_alt"])):
        resp = r[name]
        state = prev.usage.prompt_tokens + prev.usage.completion_tokens - 1   # last token not run
        assert cached(resp) == state, (name, cached(resp), state)
        assert re.search(rf"hit for sha1=[0-9a-f]{{40}} \(loaded {state} tokens\)", t), (name, t)
    evicts = [x for x in STORED.findall(t) if x[2] == "evict"]
    assert len(evicts) >= 3, t
    # the same answers as each conversation alone (greedy)
    assert a_alt.answers == a_alone.answers[:len(a_alt.answers)]
    assert b_alt.answers == b_alone.answers[:len(b_alt.answers)]
    # alone, later turns reuse the live session
    for name in ("A2_live", "A3_live", "B2_live"):
        assert cached(r[name]) > MIN_TOKENS, name


def test_restored_answer_is_bit_identical(flow):
    """A2 after a restart (state from the shutdown checkpoint) and A2 on the live session:
    the same text and the very same logprob floats, alternatives included."""
    flow.need(3)
    r = flow.res
    disk, live = r["A2_disk"], r["A2_live"]
    assert r["A1"].choices[0].message.content == r["A1_live"].choices[0].message.content
    assert cached(live) == cached(disk)          # live: the whole A1 state too
    assert disk.choices[0].message.content == live.choices[0].message.content
    rows_disk, rows_live = logprob_rows(disk), logprob_rows(live)
    assert len(rows_disk) == disk.usage.completion_tokens and all(len(x[2]) == 5 for x in rows_disk)
    assert rows_disk == rows_live


def test_corrupt_files_are_rejected(flow):
    flow.need(3)
    r = flow.res
    t2 = r["trace2"]
    assert [c[0] for c in r["corrupt"]] == list(CORRUPTIONS)
    for how, target, resp, after in r["corrupt"]:
        assert resp.choices[0].finish_reason in ("stop", "length")
        assert cached(resp) == 0, (how, cached(resp))               # cold, not from the bad file
        assert f"KV cache: rejected sha1={target} (reason: {how})" in t2, (how, t2)
        # the persister deleted it (the prefill after may have stored that prefix anew)
        assert f"evicted sha1={target} (rejected on restore: {how})" in t2, (how, t2)
        assert after is None or after == [], (how, after)
    # unsound files present at startup are not entries: rejected by the scan, never restored
    t3 = r["trace3_start"]
    for sha, how in r["seeded"].items():
        assert f"KV cache: rejected sha1={sha} (reason: {how})" in t3, (sha, how, t3)
        assert f"hit for sha1={sha}" not in r["trace3"]
    assert not any(".kv.tmp." in n for n in r["d2_at_start"])
    assert "README" in r["d2_at_start"]
    assert cached(r["A1_live"]) == 0
    assert not HIT.search(r["trace3"])          # alone, nothing ever came from disk


# ------------------------------------------------------------------ eviction

def synthetic(d: Path, i: int, now: int, mb: float) -> str:
    """A sound entry of about `mb` MB with a foreign geometry (never restorable, counted)."""
    import numpy as np
    n = 256
    hd = int(mb * (1 << 20) / (16 * n))          # K and V, 2 layers, 2 heads, 2 bytes
    g = kf.Geometry(ctx_size=8192, chunk_size=512, kv_capacity=8192, n_layers=2, kv_heads=2, head_dim=hd,
                    vocab_size=16, kv_dtype=kf.KV_F16)
    k = np.zeros((2, n, 2, hd), np.float16)
    text = f"synthetic entry {i} ".encode() * 4
    (d / kf.entry_name(text)).write_bytes(kf.pack(text, list(range(n)), np.zeros(16, np.float32), k, k, g,
                                                  bytes(16), 4, kf.COLD, now=now))
    return kf.entry_name(text)[:-3]


def test_eviction_keeps_the_directory_within_budget(tmp_path):
    budget_mb = 5
    budget = budget_mb << 20
    d, trace = tmp_path / "kv", tmp_path / "trace"
    d.mkdir(mode=0o700)
    now = int(time.time())
    old = [synthetic(d, i, now - 3000 + i, 1.9) for i in range(3)]       # 3 x 1.9 MB > 5 MB
    env = dict(CACHE_ENV, RICORDO_KV_DISK_DIR=str(d), RICORDO_TRACE=str(trace),
               RICORDO_KV_DISK_SPACE_MB=str(budget_mb))
    topics = ["the history of glass making in Murano", "how lighthouses were kept in the 1800s",
              "why sourdough bread rises slowly", "the rules of the game of bocce"]
    with Server(env=env, name="ricordo-evict") as srv:
        # startup eviction: the least recently used synthetic entry went first
        t = wait_for(lambda: f"evicted sha1={old[0]}" in read_trace(trace) and read_trace(trace),
                     what="the startup eviction")
        assert old[1] in entries(d) and old[2] in entries(d), t
        assert sum(entries(d).values()) <= budget
        seen = []
        for i, topic in enumerate(topics):
            prompt = (f"Notes {i}. Write a short paragraph about {topic}. Mention where it happened, "
                      f"who did the work, what tools they used, and one surprising fact that "
                      f"visitors usually do not know about {topic}. Use simple words that a reader "
                      f"of twelve would understand, avoid lists, be concrete and keep it")
            resp = srv.client().completions.create(model=srv.health["model"], prompt=prompt, max_tokens=3,
                                                   temperature=0)
            assert resp.usage.prompt_tokens >= 64
            settle(d, trace)
            files = entries(d)
            total = sum(files.values())
            assert total <= budget, (i, total, files)
            last = stored(trace)[-1]
            assert last[0] in files, (i, last, files)                 # the newest is kept
            seen.append([x[0] for x in stored(trace)])
            time.sleep(1.1)                                           # distinct last-used seconds
        allstored = stored(trace)
        per_token = {}
        for sha, n, reason, size in allstored:
            per_token.setdefault(reason, []).append((n, size))
        print(f"\nstored (tokens, bytes): {per_token}")
        # the oldest are gone: the synthetic entries and the first conversation's checkpoints
        files = entries(d)
        assert not set(old) & set(files)
        first = seen[0]
        assert not set(first) & set(files), (first, files)
        assert "lru, over the disk budget" in read_trace(trace)
        srv.stop()
    settle(d, trace)
    files = entries(d)
    assert sum(files.values()) <= budget
    shut = [x for x in stored(trace) if x[2] == "shutdown"]
    assert shut and shut[-1][0] in files
