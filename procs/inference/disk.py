"""Inference's side of the disk cache: handing checkpoints to the persister through
shared-memory slots, and restoring a checkpoint file (read only) into the live session.

Saving copies rows into a free slot and returns; only when every slot is busy does it
wait for the persister to free one. A restore validates the whole file (magic, versions,
geometry, fingerprint, token count, checksum, SHA1 of the text = name) before touching
the session; any failure leaves the session empty and says why.
"""
from __future__ import annotations

import hashlib
import re
import time
import warnings

import numpy as np
import torch

from common import kvfile
from common import messages as m
from procs.inference.gdn import state_values
from procs.inference.kvsession import KVSession
from shm.slots import SEQ_BYTES, SlotPool, body_bytes

KV_DTYPES = {torch.float32: kvfile.KV_F32, torch.bfloat16: kvfile.KV_BF16, torch.float16: kvfile.KV_F16}
_SHA1 = re.compile(r"[0-9a-f]{40}")
SLOT_WAIT_S = 3.0   # longest stall for a free slot; after one such timeout, skip until one frees


class RestoreError(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Disk:
    def __init__(self, s, model, n_ctx: int, run_dir: str, send, wait_for_message, log):
        self.s, self.model, self.n_ctx, self.log = s, model, n_ctx, log
        self.send, self.wait = send, wait_for_message
        c = model.cfg
        self.kv_dtype = KV_DTYPES[model.dtype]
        es = torch.empty((), dtype=model.dtype).element_size()
        windows = tuple(c.windows) if any(c.windows) else ()   # all global: a dense model (v1)
        state = dict(zip(("state_layers", "conv_values", "ssm_values"), (sum(c.linear_layers), *state_values(c)))) \
            if c.linear_layers else {}
        self.geometry = kvfile.Geometry(ctx_size=n_ctx, chunk_size=s.chunk_size, kv_capacity=n_ctx,
                                        sliding_window=max(windows, default=0), windows=windows,
                                        n_layers=c.kv_layers, kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                                        vocab_size=c.vocab_size, kv_dtype=self.kv_dtype, **state)
        self.pool = None
        self.handed: dict[int, m.SaveCheckpoint] = {}   # busy slot -> the save it carries
        self.stuck = False       # the persister freed nothing within SLOT_WAIT_S: it may be down
        self.seq = int(time.time() * 1000)   # save sequence numbers, unique across restarts
        self.last_restore_bytes = 0
        if s.kv_disk_dir:
            # per-layer rows only grow with n, so a body of n_ctx tokens is the largest
            cap = body_bytes(n_ctx, c.vocab_size, c.kv_layers, c.n_kv_heads, c.head_dim, es,
                             self.geometry.rows(n_ctx), self.geometry.state_bytes) + SEQ_BYTES
            self.pool = SlotPool(run_dir, 2, cap)

    @property
    def enabled(self) -> bool:
        return self.pool is not None

    def close(self, timeout: float = 3.0) -> None:
        if self.pool is None:
            return
        end = time.monotonic() + timeout
        while self.pool.busy and time.monotonic() < end:   # the persister is still reading
            self.wait(0.05)
        self.pool.close()

    def slot_freed(self, i: int, seq: int) -> None:
        if self.pool:
            self.pool.release(i, seq)
            if i not in self.pool.busy:
                self.handed.pop(i, None)
            self.stuck = False

    def persister_hello(self) -> None:
        """A persister (re)started: every busy slot's save goes to it again. Freeing them
        instead lost saves: the hello of a persister that started first can arrive after
        inference handed it a slot (ZeroMQ connects it once inference binds), and the slot,
        freed and reused, was dropped mid-write. The persister skips a save it already did
        (slot and seq) and frees it again; one it never got, or lost in a crash, it writes."""
        if not self.pool:
            return
        for i, seq in list(self.pool.busy.items()):
            msg = self.handed.get(i)
            if msg is not None and msg.seq == seq:
                self.send(msg)
            else:
                self.pool.release(i, seq)
        self.stuck = False

    # -- saving --
    def save(self, sess: KVSession, n: int, logits: torch.Tensor | None, reason: int) -> bool:
        if self.pool is None or logits is None or n <= 0 or n > len(sess):
            return False
        if not sess.can_export(n):   # restored windowed rows start after what n needs
            self.log.info("no checkpoint at %d: the session lacks the window rows before it" if sess.state is None
                          else "no checkpoint at %d: no recurrent state kept there", n)
            return False
        i = self.pool.free_slot()
        end = time.monotonic() + (0 if self.stuck else SLOT_WAIT_S)
        while i is None and time.monotonic() < end:
            self.wait(0.05)      # handles SlotFreed messages
            i = self.pool.free_slot()
        if i is None:
            if not self.stuck:
                self.log.warning("no free slot after %.0f s (persister down?); checkpoints are "
                                 "dropped until it frees one", SLOT_WAIT_S)
            self.stuck = True
            return False
        self.seq += 1
        g, c = self.geometry, self.model.cfg
        st = sess.state_at(n) if sess.state is not None else None
        nbytes = self.pool.write(i, sess.tokens, logits, sess.k, sess.v, n, self.seq,
                                 g.rows(n) if g.windowed else None, None if st is None else (st.conv, st.ssm))
        msg = self.handed[i] = m.SaveCheckpoint(slot=i, seq=self.seq, slot_path=self.pool.paths[i], nbytes=nbytes,
                                                tokens=tuple(sess.tokens[:n]), reason=reason, geometry=g,
                                                quant_bits=c.quant_bits, fingerprint=self.model.fingerprint)
        self.send(msg)
        return True

    # -- restoring --
    def restore(self, sess: KVSession, sha1: str) -> int:
        """Load checkpoint sha1 into sess (emptied first). Returns its token count."""
        sess.truncate(0)
        if not self.s.kv_disk_dir or not _SHA1.fullmatch(sha1):
            raise RestoreError("no cache directory" if not self.s.kv_disk_dir else "bad sha1")
        path = kvfile.entry_path(self.s.kv_disk_dir, sha1)
        try:
            e = kvfile.read(path, expect_geometry=self.geometry, expect_fingerprint=self.model.fingerprint)
        except FileNotFoundError:
            raise RestoreError("file gone") from None
        except kvfile.KVFileError as err:
            raise RestoreError(err.reason) from None
        except OSError as err:
            raise RestoreError(f"unreadable: {err.strerror}") from None
        if hashlib.sha1(e.text).hexdigest() != sha1:
            raise RestoreError("text does not match the name")
        if self.s.kv_cache_reject_different_quant and e.header.quant_bits != self.model.cfg.quant_bits:
            raise RestoreError("different quantization")
        torch_dtype = self.model.dtype

        def tensor(a):
            """[layers, n, KV, D] (version 1) or a list of [rows, KV, D] (version 2): strided
            views of the checked mmap, never written; import_ copies them into the session
            once (a contiguous copy first doubled restore time)."""
            if isinstance(a, list):
                return [tensor(x) for x in a]
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                t = torch.from_numpy(a)
            return t.view(torch_dtype) if torch_dtype == torch.bfloat16 else t
        tokens = [int(t) for t in e.tokens]
        if any(t >= self.model.cfg.vocab_size for t in tokens):
            raise RestoreError("token id out of range")
        state = None if e.conv is None else (tensor(e.conv), torch.from_numpy(np.array(e.ssm)))
        sess.import_(tokens, torch.from_numpy(np.array(e.logits)), tensor(e.k), tensor(e.v), state)
        kv_bytes = sum(a.nbytes for a in [*e.k, *e.v]) + (0 if e.conv is None else e.conv.nbytes + e.ssm.nbytes)
        self.last_restore_bytes = kv_bytes + e.logits.nbytes + e.tokens.nbytes + len(e.text)
        return len(tokens)
