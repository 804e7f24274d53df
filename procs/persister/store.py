"""The cache directory: atomic writes, the in-memory index, LRU eviction, hit bumps.

Invariants: only `<40 hex>.kv` names are entries; an entry appears under its final name
only complete (temp name, fsync, rename, directory fsync); the sum of entry sizes stays
within the budget except for an entry that alone exceeds it (docs/kv-format.md section 8).
"""
from __future__ import annotations

import glob
import hashlib
import os
import stat
import time

import msgspec

from common import kvfile, metrics
from common import messages as m
from common.policy import lru_victims
from shm import slots


class StaleSlot(Exception):
    pass


class Store:
    def __init__(self, path: str, budget_mb: int, log, trace):
        self.dir, self.budget = path, budget_mb * 1024 * 1024
        self.log, self.trace = log, trace
        self.warned_budget = self.warned_remove = False
        self.index: dict[str, m.IndexEntry] = {}
        self.version = 0
        self.usable = self._prepare()
        if self.usable:
            self.scan()
            self.evict(keep=set())

    def _prepare(self) -> bool:
        try:
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
            st = os.stat(self.dir)
            if st.st_uid != os.getuid():
                self.log.warning("cache dir %s is owned by uid %d, not us; disk cache off", self.dir, st.st_uid)
                return False
            if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                self.log.warning("cache dir %s is writable by others; disk cache off", self.dir)
                return False
            if stat.S_IMODE(st.st_mode) != 0o700:
                os.chmod(self.dir, 0o700)
            return True
        except OSError as e:
            self.log.warning("cache dir %s unusable (%s); disk cache off", self.dir, e)
            return False

    def entry_path(self, sha1: str) -> str:
        return kvfile.entry_path(self.dir, sha1)

    def scan(self) -> None:
        """Rebuild the index from the directory; remove temp files a crash left behind."""
        for tmp in glob.glob(os.path.join(self.dir, "*.kv.tmp.*")):
            try:
                os.unlink(tmp)
                self.log.info("removed leftover %s", os.path.basename(tmp))
            except OSError:
                pass
        index = {}
        for name in os.listdir(self.dir):
            if not kvfile.is_entry_name(name):
                continue
            path = os.path.join(self.dir, name)
            try:
                meta = kvfile.read_meta(path)
                if meta.sha1 + kvfile.SUFFIX != name:
                    raise kvfile.KVFileError("name mismatch", "text SHA1 differs from the file name")
            except (kvfile.KVFileError, OSError) as e:
                self.log.warning("ignoring unsound entry %s: %s", name, e)
                self.trace.line(f"KV cache: rejected sha1={name[:-3]} (reason: {getattr(e, 'reason', e)})")
                continue
            index[meta.sha1] = self._entry(meta.sha1, meta.header, meta.text_len, meta.size)
        self.index = index
        self.version += 1

    @staticmethod
    def _entry(sha1, h: kvfile.Header, text_len: int, size: int) -> m.IndexEntry:
        return m.IndexEntry(sha1=sha1, text_len=text_len, n_tokens=h.n_tokens, quant_bits=h.quant_bits,
                            ctx_size=h.ctx_size, size=size, last_used=h.last_used, created=h.created)

    def snapshot(self) -> m.IndexSnapshot:
        return m.IndexSnapshot(entries=tuple(self.index.values()), version=self.version)

    def write(self, save: m.SaveCheckpoint, body: memoryview, text: bytes, ktm: dict[str, bytes],
              still_valid=lambda: True) -> str | None:
        """Write one checkpoint from a slot body; returns its sha1, or None if not written.
        still_valid() is asked after the data is on disk and before the rename: False (the
        slot was reused meanwhile) discards the file."""
        if not self.usable:
            return None
        if not os.path.isdir(self.dir):   # deleted while we run: start over, empty
            self.log.warning("cache dir %s vanished; recreating it", self.dir)
            self.usable = self._prepare()
            self.index, self.version = {}, self.version + 1
            if not self.usable:
                return None
        sha1 = hashlib.sha1(text).hexdigest()
        final = self.entry_path(sha1)
        old = self.index.get(sha1)
        if old is not None and old.n_tokens == len(save.tokens) and os.path.exists(final):
            return sha1            # that exact state is already on disk
        n = len(save.tokens)
        g = save.geometry
        logits, k, v = slots.read_body(body, n, g.vocab_size, g.n_layers, g.kv_heads, g.head_dim,
                                       kvfile.KV_NUMPY[g.kv_dtype], g.rows(n) if g.windowed else None,
                                       g.state_bytes)
        size = kvfile.TEXT_OFFSET + len(text) + kvfile.payload_size(n, g)    # KTM aside: small
        if size > self.budget:      # it would be evicted at once (section 8): spare the fsync
            if not self.warned_budget:
                self.warned_budget = True
                self.log.warning("a checkpoint of %.1f MB alone exceeds the disk budget of %.1f MB: nothing "
                                 "can be cached; raise --kv-disk-space-mb", size / 2**20, self.budget / 2**20)
            self.trace.line(f"KV cache: not stored sha1={sha1} ({n} tokens, {size} bytes alone exceed "
                            f"the disk budget of {self.budget} bytes)")
            return None
        parts = kvfile.write_parts(text, save.tokens, logits, k, v, g, save.fingerprint,
                                   save.quant_bits, save.reason, ktm=ktm or None,
                                   state=body[len(body) - g.state_bytes:] if g.state_bytes else None)
        tmp = f"{final}.tmp.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            try:
                for part in parts:
                    view = memoryview(part)
                    while view:
                        view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            if not still_valid():
                raise StaleSlot("the slot was reused while it was being written")
            os.replace(tmp, final)
            dfd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        h = kvfile.parse_header(open(final, "rb").read(kvfile.HEADER_SIZE))
        self.index[sha1] = self._entry(sha1, h, len(text), os.path.getsize(final))
        self.version += 1
        self.evict(keep={sha1})
        return sha1

    def evict(self, keep: set[str]) -> list[str]:
        rows = [(e.sha1, e.size, e.last_used, e.created) for e in self.index.values()]
        victims = lru_victims(rows, self.budget, keep=frozenset(keep))
        for sha1 in victims:
            self.remove(sha1, "lru, over the disk budget")
        return victims

    def remove(self, sha1: str, why: str) -> None:
        if self.index.pop(sha1, None) is not None:
            self.version += 1
        try:
            os.unlink(self.entry_path(sha1))
        except FileNotFoundError:
            pass
        except OSError as e:    # read-only dir: out of the index, so never a candidate again
            if not self.warned_remove:
                self.warned_remove = True
                self.log.warning("could not delete %s (%s); it is dropped from the index "
                                 "(further failures are traced only)", sha1, e)
            self.trace.line(f"KV cache: could not evict sha1={sha1} ({why}): {e}")
            return
        self.trace.line(f"KV cache: evicted sha1={sha1} ({why})")
        metrics.M.evictions.labels("rejected" if why.startswith("rejected") else "lru").inc()
        self.log.info("removed %s (%s)", sha1, why)

    def read_ktm(self, sha1: str, max_ids: int) -> dict[str, bytes]:
        try:
            return kvfile.read_ktm(self.entry_path(sha1), max_ids)
        except (OSError, kvfile.KVFileError):
            return {}

    def bump(self, sha1: str) -> None:
        if sha1 not in self.index:
            return
        try:
            kvfile.bump_hits(self.entry_path(sha1), int(time.time()))
        except (OSError, kvfile.KVFileError) as e:
            self.log.warning("could not bump hits of %s: %s", sha1, e)
            return
        self.index[sha1] = msgspec.structs.replace(self.index[sha1], last_used=int(time.time()))
        self.version += 1
