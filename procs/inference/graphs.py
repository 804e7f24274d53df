"""Decode steps and short prefills on CUDA, replayed from captured graphs over pools of K/V slots.

A step of a small model is hundreds of small kernels, and on CUDA the host's cost of
launching them one by one is the step: SmolLM2-135M on an H200, ~545 launches and ~9 ms of
host time against ~1 ms of GPU time (bench/RESULTS-cuda.md). A graph launches them all at
once. But a graph bakes in the addresses it reads, and each session's K/V is its own
tensor. So the steps run over pools instead: K/V [layers, slots, KV heads, capacity, D].
A decode step holds its batch's sessions in slots 0..B-1 of the decode pool; a prefill
chunk its session in the prefill pool's one slot, its tokens padded to a bucket. One graph
per (kind, batch size or padded length, attended capacity) serves every step of that shape,
and attention is one masked product for all its rows. The server captures them ahead (warm).

Invariants:
- A session's own tensors stay the truth: before a step its rows are copied into its slot
  unless the slot already holds them (same session, version, cuts and length), and after
  the step the rows it wrote are copied back.
- Every row of a slot is finite: a step reads every row below the attended capacity,
  masked, and 0 x NaN would poison the sum. A fresh pool is zeros; a copy-in zeroes the rows
  past the session's length and those below a restored windowed layer's floor (never
  written in the session's own tensor); a padded prefill writes rows past its real tokens
  from real activations (finite), which no real query sees and later steps overwrite.
- A graph runs only on the pool it was captured on: growing a pool drops its graphs.
- Outputs are copied before the next replay may overwrite them.
"""
from __future__ import annotations

import collections
import logging

import torch

from common import metrics
from procs.inference.graph_step import MIN_CAP, MIN_ROWS, bucket, buckets, static_step
from procs.inference.pools import Pool
from procs.inference.torch_attention import time_attention

log = logging.getLogger("inference")

# graphs kept, least recently used dropped first; each holds only its activations (their
# memory pool is shared by all): one per kind, batch size or padded length, and capacity.
# warm() captures up to MAX_GRAPHS - SPARE_GRAPHS at start; the rest are for shared prefills
MAX_GRAPHS = 128
SPARE_GRAPHS = 32
# a prefill graph's largest tensor of one layer's attention at most this (the product's f32
# scores, the fused kernel's mask); longer chunks at that capacity run eagerly
SCORES_MAX = 256 << 20


class _Graph:
    def __init__(self, io: torch.Tensor, graph, out: torch.Tensor):
        self.io, self.graph, self.out = io, graph, out


class GraphDecoder:
    """static_step over pools of slots, captured per shape and replayed: decode steps of a
    batch (__call__) and prefill chunks of one session (prefill). capture=False runs the
    same steps eagerly (the CPU's tests of the pools' bookkeeping)."""

    def __init__(self, model, max_graphs: int = MAX_GRAPHS, capture: bool = True):
        self.model, self.max_graphs, self.capture_graphs = model, max_graphs, capture
        self.graphs: collections.OrderedDict[tuple, _Graph] = collections.OrderedDict()
        self.pools = {"decode": Pool("decode"), "prefill": Pool("prefill")}
        self.mempool = None                  # the graphs' memory, made at the first capture
        self.wanted: dict[tuple, None] = {}  # shared prefill steps to capture when idle
        self.captures = 0
        # per kind of step: attention by torch's fused kernel, where choose_attention found it faster
        self.fused = {"decode": False, "prefill": False}
        self.attention_ms: dict[str, tuple] = {}   # kind -> (shape, product ms, fused ms or None)

    @staticmethod
    def takes(model) -> bool:
        """CUDA, and no step that decides on the host (a mixture of experts picks its experts
        from the router's values; a linear-attention layer's state is not in the graphs' pools)."""
        return model.device.type == "cuda" and not model.cfg.n_experts and not model.cfg.linear_layers

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pools.values())

    @property
    def copies(self) -> int:
        return sum(p.copies for p in self.pools.values())

    @torch.inference_mode()
    def __call__(self, sessions: list, tokens: list[int]) -> torch.Tensor | None:
        """float32 logits [B, V] of one decode step: tokens[b] appended to sessions[b] (each
        with room for it), its K/V row written into the session; the caller appends the token.
        None when this step is the eager ops' (out of memory)."""
        B = len(sessions)
        pos = [len(s) for s in sessions]
        cap = bucket(max(pos) + 1, self.model.max_context)
        pool = self._pool("decode", B, cap)
        if pool is None:
            return None
        slot = pool.place(sessions)
        order = sorted(range(B), key=lambda b: slot[b])          # slot i holds sessions[order[i]]
        host = torch.tensor([[tokens[b] for b in order], [pos[b] for b in order]], dtype=torch.long)
        out = self._run(("decode", B, cap), host, (B, 1), cap, pool, head=True)
        if out is None:
            return None
        pool.copy_back(sessions, order, [(p, p + 1) for p in pos])
        if order == list(range(B)):
            return out
        back = [0] * B
        for i, b in enumerate(order):
            back[b] = i
        return out[back]

    def prefill(self, sess, ids: list[int], rows: list[int]) -> torch.Tensor | None:
        """prefill_many of one session."""
        out = self.prefill_many([sess], [ids], [rows])
        return None if out is None else out[0]

    @torch.inference_mode()
    def prefill_many(self, sessions: list, chunks: list[list[int]], rows: list[list[int]]) -> list | None:
        """Each chunks[b] appended to sessions[b] (distinct, each with room) in one step, all
        padded to one bucket, each in its slot of the prefill pool; their K/V rows written into
        the sessions (the caller appends the tokens). Returns per session the float32 logits
        [len(rows[b]), V] at rows[b] (indices into chunks[b]); None where the step runs
        eagerly: too long for a graph's scores, padding past the context, out of memory; and
        None for several sessions whose step has no graph yet: it is captured when the loop
        is idle (capture_wanted), not on the path of the prompts that wait (the caller
        prefills them one by one through the single-prompt graphs warm() made)."""
        m, B = self.model, len(sessions)
        los = [len(s) for s in sessions]
        Tb = bucket(max(len(c) for c in chunks), max(s.chunk for s in sessions), MIN_ROWS)
        cap = bucket(max(los) + Tb, m.max_context)
        if B > 1:       # a captured graph of a larger capacity serves too (its extra keys masked)
            cap = next((c for c in buckets(m.max_context, MIN_CAP)
                        if c >= cap and ("prefill", B, Tb, c) in self.graphs), cap)
        if max(los) + Tb > m.max_context or not self.fits_scores(B, Tb, cap):
            return None
        key = ("prefill", B, Tb, cap)
        if B > 1 and self.capture_graphs and key not in self.graphs:
            self.wanted[key] = None
            return None
        pool = self._pool("prefill", B, cap)
        if pool is None:
            return None
        slot = pool.place(sessions)
        order = sorted(range(B), key=lambda b: slot[b])          # slot i holds sessions[order[i]]
        ids, pos = [], []
        for b in order:
            ids += chunks[b] + [0] * (Tb - len(chunks[b]))
            pos += range(los[b], los[b] + Tb)
        x = self._run(key, torch.tensor([ids, pos], dtype=torch.long), (B, Tb), cap, pool, head=False)
        if x is None:
            return None
        pool.copy_back(sessions, order, [(lo, lo + len(c)) for lo, c in zip(los, chunks)])
        logits = m._head(x, [i * Tb + r for i, b in enumerate(order) for r in rows[b]], 0)
        out, k = [None] * B, 0
        for b in order:                    # the rows came in slot order
            out[b] = logits[k:k + len(rows[b])]
            k += len(rows[b])
        return out

    @torch.inference_mode()
    def warm(self, batch: int, chunk: int) -> int:
        """Before any request: both pools sized for `batch` slots of the whole context, and a
        graph captured for every decode batch size up to `batch` and every padded length of
        one prompt's chunk, at every capacity bucket (the smallest first, while they fit in
        MAX_GRAPHS - SPARE_GRAPHS), so that a request's step pays neither a capture (tens of
        ms) nor a pool's growth (which drops every graph of its kind); then the shared prefill
        steps of 2..batch prompts at each padded length, at the largest capacity whose scores
        fit (prefill_many uses them at any smaller one); other shared steps are captured when
        first needed, at an idle moment. The steps write rows into the
        slots (finite ones, from real activations); no slot holds a session after it.
        On CUDA, each kind's attention is chosen first (choose_attention). Returns the graphs
        made (with capture=False, the steps run)."""
        m, c = self.model, self.model.cfg
        if m.device.type == "cuda":
            try:
                self.choose_attention(batch, chunk)
            except Exception as e:     # (out of memory): the product, as before
                log.warning("graphs' attention not timed (%s): the product", e)
                self.fused = {"decode": False, "prefill": False}
                for kind in self.fused:
                    metrics.M.graph_fused.labels(kind).set(0)
            finally:                   # the timings' tensors back to the device before the pools
                torch.cuda.empty_cache()
        caps = buckets(m.max_context, MIN_CAP)
        need = 2 * 2 * batch * caps[-1] * c.n_layers * c.n_kv_heads * c.head_dim * m.norm.element_size()
        if m.device.type == "cuda" and need > torch.cuda.mem_get_info(m.device)[0] // 4:
            log.info("graphs not captured ahead: two K/V pools of %d slots x %d rows (%.0f MiB) would take "
                     "over a quarter of the free device memory", batch, caps[-1], need / 2**20)
            return 0
        for kind in ("decode", "prefill"):
            if self._pool(kind, batch, caps[-1]) is None:
                return 0
        made, room = 0, self.max_graphs - SPARE_GRAPHS
        for cap in caps:
            steps = [("decode", B, 1) for B in range(1, batch + 1)]
            steps += [("prefill", 1, T) for T in buckets(max(chunk, MIN_ROWS), MIN_ROWS)
                      if T <= cap and self.fits_scores(1, T, cap)]
            if made + len(steps) > room:
                break
            for kind, B, T in steps:
                key = ("decode", B, cap) if kind == "decode" else ("prefill", 1, T, cap)
                if kind == "prefill" and not self.fits_scores(1, T, cap):
                    continue            # a failed fused capture left the product, which this outgrows
                if self._blank(key, B, T, cap) is None:
                    if self.model.graphs is self and key[0] == "prefill" and not self.fits_scores(1, T, cap):
                        continue        # (this step was the one whose fused capture failed)
                    return made         # out of memory, or graphs turned off
                made += 1
        # shared steps of 2..batch prompts, each at the largest capacity its scores fit: a burst
        # of turns (agents' sub-agents, conversations decoding in step) shares one step at once
        for B in range(2, batch + 1):
            for T in buckets(max(chunk, MIN_ROWS), MIN_ROWS):
                cap = max((x for x in caps if T <= x and self.fits_scores(B, T, x)), default=0)
                if made >= room:
                    return made
                if not cap:
                    continue
                key = ("prefill", B, T, cap)
                if self._blank(key, B, T, cap) is None:
                    if not self.fits_scores(B, T, cap):
                        continue        # its fused capture failed; the product's scores outgrow it
                    return made
                made += 1
        return made

    def fits_scores(self, B: int, T: int, cap: int, fused: bool | None = None) -> bool:
        """Whether a prefill step's attention (fused: as chosen) keeps its largest tensor of a
        layer within SCORES_MAX: the product's f32 scores [B, H, T, cap], or the fused
        kernel's mask [B, G*T, cap] in the compute dtype (an H/KV-th of it, halved)."""
        c = self.model.cfg
        if self.fused["prefill"] if fused is None else fused:
            return B * (c.n_heads // c.n_kv_heads) * T * cap * self.model.norm.element_size() <= SCORES_MAX
        return B * c.n_heads * T * cap * 4 <= SCORES_MAX

    def choose_attention(self, batch: int, chunk: int) -> dict[str, bool]:
        """For each kind of step, the faster of grouped_attention's two ways, timed at the
        kind's largest graph: a decode step of `batch` sequences at the whole context, one
        prompt's longest padded chunk at the largest capacity its graph takes. The product
        writes f32 scores the size of rows x keys (at 512 x 8k, 150 MB a layer); the fused
        kernel keeps them on chip but may not take the shape (a head width it lacks) or may
        lose on a few rows (decode). Returns self.fused."""
        m, c = self.model, self.model.cfg
        caps = buckets(m.max_context, MIN_CAP)
        T = bucket(max(chunk, MIN_ROWS), max(chunk, MIN_ROWS), MIN_ROWS)
        pcap = max((x for x in caps if T <= x and self.fits_scores(1, T, x, fused=False)), default=0)
        for kind, (B, T, S) in {"decode": (batch, 1, caps[-1]), "prefill": (1, T, pcap)}.items():
            if not S:
                continue
            args = (B, c.n_kv_heads, c.n_heads // c.n_kv_heads, T, S, c.head_dim, m.dtype, m.device)
            product = time_attention(False, *args)
            try:
                fused = time_attention(True, *args)
            except Exception as e:     # "No available kernel" (RuntimeError), or anything it raises
                log.info("graphs' %s attention: the fused kernel does not take %s (%s)", kind, args[:6], e)
                fused = None
            self.fused[kind] = fused is not None and fused < product
            metrics.M.graph_fused.labels(kind).set(int(self.fused[kind]))
            self.attention_ms[kind] = ((B, T, S), product, fused)
            log.info("graphs' %s attention, %d x %d rows at %d keys: product %.2f ms, fused %s: %s", kind, B, T, S,
                     product, "-" if fused is None else f"{fused:.2f} ms", "fused" if self.fused[kind] else "product")
        return self.fused

    def capture_wanted(self) -> bool:
        """Capture one shared prefill step that was wanted (the loop calls it while no job
        runs or waits). Returns whether one was captured."""
        while self.wanted:
            key = next(iter(self.wanted))
            del self.wanted[key]
            _, B, T, cap = key
            if key in self.graphs or not self.pools["prefill"].fits(B, cap):   # no growth here
                continue
            if not self.fits_scores(B, T, cap):   # wanted while fused, the product's since
                continue
            return self._blank(key, B, T, cap) is not None
        return False

    def _blank(self, key: tuple, B: int, T: int, cap: int) -> torch.Tensor | None:
        """Step `key` (capturing it) on token 0 at the last T positions below cap, in slots
        0..B-1 of its pool, which then hold no session (their rows are finite, from real
        activations)."""
        pool = self.pools[key[0]]
        host = torch.tensor([[0] * (B * T), [cap - T + t for _ in range(B) for t in range(T)]], dtype=torch.long)
        out = self._run(key, host, (B, T), cap, pool, head=key[0] == "decode")
        pool.held[:B] = [None] * B
        return out

    def _pool(self, kind: str, S: int, cap: int) -> Pool | None:
        pool = self.pools[kind]
        if pool.fits(S, cap):
            return pool
        self._forget(kind)
        try:
            pool.grow(self.model, S, cap)
        except torch.OutOfMemoryError:
            log.warning("no memory for a %s K/V pool of %d slots x %d rows: this step eager", kind, S, cap)
            pool.drop()
            return None
        return pool

    def _forget(self, kind: str | None = None) -> None:
        """The graphs of one kind (None: all) dropped, and their memory pool with them when
        none is left: a pool whose graphs are all gone is released, and capturing into its
        handle again fails an allocator assert."""
        for key in [k for k in self.graphs if kind is None or k[0] == kind]:
            del self.graphs[key]
        if not self.graphs:
            self.mempool = None

    def _run(self, key: tuple, host: torch.Tensor, shape: tuple[int, int], cap: int, pool: Pool,
             head: bool) -> torch.Tensor | None:
        self.model.ensure_rope(int(host[1].max()) + 1)
        if not self.capture_graphs:
            io = host.to(self.model.device)
            return self._step(io, shape, cap, pool, head)
        g = self.graphs.get(key)
        if g is None:
            try:
                g = self.capture(host, shape, cap, pool, head)
            except torch.OutOfMemoryError:   # this step eagerly, and the other graphs' memory freed
                log.warning("CUDA graph capture out of memory: %d graphs dropped, this step eager",
                            len(self.graphs))
                self._forget()
                return None
            except RuntimeError as e:   # an op that cannot be captured: torch's eager ops from now on
                if self.fused[key[0]]:      # (the fused kernel first: the product captures)
                    log.warning("capture with fused attention failed (%s); the %s steps' product instead",
                                e, key[0])
                    self.fused[key[0]] = False
                    metrics.M.graph_fused.labels(key[0]).set(0)
                    # a prefill step only the fused kernel's mask fits: the product's scores
                    # would pin more than SCORES_MAX a layer in the graphs' pool, so eager
                    if key[0] == "prefill" and not self.fits_scores(*shape, cap):
                        return None
                    return self._run(key, host, shape, cap, pool, head)
                log.warning("CUDA graphs off: capture failed (%s); steps launch op by op", e)
                self.model.graphs = None
                return None
            self.graphs[key] = g
            metrics.M.graph_captures.labels(key[0]).inc()
            while len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
        g.io.copy_(host)
        g.graph.replay()
        return g.out.clone()

    def _step(self, io: torch.Tensor, shape: tuple[int, int], cap: int, pool: Pool, head: bool) -> torch.Tensor:
        x = static_step(self.model, io[0], io[1].view(shape), pool.k, pool.v, cap, self.fused[pool.name])
        return self.model._head(x, None, 0) if head else x

    def capture(self, host: torch.Tensor, shape: tuple[int, int], cap: int, pool: Pool, head: bool) -> _Graph:
        io = host.to(self.model.device)
        # a first run outside the graph, on a side stream, as capture requires (workspaces,
        # lazy inits); it writes the rows the replay then writes again with the same values
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._step(io, shape, cap, pool, head)
        torch.cuda.current_stream().wait_stream(side)
        if self.mempool is None:
            self.mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool, capture_error_mode="thread_local"):
            out = self._step(io, shape, cap, pool, head)
        self.captures += 1
        return _Graph(io, graph, out)
