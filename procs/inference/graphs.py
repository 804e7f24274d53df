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

from procs.inference.linear import dense
from procs.inference.torch_attention import causal_mask, decode_attention

log = logging.getLogger("inference")

# graphs kept, least recently used dropped first: a batch's sessions come back turn after
# turn, and each graph holds only its activations (its pool is shared by all)
MAX_GRAPHS = 8


def clear_past(caches: list, lengths: list[int]) -> None:
    """Zero each cache's rows from its sequence's length on (static_step reads them, masked)."""
    for (kc, vc), n in zip(caches, lengths):
        kc[:, :, n:].zero_()
        vc[:, :, n:].zero_()


@torch.inference_mode()
def static_step(model, ids: torch.Tensor, pos: torch.Tensor, caches: list) -> torch.Tensor:
    """Llama.decode_batch's step with every shape fixed by the caches alone, as a CUDA graph
    needs: ids and pos are device tensors [B]; K/V rows are written at pos[b] by index, and
    each sequence attends to its cache's whole capacity under a mask of the rows it can see.
    Every row there must be finite (0 x NaN would poison the sum): KVSession.reserve and
    clear_past see to it. The caller fills the rotary tables up to max(pos) first. Returns
    float32 logits [B, V]."""
    c = model.cfg
    H, KV, D = c.n_heads, c.n_kv_heads, c.head_dim
    x = model.embed_rows(ids)                                                  # [B, dim]
    if c.embed_scale:
        x = x * c.embed_scale
    ropes = [(cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)) for cos, sin in model.rope]
    masks = {}     # (window, sequence) -> float32 [capacity]

    def mask(b: int, window: int, cap: int) -> torch.Tensor:
        if (window, b) not in masks:
            masks[window, b] = causal_mask(pos[b:b + 1].unsqueeze(1), torch.arange(cap, device=model.device),
                                           window, torch.float32).view(cap)
        return masks[window, b]

    def attend(li: int, ly: Layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = []
        for b, (kc, vc) in enumerate(caches):
            kc[li].index_copy_(1, pos[b:b + 1], k[b].unsqueeze(1))
            vc[li].index_copy_(1, pos[b:b + 1], v[b].view(KV, 1, D))
            # the grouped-heads product of the CPU path, masked: SDPA with a mask and
            # grouped heads falls back to its math path, which copies K/V per query head
            out.append(decode_attention(q[b], kc[li], vc[li], model.scale, mask(b, ly.window, kc.shape[2])))
        return torch.cat(out)                                                  # [B, H*D]
    x = model._blocks(x, ropes, lambda f, h: f(h), dense, attend)
    return model._head(x, None, 0)


class _Graph:
    def __init__(self, caches: list, ids: torch.Tensor, pos: torch.Tensor, graph, out: torch.Tensor):
        self.refs = [(weakref.ref(kc), weakref.ref(vc)) for kc, vc in caches]
        self.ids, self.pos, self.graph, self.out = ids, pos, graph, out

    def holds(self, caches: list) -> bool:
        return all(rk() is kc and rv() is vc for (rk, rv), (kc, vc) in zip(self.refs, caches))


class GraphDecoder:
    """static_step, captured per batch of caches and replayed."""

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
            static_step(self.model, ids, pos, caches)
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = static_step(self.model, ids, pos, caches)
        self.captures += 1
        return _Graph(caches, ids, pos, graph, out)
