"""Decode steps on CUDA replayed from captured graphs.

A decode step of a small model is hundreds of small kernels, and on CUDA the host's cost of
launching them one by one is the step: SmolLM2-135M on an H200, ~545 launches and ~9 ms of
host time against ~1 ms of GPU time (bench/RESULTS-cuda.md). A graph launches them all at
once. One graph per batch: the same sessions' K/V tensors (so the same addresses and
capacities), in the same order; its inputs (token ids, positions) are copied into static
buffers before each replay, and its logits are copied out after.

Invariants: a graph is replayed only while every K/V tensor it captured is alive and is the
one its batch holds now (weak references, compared by identity): a session that grew (new
tensors) or left memory gets a new graph, and a graph never writes memory it does not own.
The step attends to the whole capacity under a mask, and 0 x NaN would poison the sum, so
every row of a K/V tensor it reads is finite: KVSession.reserve zeroes the rows it allocates
on a GPU (a restored windowed layer's rows below its floor are never written otherwise), and
rows past a session's length are zeroed again before capture (clear_past); after that every
row written there is a real K/V row. Outputs are copied before the next replay may overwrite
them.
"""
from __future__ import annotations

import collections
import logging
import weakref

import torch

log = logging.getLogger("inference")

# graphs kept, least recently used dropped first: a batch's sessions come back turn after
# turn, and each graph holds only its activations (its pool is shared by all)
MAX_GRAPHS = 8


def clear_past(caches: list, lengths: list[int]) -> None:
    """Zero each cache's rows from its sequence's length on (decode_static reads them, masked)."""
    for (kc, vc), n in zip(caches, lengths):
        kc[:, :, n:].zero_()
        vc[:, :, n:].zero_()


class _Graph:
    def __init__(self, caches: list, ids: torch.Tensor, pos: torch.Tensor, graph, out: torch.Tensor):
        self.refs = [(weakref.ref(kc), weakref.ref(vc)) for kc, vc in caches]
        self.ids, self.pos, self.graph, self.out = ids, pos, graph, out

    def holds(self, caches: list) -> bool:
        return all(rk() is kc and rv() is vc for (rk, rv), (kc, vc) in zip(self.refs, caches))


class GraphDecoder:
    """Llama.decode_static's step, captured per batch of caches and replayed."""

    def __init__(self, model, max_graphs: int = MAX_GRAPHS):
        self.model, self.max_graphs = model, max_graphs
        self.graphs: collections.OrderedDict[tuple, _Graph] = collections.OrderedDict()
        self.pool = None       # one memory pool for all graphs, made at the first capture
        self.captures = 0

    @staticmethod
    def takes(model) -> bool:
        """CUDA, and no step that decides on the host (a mixture of experts picks its experts
        from the router's values)."""
        return model.device.type == "cuda" and not model.cfg.n_experts

    def __call__(self, ids: list[int], pos: list[int], caches: list) -> torch.Tensor | None:
        """float32 logits [B, V] of one decode step: ids[b] at pos[b] in caches[b] = (kc, vc);
        None when this step is the eager ops' (a capture failed)."""
        key = tuple((id(kc), id(vc)) for kc, vc in caches)
        g = self.graphs.get(key)
        if g is not None and not g.holds(caches):
            del self.graphs[key]
            g = None
        self.model.ensure_rope(max(pos) + 1)
        host = torch.tensor([ids, pos], dtype=torch.long)
        if g is None:
            try:
                g = self.capture(host, caches)
            except torch.OutOfMemoryError:   # this step eagerly, and the other graphs' memory freed
                log.warning("CUDA graph capture out of memory: %d graphs dropped, this step eager",
                            len(self.graphs))
                self.graphs.clear()
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
        g.ids.copy_(host[0], non_blocking=False)
        g.pos.copy_(host[1], non_blocking=False)
        g.graph.replay()
        return g.out.clone()

    def capture(self, host: torch.Tensor, caches: list) -> _Graph:
        dev = self.model.device
        clear_past(caches, host[1].tolist())
        ids, pos = host[0].to(dev), host[1].to(dev)
        # a first run outside the graph, on a side stream, as capture requires (workspaces,
        # lazy inits); it writes the rows the replay then writes again with the same values
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.model.decode_static(ids, pos, caches)
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = self.model.decode_static(ids, pos, caches)
        self.captures += 1
        return _Graph(caches, ids, pos, graph, out)
