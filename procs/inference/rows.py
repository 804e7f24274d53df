"""Weight rows in the order forward() reads them, made at load: a Llama GGUF's Q/K rows back
from llama.cpp's interleaved RoPE pairs (unpermute), partial or adjacent-pair RoPE reordered
into half-split pairs of the whole head (rotary_perm, rotary_rows), and fused tensors split
into their parts (split_fused), lazily where the dict is a Lazy one."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from procs.inference.archs import fused_rows
from procs.inference.gguf_tensors import Lazy

if TYPE_CHECKING:
    from procs.inference.weights import ModelConfig


def unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # [heads * head_dim, dim]: GGUF interleaves rotary pairs; HF keeps halves apart.
    out, inp = w.shape
    return w.reshape(n_heads, out // n_heads // 2, 2, inp).transpose(1, 2).reshape(out, inp)


def rotary_perm(head_dim: int, rope_dims: int, interleaved: bool = False) -> torch.Tensor | None:
    """Rows of a head in the order that makes partial rotary embeddings (the first R dims
    rotate, as pairs (i, i + R/2); interleaved: as pairs (2i, 2i + 1)) rotate-half pairs of
    the whole head (j, j + D/2): the rotated halves first in each half, the pass-through
    dims after them, whose frequency is zero (rope.rotary). Q and K alike, so their dot
    products are unchanged."""
    rope_dims = rope_dims or head_dim
    if rope_dims == head_dim and not interleaved:
        return None
    r, p = rope_dims // 2, (head_dim - rope_dims) // 2
    order = torch.cat([torch.arange(0, r), torch.arange(2 * r, 2 * r + p),
                       torch.arange(r, 2 * r), torch.arange(2 * r + p, head_dim)])
    if not interleaved:
        return order
    # half-split position i < r is the pair's first dim 2i, i >= r its second 2(i - r) + 1
    halves = torch.cat([torch.arange(0, 2 * r, 2), torch.arange(1, 2 * r, 2), torch.arange(2 * r, head_dim)])
    return halves[order]


ROTATED = ("wq", "wk", "bq", "bk", "q_norm", "k_norm")   # per-head rows that rotary_perm reorders


def rotary_rows(t: torch.Tensor, head_dim: int, perm: torch.Tensor) -> torch.Tensor:
    """t's rows (or a [D] norm's values) reordered by perm within each head."""
    return t.reshape(-1, head_dim, *t.shape[1:])[:, perm].reshape(t.shape)


def mla_rows(cfg: ModelConfig) -> dict[str, tuple[int, torch.Tensor]]:
    """Latent attention's rows with rotary dims (mla.py), interleaved in the checkpoint: per
    tensor, (rows per group, the order within a group) that puts each group's last rope_dims
    rows in half-split order (pairs (2i, 2i + 1) -> (i, i + R/2)), q's per head, kv_a's once."""
    R = cfg.rope_dims
    tail = torch.cat([torch.arange(0, R, 2), torch.arange(1, R, 2)])
    q, kv = cfg.qk_nope + R, cfg.kv_lora + R
    query = (q, torch.cat([torch.arange(q - R), q - R + tail]))
    return {"wq": query, "wq_b": query, "wkv_a": (kv, torch.cat([torch.arange(kv - R), kv - R + tail]))}


def grouped_rows(t: torch.Tensor, group: int, order: torch.Tensor) -> torch.Tensor:
    """t's rows reordered by order within each group of `group` rows."""
    return t.reshape(-1, group, *t.shape[1:])[:, order].reshape(t.shape)


def split_fused(d: dict, cfg: ModelConfig) -> None:
    """Replace each layer's fused tensors (archs.fused_rows) in d by their row ranges. In a
    Lazy dict each range is made when first read, from the fused value made once and
    dropped when its last range is taken; a value may be a tensor or a tuple of row-aligned
    parts (quantized levels and scales)."""
    perm = rotary_perm(cfg.head_dim, cfg.rope_dims)

    def rows(v, a: int, b: int, ours: str = ""):
        one = lambda t: t[a:b].clone() if perm is None or ours not in ("wq", "wk") else \
            rotary_rows(t[a:b], cfg.head_dim, perm)
        return one(v) if isinstance(v, torch.Tensor) else tuple(one(t) for t in v)

    def reorder(v, order):
        return v if order is None else v[order] if isinstance(v, torch.Tensor) else tuple(t[order] for t in v)
    for fused, (order, parts) in fused_rows(cfg).items():
        order = None if order is None else torch.tensor(order)
        for i in range(cfg.n_layers):
            name = f"layers.{i}.{fused}"
            if name not in d:
                continue
            if not isinstance(d, Lazy):
                v = reorder(d.pop(name), order)
                for ours, a, b in parts:
                    d[f"layers.{i}.{ours}"] = rows(v, a, b, ours)
                continue
            make = d._make.pop(name, None)          # the fused name leaves the dict now
            made = dict.pop(d, name)
            state = {"make": make or (lambda made=made: made), "value": None, "left": len(parts)}

            def part(a, b, ours, state=state, order=order):
                if state["value"] is None:
                    state["value"] = reorder(state["make"](), order)
                out = rows(state["value"], a, b, ours)
                state["left"] -= 1
                if not state["left"]:
                    state["value"] = None
                return out
            for ours, a, b in parts:
                d.later(f"layers.{i}.{ours}", lambda a=a, b=b, ours=ours, part=part: part(a, b, ours))


def tile_v_heads(t: dict, cfg: ModelConfig) -> None:
    """A Hugging Face Qwen3.5's DeltaNet tensors with the value heads in llama.cpp's tiled
    order (new head j * nk + g is old head g * r + j, r = nv / nk), so that value head h reads
    key head h % nk as in its GGUFs: the value rows of the projection and of the
    convolution, z, b, a, the decay and dt per head, the output's input columns."""
    nk, nv, dk, dv = cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_k_dim, cfg.ssm_v_dim
    r = nv // nk
    heads = torch.tensor([g * r + j for j in range(r) for g in range(nk)])
    per = lambda d: (heads[:, None] * d + torch.arange(d)).reshape(-1)        # rows of d per head
    key = 2 * nk * dk
    with_v = torch.cat([torch.arange(key), key + per(dv)])
    for i, lin in enumerate(cfg.linear_layers):
        if not lin:
            continue
        p = f"layers.{i}."
        for name, order in (("ssm_qkv", with_v), ("ssm_conv", with_v), ("ssm_z", per(dv)), ("ssm_b", heads),
                            ("ssm_alpha", heads), ("ssm_a", heads), ("ssm_dt", heads)):
            t[p + name] = t[p + name][order].contiguous()
        t[p + "ssm_out"] = t[p + "ssm_out"][:, per(dv)].contiguous()
