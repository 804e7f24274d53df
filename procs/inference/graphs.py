"""Decode steps on CUDA replayed from captured graphs, over a pool of K/V slots.

A decode step of a small model is hundreds of small kernels, and on CUDA the host's cost of
launching them one by one is the step: SmolLM2-135M on an H200, ~545 launches and ~9 ms of
host time against ~1 ms of GPU time (bench/RESULTS-cuda.md). A graph launches them all at
once. But a graph bakes in the addresses it reads, and each session's K/V is its own
tensor: a graph per set of sessions was captured anew at every change of the batch (a turn
starting or ending), ~2 eager steps each, and attention ran per sequence. So the step runs
over a pool instead: K/V [layers, slots, KV heads, capacity, D], the batch's sessions in
slots 0..B-1. One graph per (B, attended capacity) serves every batch of that shape, and
attention is one masked product for the whole batch.

Invariants:
- A session's own tensors stay the truth: before a step its rows are copied into its slot
  unless the slot already holds them (same session, version, cuts and length), and after
  the step the row it wrote is copied back.
- Every row of a slot is finite: the step reads every row below the attended capacity,
  masked, and 0 x NaN would poison the sum. A fresh pool is zeros; a copy-in zeroes the rows
  past the session's length and those below a restored windowed layer's floor (never
  written in the session's own tensor).
- A graph runs only on the pool it was captured on: growing the pool drops every graph.
- Outputs are copied before the next replay may overwrite them.
"""
from __future__ import annotations

import collections
import logging
import weakref

import torch

from procs.inference.linear import dense
from procs.inference.torch_attention import causal_mask

log = logging.getLogger("inference")

# graphs kept, least recently used dropped first; each holds only its activations (their
# memory pool is shared by all), and there is one per batch size and capacity bucket
MAX_GRAPHS = 32
MIN_CAP = 512           # the smallest attended capacity; buckets double from it


def bucket(n: int, limit: int) -> int:
    """The attended capacity for positions < n: a power of two times MIN_CAP, at most limit,
    so a growing conversation changes graphs O(log n) times."""
    cap = MIN_CAP
    while cap < n:
        cap *= 2
    return min(cap, max(limit, n))


@torch.inference_mode()
def static_step(model, ids: torch.Tensor, pos: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
                cap: int) -> torch.Tensor:
    """Llama.decode_batch's step with every shape fixed, as a CUDA graph needs: ids and pos
    are device tensors [B], sequence b's K/V is slot b of pool_k/pool_v [L, S, KV, C, D]
    (B <= S, max(pos) < cap <= C). K/V rows are written at pos[b] by index; attention is one
    masked grouped-heads product over rows < cap for all B sequences (SDPA with a mask and
    grouped heads falls back to its math path, which copies K/V per query head). Every row
    there must be finite (see the module's invariants). The caller fills the rotary tables
    up to max(pos) first. Returns float32 logits [B, V]."""
    c = model.cfg
    H, D = c.n_heads, c.head_dim
    L, S, KV, C, _ = pool_k.shape
    B = ids.shape[0]
    dev = ids.device
    x = model.embed_rows(ids)                                                  # [B, dim]
    if c.embed_scale:
        x = x * c.embed_scale
    ropes = [(cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)) for cos, sin in model.rope]
    # row (slot b, head h, position pos[b]) of one layer's [S * KV * C, D]
    at = ((torch.arange(B, device=dev).unsqueeze(1) * KV + torch.arange(KV, device=dev)) * C
          + pos.unsqueeze(1)).view(-1)
    kpos = torch.arange(cap, device=dev)
    masks = {}     # window -> float32 [B, 1, 1, cap]

    def attend(li: int, ly, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kl, vl = pool_k[li], pool_v[li]                                        # [S, KV, C, D]
        kl.view(-1, D).index_copy_(0, at, k.reshape(B * KV, D))
        vl.view(-1, D).index_copy_(0, at, v.reshape(B * KV, D))
        if ly.window not in masks:
            masks[ly.window] = causal_mask(pos.unsqueeze(1), kpos, ly.window, torch.float32).view(B, 1, 1, cap)
        s = torch.matmul(q.reshape(B, KV, H // KV, D), kl[:B, :, :cap].transpose(-1, -2)).float() * model.scale
        p = torch.softmax(s + masks[ly.window], dim=-1).to(vl.dtype)          # [B, KV, G, cap]
        return torch.matmul(p, vl[:B, :, :cap]).reshape(B, H * D)
    x = model._blocks(x, ropes, lambda f, h: f(h), dense, attend)
    return model._head(x, None, 0)


class _Held:
    """What a slot holds: a session's rows as of (version, cuts, length)."""

    def __init__(self, sess, length: int):
        self.ref, self.version, self.cuts, self.length = weakref.ref(sess), sess.version, len(sess.cuts), length

    def holds(self, sess) -> bool:
        return (self.ref() is sess and self.version == sess.version and self.cuts == len(sess.cuts)
                and self.length == len(sess))


class _Graph:
    def __init__(self, io: torch.Tensor, graph, out: torch.Tensor):
        self.io, self.graph, self.out = io, graph, out


class GraphDecoder:
    """static_step over a pool of slots, captured per (batch size, capacity) and replayed.
    capture=False runs the same step eagerly (the CPU's tests of the pool's bookkeeping)."""

    def __init__(self, model, max_graphs: int = MAX_GRAPHS, capture: bool = True):
        self.model, self.max_graphs, self.capture_graphs = model, max_graphs, capture
        self.graphs: collections.OrderedDict[tuple[int, int], _Graph] = collections.OrderedDict()
        self.pool_k = self.pool_v = None     # [L, S, KV, C, D]
        self.held: list[_Held | None] = []   # per slot
        self.mempool = None                  # the graphs' memory, made at the first capture
        self.captures = 0
        self.copies = 0                      # sessions copied into a slot

    @staticmethod
    def takes(model) -> bool:
        """CUDA, and no step that decides on the host (a mixture of experts picks its experts
        from the router's values)."""
        return model.device.type == "cuda" and not model.cfg.n_experts

    @property
    def nbytes(self) -> int:
        return 0 if self.pool_k is None else 2 * self.pool_k.numel() * self.pool_k.element_size()

    def __call__(self, sessions: list, tokens: list[int]) -> torch.Tensor | None:
        """float32 logits [B, V] of one decode step: tokens[b] appended to sessions[b] (each
        with room for it), its K/V row written into the session; the caller appends the token.
        None when this step is the eager ops' (out of memory)."""
        B = len(sessions)
        pos = [len(s) for s in sessions]
        cap = bucket(max(pos) + 1, self.model.max_context)
        try:
            self._room(B, cap)
        except torch.OutOfMemoryError:
            log.warning("no memory for a K/V pool of %d slots x %d rows: this step eager", B, cap)
            self._drop()
            return None
        slot = self._place(sessions)
        order = sorted(range(B), key=lambda b: slot[b])          # slot i holds sessions[order[i]]
        self.model.ensure_rope(max(pos) + 1)
        host = torch.tensor([[tokens[b] for b in order], [pos[b] for b in order]], dtype=torch.long)
        out = self._step(host, cap)
        if out is None:
            return None
        dst, src = [], []                  # the written rows back into the sessions' own tensors
        for i, b in enumerate(order):
            s, p = sessions[b], pos[b]
            dst += [s.k[:, :, p], s.v[:, :, p]]
            src += [self.pool_k[:, i, :, p], self.pool_v[:, i, :, p]]
            self.held[i] = _Held(s, p + 1)
        torch._foreach_copy_(dst, src)
        if order == list(range(B)):
            return out
        back = [0] * B
        for i, b in enumerate(order):
            back[b] = i
        return out[back]

    def _forget(self) -> None:
        """Every graph dropped, and their memory pool with them: a pool whose graphs are all
        gone is released, and capturing into its handle again fails an allocator assert."""
        self.graphs.clear()
        self.mempool = None

    def _drop(self) -> None:
        self._forget()
        self.pool_k = self.pool_v = None
        self.held = []

    def _room(self, B: int, cap: int) -> None:
        """A pool of at least B slots of cap rows; a new one drops every graph (their addresses)."""
        if self.pool_k is not None and self.pool_k.shape[1] >= B and self.pool_k.shape[3] >= cap:
            return
        c, m = self.model.cfg, self.model
        S = max(B, 0 if self.pool_k is None else self.pool_k.shape[1])
        C = max(cap, 0 if self.pool_k is None else self.pool_k.shape[3])
        self._drop()
        shape = (c.n_layers, S, c.n_kv_heads, C, c.head_dim)
        self.pool_k = torch.zeros(shape, dtype=m.dtype, device=m.device)
        self.pool_v = torch.zeros(shape, dtype=m.dtype, device=m.device)
        self.held = [None] * S
        log.info("decode K/V pool: %d slots x %d rows, %.0f MiB", S, C, self.nbytes / 2**20)

    def _place(self, sessions: list) -> list[int]:
        """A slot in 0..B-1 for each session: the one that holds it already where there is
        one, else a free one, its rows copied in (and the rows past them zeroed)."""
        B = len(sessions)
        slot = [-1] * B
        free = set(range(B))
        for b, s in enumerate(sessions):
            for i in free:
                if self.held[i] is not None and self.held[i].holds(s):
                    slot[b] = i
                    free.discard(i)
                    break
        for b, s in enumerate(sessions):
            if slot[b] < 0:
                i = slot[b] = min(free)
                free.discard(i)
                n = len(s)
                for pool, own in ((self.pool_k, s.k), (self.pool_v, s.v)):
                    pool[:, i, :, :n] = own[:, :, :n]
                    pool[:, i, :, n:].zero_()
                    for li, floor in enumerate(s.floors):   # a restored windowed layer's
                        if floor:                            # rows below it are nobody's
                            pool[li, i, :, :floor].zero_()
                self.held[i] = _Held(s, n)
                self.copies += 1
        return slot

    def _step(self, host: torch.Tensor, cap: int) -> torch.Tensor | None:
        B = host.shape[1]
        if not self.capture_graphs:
            io = host.to(self.model.device)
            return static_step(self.model, io[0], io[1], self.pool_k, self.pool_v, cap)
        key = (B, cap)
        g = self.graphs.get(key)
        if g is None:
            try:
                g = self.capture(host, cap)
            except torch.OutOfMemoryError:   # this step eagerly, and the other graphs' memory freed
                log.warning("CUDA graph capture out of memory: %d graphs dropped, this step eager",
                            len(self.graphs))
                self._forget()
                return None
            except RuntimeError as e:   # an op that cannot be captured: torch's eager ops from now on
                log.warning("CUDA graphs off: capture failed (%s); decode launches op by op", e)
                self.model.graphs = None
                return None
            self.graphs[key] = g
            while len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
        g.io.copy_(host)
        g.graph.replay()
        return g.out.clone()

    def capture(self, host: torch.Tensor, cap: int) -> _Graph:
        io = host.to(self.model.device)
        # a first run outside the graph, on a side stream, as capture requires (workspaces,
        # lazy inits); it writes the rows the replay then writes again with the same values
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            static_step(self.model, io[0], io[1], self.pool_k, self.pool_v, cap)
        torch.cuda.current_stream().wait_stream(side)
        if self.mempool is None:
            self.mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool, capture_error_mode="thread_local"):
            out = static_step(self.model, io[0], io[1], self.pool_k, self.pool_v, cap)
        self.captures += 1
        return _Graph(io, graph, out)
