"""3. Corrupted checkpoints: a fuzz campaign over valid `.kv` files (truncation, bit flips and
byte changes in the header, text, payload head, fingerprint, token ids, logits, K/V rows,
checksum and KTM section, appended bytes).

Unit level: files written by the product's own path (Disk.save -> shared-memory slot ->
Store.write, as tests/procs/persister/test_store.py does) for a small fake model, then mutated and
restored with procs.inference.disk.Disk.restore. Every outcome must be a RestoreError with a
reason, or a restored state equal to the original (tokens, logits, K, V bit for bit).
End to end: a few real checkpoints mutated on disk; the request succeeds by a cold prefill
and the trace has the rejection reason.
"""
from __future__ import annotations

import collections
import hashlib
import logging
import os
import random
import struct
import time

import numpy as np
import pytest

from .conftest import Stats, full_only, scale
from .harness import entries, longest_prefix_entry, settle, unique_prompt

torch = pytest.importorskip("torch")

from common import kvfile as kf                                       # noqa: E402
from common import messages as m                                      # noqa: E402
from common.config import Settings                                    # noqa: E402
from procs.inference.disk import Disk, RestoreError                   # noqa: E402
from procs.inference.kvsession import KVSession                           # noqa: E402
from procs.persister.server import CORRUPT                            # noqa: E402
from procs.persister.store import Store                               # noqa: E402
from common.trace import Trace                                        # noqa: E402

LOG = logging.getLogger("stress-fuzz")
N_CTX, CHUNK = 128, 32
FINGERPRINT = bytes(range(16))
# every reason a restore may give (kvfile's fixed strings and Disk's own)
KNOWN_REASONS = CORRUPT | {"geometry mismatch", "layer rows mismatch", "fingerprint mismatch", "context too large", "file gone",
                           "different quantization", "bad sha1", "no cache directory"}


class Cfg:
    def __init__(self, vocab=64):
        self.n_layers, self.n_kv_heads, self.head_dim, self.vocab_size, self.quant_bits = 2, 2, 8, vocab, 4
        self.windows = ()   # every layer global: a dense model
        self.linear_layers, self.kv_layers = (), self.n_layers    # no linear-attention layers
        self.kv_tensors = 2                                         # K and V (not latent attention)


class FakeModel:
    """What Disk and KVSession use of a model: config, dtype, device, fingerprint."""

    def __init__(self, dtype):
        self.cfg, self.dtype, self.device = Cfg(), dtype, torch.device("cpu")
        self.max_context, self.fingerprint = N_CTX, FINGERPRINT


def piece_bytes(tokens) -> bytes:
    return b"".join(b"<t%d>" % t for t in tokens)


class Writer:
    """Disk on a fake model whose saves go through the slot straight into a Store."""

    def __init__(self, tmp, dtype):
        self.dir = tmp / "kv"
        self.store = Store(str(self.dir), 1000, LOG, Trace("", "persister"))
        self.s = Settings(kv_disk_dir=str(self.dir), run_dir=str(tmp / "run"), chunk_size=CHUNK)
        os.makedirs(self.s.run_dir, exist_ok=True)
        self.model = FakeModel(dtype)
        self.saved: list[str] = []
        self.ktm: dict[str, bytes] = {}
        self.disk = Disk(self.s, self.model, N_CTX, self.s.run_dir, self.send, lambda t: None, LOG)

    def send(self, msg) -> None:
        from shm.slots import read_slot
        assert isinstance(msg, m.SaveCheckpoint)
        mm, body = read_slot(msg.slot_path, msg.nbytes)
        try:
            text = piece_bytes(msg.tokens)
            self.saved.append(self.store.write(msg, body, text, {k: v for k, v in self.ktm.items() if v in text}))
        finally:
            body.release()
            mm.close()
        self.disk.slot_freed(msg.slot, msg.seq)

    def checkpoint(self, rnd: random.Random, n: int, ktm: bool):
        """A live state of n random tokens, saved; returns (sha1, tokens, logits, k, v)."""
        c = self.model.cfg
        sess = KVSession(self.model, N_CTX, CHUNK)
        tokens = [rnd.randrange(c.vocab_size) for _ in range(n)]
        g = torch.Generator().manual_seed(rnd.randrange(1 << 30))
        k = torch.randn((c.n_layers, n, c.n_kv_heads, c.head_dim), generator=g).to(self.model.dtype)
        v = torch.randn((c.n_layers, n, c.n_kv_heads, c.head_dim), generator=g).to(self.model.dtype)
        logits = torch.randn(c.vocab_size, generator=g)
        sess.import_(tokens, logits, k, v)
        old = hashlib.sha1(piece_bytes(tokens)).hexdigest()
        if old in self.store.index:           # the same tokens again: a new state under that name
            self.store.remove(old, "fuzz: same text again")
        self.ktm = {f"call_{rnd.randrange(1 << 64):032x}": piece_bytes(tokens[1:3])} if ktm and n >= 3 else {}
        assert self.disk.save(sess, n, sess.logits, kf.COLD)
        sha = self.saved[-1]
        assert sha and kf.verify(self.store.entry_path(sha)) == []
        return sha, tokens, logits.clone(), k.clone(), v.clone()

    def close(self):
        self.disk.close()


def regions(blob: bytes) -> dict[str, tuple[int, int]]:
    h = kf.Header.unpack(blob)
    (tl,) = struct.unpack_from("<I", blob, kf.HEADER_SIZE)
    p0 = kf.TEXT_OFFSET + tl
    end = p0 + h.payload_bytes
    n = h.n_tokens
    (vocab,) = struct.unpack_from("<I", blob, p0 + 4 * 11)
    tok0 = p0 + kf.PAYLOAD_HEAD_SIZE + kf.FINGERPRINT_SIZE
    lg0 = tok0 + 4 * n
    kv0 = lg0 + 4 * vocab
    r = {"header": (0, kf.HEADER_SIZE), "text length": (kf.HEADER_SIZE, kf.TEXT_OFFSET), "text": (kf.TEXT_OFFSET, p0),
         "payload head": (p0, p0 + kf.PAYLOAD_HEAD_SIZE),
         "fingerprint": (p0 + kf.PAYLOAD_HEAD_SIZE, tok0), "tokens": (tok0, lg0), "logits": (lg0, kv0),
         "kv rows": (kv0, end - kf.CHECKSUM_SIZE), "checksum": (end - kf.CHECKSUM_SIZE, end)}
    if len(blob) > end:
        r["ktm"] = (end, len(blob))
    return {k: v for k, v in r.items() if v[1] > v[0]}


# header bytes whose change must not matter to the restored state: quant bits, reason, flags,
# reserved, hit count, creation and last-used times (offset 6 bit 0 = KTM flag: see below)
HARMLESS_HEADER = {kf.OFF_QUANT, kf.OFF_REASON, kf.OFF_FLAGS, 7, *range(12, 16), *range(20, 40)}


def mutate(blob: bytes, rnd: random.Random, kind: str, region: str) -> tuple[bytes, str]:
    """One mutation of `kind` in `region`; returns (new bytes, description)."""
    r = regions(blob)
    lo, hi = r[region]
    b = bytearray(blob)
    if kind == "bitflip":
        off, bit = rnd.randrange(lo, hi), rnd.randrange(8)
        b[off] ^= 1 << bit
        return bytes(b), f"{region} byte {off} bit {bit}"
    if kind == "byte":
        off = rnd.randrange(lo, hi)
        b[off] = (b[off] + rnd.randrange(1, 256)) & 0xFF
        return bytes(b), f"{region} byte {off} set"
    if kind == "zeros":
        off = rnd.randrange(lo, hi)
        k = min(rnd.randrange(1, 17), hi - off)
        if not any(b[off:off + k]):
            b[off] = 1
        else:
            b[off:off + k] = bytes(k)
        return bytes(b), f"{region} {k} bytes zeroed at {off}"
    if kind == "truncate":
        cut = rnd.choice([lo, rnd.randrange(lo, hi), hi - 1]) if hi > lo else lo
        return bytes(b[:cut]), f"truncated to {cut} ({region})"
    if kind == "append":
        return bytes(b) + bytes(rnd.randrange(256) for _ in range(rnd.randrange(1, 65))), "bytes appended"
    raise ValueError(kind)


KINDS = ("bitflip", "byte", "zeros", "truncate")


def fuzz_one(w: Writer, sess: KVSession, rnd: random.Random, n_mutations: int, out: dict) -> None:
    n = rnd.choice((1, 3, 17, 40, 96))
    sha, tokens, logits, k, v = w.checkpoint(rnd, n, ktm=rnd.random() < 0.5)
    path = w.store.entry_path(sha)
    with open(path, "rb") as f:
        orig = f.read()
    plan = [(kind, region) for kind in KINDS for region in regions(orig)] + [("append", "checksum")]
    bits = torch.int16 if k.dtype != torch.float32 else torch.int32
    for i in range(n_mutations):
        kind, region = plan[i % len(plan)] if i < len(plan) else rnd.choice(plan)
        blob, what = mutate(orig, rnd, kind, region)
        if blob == orig:
            continue
        with open(path, "wb") as f:
            f.write(blob)
        sess.k.zero_()
        sess.v.zero_()
        out["mutations"] += 1
        out["by_region"][region] += 1
        try:
            got = w.disk.restore(sess, sha)
        except RestoreError as e:
            assert isinstance(e.reason, str) and e.reason, what
            assert e.reason in KNOWN_REASONS, (e.reason, what)
            assert len(sess) == 0 and sess.logits is None, f"a failed restore left a state ({what})"
            out["rejected"][e.reason] += 1
            if e.reason not in CORRUPT:
                out["kept_by_persister"][f"{e.reason} ({region})"] += 1
            continue
        except Exception as e:     # noqa: BLE001
            raise AssertionError(f"restore crashed with {type(e).__name__}: {e} after: {what}") from e
        # accepted: the state must be the original's, bit for bit
        assert got == n and sess.tokens == tokens, what
        assert torch.equal(sess.logits.view(torch.int32), logits.view(torch.int32)), what
        kk = sess.k[:, :, :n].transpose(1, 2)
        vv = sess.v[:, :, :n].transpose(1, 2)
        assert torch.equal(kk.contiguous().view(bits), k.contiguous().view(bits)), what
        assert torch.equal(vv.contiguous().view(bits), v.contiguous().view(bits)), what
        out["accepted"][region] += 1
        # and only harmless bytes changed: header fields outside the state, or past the payload
        end = regions(orig)["checksum"][1]
        diffs = [i for i in range(min(len(blob), len(orig))) if blob[i] != orig[i]]
        assert len(blob) >= end and all(i in HARMLESS_HEADER or i >= end for i in diffs), \
            f"accepted a change outside the harmless fields: {what}"
        if kf.verify(path):
            out["accepted_but_verify_flags"] += 1
    with open(path, "wb") as f:
        f.write(orig)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_restore_fuzz(tmp_path, dtype):
    total = scale(100, 2500)     # per dtype: 200 in the fast subset, 5000 in the full campaign
    rnd = random.Random(f"fuzz-{dtype}")
    w = Writer(tmp_path, getattr(torch, dtype))
    sess = KVSession(w.model, N_CTX, CHUNK)
    out = {"mutations": 0, "by_region": collections.Counter(), "rejected": collections.Counter(),
           "accepted": collections.Counter(), "kept_by_persister": collections.Counter(),
           "accepted_but_verify_flags": 0}
    try:
        files = 0
        while out["mutations"] < total:
            fuzz_one(w, sess, rnd, min(60, total - out["mutations"]), out)
            files += 1
    finally:
        w.close()
    assert sum(out["rejected"].values()) + sum(out["accepted"].values()) == out["mutations"]
    Stats.add(f"fuzz: Disk.restore ({dtype})", files=files, mutations=out["mutations"],
              rejected=sum(out["rejected"].values()), accepted_equal_state=sum(out["accepted"].values()),
              crashes=0, different_state=0, reasons=dict(out["rejected"]),
              kept_by_persister=dict(out["kept_by_persister"]),
              accepted_but_verify_flags=out["accepted_but_verify_flags"])


def test_kvfile_read_fuzz(tmp_path):
    """kvfile.read with expect_geometry/expect_fingerprint on mutated bytes (in memory):
    only KVFileError, always with a reason; accepted ones hold the original arrays."""
    rnd = random.Random("kvfile-read")
    w = Writer(tmp_path, torch.bfloat16)
    try:
        sha, *_ = w.checkpoint(rnd, 40, ktm=True)
        orig = open(w.store.entry_path(sha), "rb").read()
    finally:
        w.close()
    ref = kf.read(orig)
    total, reasons, accepted = scale(200, 3000), collections.Counter(), 0
    kinds = KINDS + ("append",)
    for i in range(total):
        kind = kinds[i % len(kinds)]
        region = rnd.choice(list(regions(orig)))
        blob, what = mutate(orig, rnd, kind, region)
        try:
            e = kf.read(blob, expect_geometry=w.disk.geometry, expect_fingerprint=FINGERPRINT)
        except kf.KVFileError as x:
            assert x.reason, what
            reasons[x.reason] += 1
            continue
        except Exception as x:      # noqa: BLE001
            raise AssertionError(f"kvfile.read crashed with {type(x).__name__}: {x} after: {what}") from x
        accepted += 1
        if hashlib.sha1(e.text).hexdigest() == sha:
            assert np.array_equal(e.tokens, ref.tokens) and e.k.tobytes() == ref.k.tobytes(), what
            assert e.v.tobytes() == ref.v.tobytes() and e.logits.tobytes() == ref.logits.tobytes(), what
    Stats.add("fuzz: kvfile.read (in memory)", mutations=total, rejected=sum(reasons.values()), accepted=accepted,
              crashes=0, reasons=dict(reasons))


# ------------------------------------------------------------------ end to end

def corrupt_file(path, how: str) -> None:
    blob = bytearray(path.read_bytes())
    r = regions(bytes(blob))
    if how == "checksum mismatch":
        lo, hi = r["kv rows"]
        blob[(lo + hi) // 2] ^= 0x10
    elif how == "truncated":
        del blob[len(blob) // 2:]
    elif how == "bad magic":
        blob[0:3] = b"KVQ"
    elif how == "token count mismatch":
        blob[kf.OFF_TOKENS] ^= 0x01
    elif how == "text does not match the name":
        lo, hi = r["text"]
        blob[hi - 1] ^= 0x20
    elif how == "fingerprint mismatch":
        lo, _ = r["fingerprint"]
        blob[lo + 3] ^= 0x80
    elif how == "wrong version":
        blob[kf.OFF_VERSION] = 9
    else:
        raise ValueError(how)
    path.write_bytes(bytes(blob))


E2E_CASES = ("checksum mismatch", "truncated", "bad magic", "token count mismatch",
             "text does not match the name", "wrong version")


def test_mutated_checkpoints_end_to_end(healthy):
    c = healthy
    cases = E2E_CASES[:scale(2, len(E2E_CASES))]
    client = c.client()

    def ask(prompt, n=2):
        return client.completions.create(model=c.model, prompt=prompt, max_tokens=n, temperature=0)

    prompts = [unique_prompt("e2e-fuzz", 40 + i, n_words=70) for i in range(len(cases))]
    for p in prompts:
        ask(p)
    ask(unique_prompt("e2e-fuzz-other", 1, n_words=20))       # the live session moves on
    settle(c.kv_dir, c.trace_path)
    targets = []
    for p, how in zip(prompts, cases):
        target = longest_prefix_entry(c.kv_dir, (p + " Again:").encode())
        assert target, f"no checkpoint for {how}"
        corrupt_file(c.kv_dir / f"{target}.kv", how)
        targets.append(target)
    for p, how, target in zip(prompts, cases, targets):
        r = ask(p + " Again:")
        assert r.choices[0].finish_reason in ("stop", "length")
        cached = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
        assert cached == 0, (how, cached)
    settle(c.kv_dir, c.trace_path)
    t = c.trace()
    for how, target in zip(cases, targets):
        assert f"KV cache: rejected sha1={target} (reason: {how}); cold prefill" in t, (how, target)
        assert f"evicted sha1={target} (rejected on restore: {how})" in t, (how, target)
    assert c.all_alive()
    Stats.add("fuzz: mutated real checkpoints end to end", files=len(cases), requests_ok=len(cases),
              rejected_with_reason=len(cases), reasons=list(cases))


@full_only
def test_corrupt_fingerprint_is_rejected_once(healthy):
    """A flipped fingerprint byte reads as corruption (checksum mismatch: deleted), not as a
    foreign model's file that stays and is tried again on every request."""
    c = healthy
    client = c.client()

    def ask(prompt):
        return client.completions.create(model=c.model, prompt=prompt, max_tokens=2, temperature=0)

    prompt = unique_prompt("fp", 77, n_words=70)
    ask(prompt)
    ask(unique_prompt("fp-other", 1, n_words=20))
    settle(c.kv_dir, c.trace_path)
    target = longest_prefix_entry(c.kv_dir, prompt.encode())
    assert target
    path = c.kv_dir / f"{target}.kv"
    corrupt_file(path, "fingerprint mismatch")
    try:
        for i in range(2):
            ask(prompt)
            ask(unique_prompt("fp-other", 2 + i, n_words=20))
            settle(c.kv_dir, c.trace_path)
        n = c.trace().count(f"rejected sha1={target} (reason: ")
        Stats.add("fuzz: fingerprint byte flipped (end to end)", requests=4, rejections_of_same_file=n,
                  file_rewritten_sound=path.exists() and not kf.verify(str(path)))
        # deleted, then written again by the cold prefill of the same prompt: sound
        assert not path.exists() or not kf.verify(str(path))
    finally:
        path.unlink(missing_ok=True)          # not for the directory checks of later tests
    assert n == 1, f"the same corrupt file was tried {n} times"
    assert f"rejected sha1={target} (reason: checksum mismatch)" in c.trace()


# ------------------------------------------------------------------ checkpoints inside a character

JAPANESE = "これは日本語のテストです。今日はとても良い天気ですね。" * 4


def mid_char_checkpoint(t, prompt: str):
    """(ids, k): the prompt's token ids and a checkpoint length k whose text ends inside a
    UTF-8 character (a multiple of 64, where the small cache flags save continued checkpoints)."""
    ids = t.encode(t.bos_text() + prompt.encode())
    for k in range(64, len(ids), 64):
        try:
            t.piece_bytes(ids[:k]).decode()
        except UnicodeDecodeError:
            return ids, k
    pytest.skip("no token boundary inside a character in this prompt")


@pytest.mark.parametrize("path", ["disk suffix", "live suffix"])
def test_suffix_after_a_mid_character_boundary(path):
    """The prompt bytes after a checkpoint (or a live session) that ends inside a UTF-8
    character tokenize, and the ids' pieces are exactly those bytes. (Until commit 04377fa,
    TextModel.encode decoded them with surrogateescape and tokenizers raised TypeError: the
    renderer died in dispatch restoring such a checkpoint; found by the full load test.)"""
    from procs.renderer.prompt import plan_reuse
    from .harness import text_model
    t = text_model()
    ids, k = mid_char_checkpoint(t, JAPANESE)
    prompt = t.bos_text() + JAPANESE.encode()
    text = t.piece_bytes(ids[:k])
    assert prompt.startswith(text)
    if path == "disk suffix":       # procs/renderer/server.py dispatch: suffix of a restored entry
        suffix = t.encode(prompt[len(text):])
        assert t.piece_bytes(ids[:k]) + t.piece_bytes(suffix) == prompt
    else:       # procs/renderer/prompt.py plan_reuse: a live session whose ids are another
        # tokenization of the same bytes (as generated tokens often are), ending inside a character
        single = {p: i for i, p in enumerate(t.pieces) if len(p) == 1}
        last = t.pieces[ids[k - 1]]
        assert len(last) > 1 and all(bytes([b]) in single for b in last)
        live = ids[:k - 1] + [single[bytes([b])] for b in last]
        assert t.piece_bytes(live) == text
        full = t.encode(prompt)
        got, reuse = plan_reuse(t, prompt, full, live, 32)
        assert reuse == len(live) and t.piece_bytes(got) == prompt


@full_only
def test_mid_character_checkpoint_end_to_end(healthy):
    """Restoring a continued checkpoint that ends inside a UTF-8 character: the request is
    served from it and the renderer lives."""
    c = healthy
    from .harness import text_model
    t = text_model()
    ids, k = mid_char_checkpoint(t, JAPANESE)
    text = t.piece_bytes(ids[:k])
    # a prompt that extends the k-token checkpoint's text but none of the longer ones
    chars = len(text.decode(errors="ignore")) - len(t.bos_text().decode())
    other = JAPANESE[:chars + 2] + "それでは、別の話をしましょう。"
    client = c.client(timeout=120)

    def ask(prompt):
        return client.completions.create(model=c.model, prompt=prompt, max_tokens=2, temperature=0)
    try:
        ask(JAPANESE)                                       # checkpoints at 32-multiples (one mid-char)
        ask(unique_prompt("mid-char-other", 1, n_words=20))  # the live session moves on
        settle(c.kv_dir, c.trace_path)
        assert longest_prefix_entry(c.kv_dir, t.bos_text() + other.encode()) == hashlib.sha1(text).hexdigest()
        r = None
        try:
            r = ask(other)
        except Exception as e:      # noqa: BLE001
            r = e
        time.sleep(2)
        alive = c.alive("renderer")
        Stats.add("unicode: restore of a checkpoint ending inside a character", requests=3,
                  result=type(r).__name__, renderer_alive=alive)
        assert alive and not isinstance(r, Exception), r
        assert f"hit for sha1={hashlib.sha1(text).hexdigest()} (loaded {k} tokens)" in c.trace()
    finally:
        if not c.alive("renderer"):
            c.start("renderer")
