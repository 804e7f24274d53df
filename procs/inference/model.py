"""Llama-family decoder in plain torch (the KV session it fills: kvsession.py).

What an architecture adds (q/k/v biases, per-head q/k norms, RoPE scaling, a mixture of
experts in place of the MLP) arrives as tensors and config from the loader
(procs/inference/archs.py); forward() applies whatever a layer carries and never asks which
architecture it runs.

Shapes: T = tokens in this call, S = keys attended (position + T), H = query heads,
KV = key/value heads, D = head dim. The K/V cache is [layers, KV, capacity, D]; row i holds
absolute position i. Prefill runs in chunks whose
boundaries are absolute multiples of the chunk size, so a prefill resumed from any aligned
position runs exactly the kernels (same shapes, same order) an uninterrupted one runs, and
its logits are bit-identical.
"""
from __future__ import annotations

import hashlib
import torch
import torch.nn.functional as F

from procs.inference.graphs import GraphDecoder
from procs.inference.layer import Layer, build_layer
from procs.inference.weights import LoadedWeights
from procs.inference.linear import PACKED_MAX_ROWS, Linear, dense, experts as linear_experts, fuse, pack_source
from procs.inference.cpu import bf16_native, bf16_products_fast
from procs.inference.native import QUANTIZED
from procs.inference.packcache import PackCache
from procs.inference.rope import q_scale, rotary, rotate, specs
from procs.inference.torch_attention import causal_mask as _mask, decode_attention as _decode_attention, sink_attention


# Exact mode runs attention on blocks of this many query rows (padded), so that a short
# suffix does not pay for a whole chunk of queries against a long context.
EXACT_Q = 64
ROPE_BLOCK = 1024      # rotary table rows computed at a time (Llama.ensure_rope)


class Llama:
    def __init__(self, w: LoadedWeights, max_context: int, packed: bool = True, kernels=None,
                 cache: PackCache | None = None, native_prefill: bool = True, cuda_graphs: bool = False,
                 prefill_f32: bool | None = None):
        """packed: decode reads the packed weight copies; False keeps every decode row on the
        dense weights. kernels: procs/inference/native.Kernels; a model they take decodes in
        one native call per token (native.Decoder), another uses their attention kernel
        where it takes the head layout. None: torch's ops only. cache: the native packs
        from an earlier load (procs/inference/packcache.py), and where this one's go.
        native_prefill: prefill's attention (outside exact mode) in the kernels' prefill.c.
        cuda_graphs: batched decode steps replay captured graphs (graphs.py) where they can.
        prefill_f32: in bf16 on the CPU, prefill's GEMMs and native attention multiply in f32
        on the bf16 values widened (K/V and what passes between ops stay bf16); None: where
        the CPU's bf16 products are no faster than its f32 FMAs (cpu.bf16_products_fast)."""
        c = self.cfg = w.config
        t = w.tensors
        self.fingerprint = w.fingerprint
        self.norm = t["norm"]
        self.dtype, self.device = self.norm.dtype, self.norm.device
        if prefill_f32 is None:
            prefill_f32 = not bf16_products_fast()
        # the dtype prefill's GEMMs multiply in (mm_dtype) and the attention kernel's pairs
        self.mm_dtype = torch.float32 if prefill_f32 and self.dtype == torch.bfloat16 \
            and self.device.type == "cpu" else self.dtype
        self.pairs = self.mm_dtype == self.dtype
        # the head's rows up to which it multiplies row by row (torch.mv): one row, where
        # matrix-vector is ~1.8x faster; decode-sized batches in bf16 without bf16 instructions,
        # where torch's emulated bf16 GEMM of 2-5 rows sums in an order that depends on the
        # thread count (decode's logits must not: threads.py) at about the same speed (Xeon
        # without avx512_bf16, SmolLM2's 49152 x 576 head, 3 rows: 8.6 ms against 7.9)
        self.mv_rows = PACKED_MAX_ROWS if self.dtype == torch.bfloat16 and not bf16_native() else 1
        if self.device.type == "cuda":
            # cuDNN's SDPA plans each new shape on the host: 1.3 ms a call, and decode's key
            # count is new every step (H200, torch 2.11: 38 of a 41 ms step at 4,000 tokens).
            # Flash / memory-efficient / math take any shape without planning.
            torch.backends.cuda.enable_cudnn_sdp(False)
        # attention sinks (gpt-oss): the kernels' attention takes them; elsewhere torch's ops
        # (torch_attention.sink_attention)
        self.sinks = w.sinks
        fits = kernels is not None and kernels.attention.takes(c.n_heads // c.n_kv_heads, c.head_dim) \
            and self.dtype in (torch.bfloat16, torch.float32) and self.device.type == "cpu"
        self.attend = kernels.attention if fits else _decode_attention
        self.prefill_attend = kernels.prefill if native_prefill and fits \
            and kernels.prefill.takes(c.n_heads // c.n_kv_heads, c.head_dim) else None
        # a model the native decoder declines (a CUDA-only shape, --decode-kernels torch) still keeps its linears
        # packed once, as the kernels pack them, and decodes them with the kernels' products
        # (Linear.__call__); only the whole step is torch's then
        packs = kernels is not None and self.device.type == "cpu" and self.dtype in (torch.bfloat16, torch.float32)
        native = packs and kernels.takes(self)
        self.kernels = kernels if packs else None
        self.layers = []
        q4, q8, q8p = w.q4 or {}, w.q8, w.q8_parts or {}
        cache = cache if packs else None
        self._output_and_embedding(t, q4, q8, q8p, packed, packs, cache)
        for i in range(c.n_layers):
            p = f"layers.{i}."

            def fused(*names):
                key = p + "+".join(names)
                mat = cache.get(key) if cache else None
                if mat is not None:      # the sources are never read (their loads are lazy)
                    return Linear.of(mat, kernels, self.dtype)
                lin = fuse([p + n for n in names], t, q4, q8, packed, kernels if packs else None, q8p)
                if cache and lin.mat.kind in QUANTIZED:   # a dense one is its source as is
                    cache.put(key, lin.mat)
                return lin
            def experts(*names):
                return linear_experts([p + n for n in names], c.n_experts, t, q4, q8, packed, kernels, q8p,
                                      cache, p + "+".join(names))
            self.layers.append(build_layer(c, t, i, fused, experts if packs else None))
            if packs and self.layers[-1].gdn is not None:    # its decode step in the kernels (gdn.c)
                self.layers[-1].gdn.native = kernels.delta_step(self.layers[-1].gdn, self.dtype)
            # the layer's sources are fused copies now: dropped as we go, so a load peaks at
            # one copy of the weights plus one layer, not two copies
            for d in (t, q4, q8p):          # del, not pop: a source never read stays unmade
                for name in [n for n in d if n.startswith(p)]:
                    del d[name]
        del w.tensors, w.q4, w.q8_parts
        self.act = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"),
                    "swiglu_oai": None}[c.act]      # gpt-oss's is its experts' (moe.swiglu_oai)
        self.scale = c.attn_scale or c.head_dim ** -0.5
        # rotary tables in the compute dtype, [ctx, D] each (rope.specs says which): allocated
        # whole (the native decoder keeps their addresses) but filled in blocks of ROPE_BLOCK
        # positions as positions are reached (ensure_rope): untouched rows cost no memory and no
        # start-up time (a 128k context's two tables: ~270 MB and a second). A block is always
        # computed alone, so a position's values never depend on how far the tables were filled.
        self.rope_specs, long = specs(c, max_context)
        if long:    # LongRoPE's long factors: checkpoints of the two are not interchangeable
            self.fingerprint = hashlib.blake2b(w.fingerprint + b"rope_factors_long", digest_size=16).digest()
        self.rope = [(torch.empty(max_context, c.head_dim, dtype=self.dtype, device=self.device),
                      torch.empty(max_context, c.head_dim, dtype=self.dtype, device=self.device))
                     for _ in self.rope_specs]
        self.rope_rows = 0
        self.max_context = max_context
        self.ensure_rope(1)
        self.q_scale = q_scale(c, max_context, self.device)   # f32: native decode reads it
        self.decoder = kernels.decoder(self) if native else None
        self.graphs = GraphDecoder(self) if cuda_graphs and GraphDecoder.takes(self) else None

    def _output_and_embedding(self, t, q4, q8, q8p, packed: bool, native: bool, cache=None) -> None:
        """The output projection and the embedding. Native: the decoder reads the projection
        as int4 or int8 groups when its source is quantized, and then that copy is the only
        one: the embedding's rows come from it too when tied (embed_mat), and no dense copy
        is made (lm_head, embed None). Torch's path: the dense copies, and a packed Linear
        for the projection when its source is 4-bit, or quantized in f32 (torch's int8 kernel
        gains over a bf16 torch.mv nothing, 13.4 vs 13.5 ms for Gemma's 262144 x 640, but
        halves an f32 one)."""
        head = "lm_head" if "lm_head" in t else "embed"
        quantized = QUANTIZED
        self.head_mat = self.embed_mat = self.head = None
        def source(name):
            mat = cache.get(name) if cache else None
            if mat is None:
                mat = pack_source(t, name, q4, q8, q8p, packed)
                if cache and mat.kind in quantized:
                    cache.put(name, mat)
            return mat
        if native:
            self.head_mat = source(head)
            if self.head_mat.kind in quantized and head == "embed":
                self.embed_mat = self.head_mat
            elif packed and head != "embed" and ("embed" in q4 or "embed" in q8):
                self.embed_mat = source("embed")
        self.embed = t["embed"] if self.embed_mat is None else None           # [V, dim]
        if self.head_mat is not None and self.head_mat.kind in quantized:
            self.lm_head = None
        else:                                                                 # tied when absent
            self.lm_head = t["lm_head"] if head == "lm_head" else self.embed
        int8_head = head in q8 and self.dtype == torch.float32
        if not native and (head in q4 or int8_head):
            self.head = Linear(self.lm_head, q4.get(head), int8=int8_head, packed=packed)

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding's rows ids [T] -> [T, dim], compute dtype (from the packed copy when
        the dense one was dropped)."""
        if self.embed_mat is not None:
            return self.kernels.rows(self.embed_mat, self.dtype, ids)
        return F.embedding(ids, self.embed)

    def ensure_rope(self, n: int) -> None:
        """The rotary tables hold positions 0..n-1 (n <= max_context)."""
        while self.rope_rows < min(n, self.max_context):
            a = self.rope_rows
            b = min(a + ROPE_BLOCK, self.max_context)
            for (cos, sin), (theta, factors, attn) in zip(self.rope, self.rope_specs):
                cos[a:b], sin[a:b] = rotary(self.cfg, theta, factors, a, b - a, attn, self.dtype, self.device)
            self.rope_rows = b

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, pos: int, kc: torch.Tensor, vc: torch.Tensor,
                rows: list[int], pad_to: int = 0, state=None) -> torch.Tensor:
        """Run tokens ids[T] at absolute positions pos..pos+T-1, writing K/V into the caches
        (and, for linear-attention layers, advancing the sequence's gdn.Recurrent state).

        Returns float32 logits [len(rows), V] for the given row indices into ids (0..T-1).
        pad_to > 0 (exact mode): every row is computed by the same kernels whatever T and pos
        are: linears on inputs zero-padded to pad_to rows (a GEMM's row depends on M, not on
        where in the block the row sits), attention on padded blocks of EXACT_Q query rows
        against keys padded to a multiple of pad_to (masked), logits one row at a time.
        Row-wise ops (norms, RoPE, SiLU) do not depend on T (checked by tests/procs/inference/test_model.py).
        """
        c = self.cfg
        T, S = ids.shape[0], pos + ids.shape[0]
        H, KV, D = c.n_heads, c.n_kv_heads, c.head_dim
        if T == 1 and not pad_to and self.decoder is not None:
            out = self.decoder(ids, pos, kc, vc, state)                        # [1, V]
            return out if rows == [0] else out[rows]
        if pad_to and T > pad_to:
            raise ValueError(f"{T} rows exceed the exact-mode block of {pad_to}")

        md = self.mm_dtype

        def mm(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            n = h.shape[0]
            if pad_to:   # one GEMM shape whatever the row count (at most T)
                h = F.pad(h, (0, 0, 0, pad_to - n))
            if md is self.dtype or h.dtype is not self.dtype:   # (an f32 input stays as it is)
                return dense(h, w)[:n]
            return dense(h.to(md), w.to(md))[:n].to(self.dtype)

        def lin(f: Linear, h: torch.Tensor) -> torch.Tensor:
            if pad_to or (md is not self.dtype and h.shape[0] > f.rows):
                return mm(h, f.weight(md))
            return f(h)
        x = self.embed_rows(ids)                                               # [T, dim]
        if c.embed_scale:
            x = x * c.embed_scale
        self.ensure_rope(S)
        ropes = [(cos[pos:S].unsqueeze(1), sin[pos:S].unsqueeze(1)) for cos, sin in self.rope]  # [T, 1, D]
        if pad_to:  # blocks of EXACT_Q query rows x keys to a multiple of pad_to: one blocking
            nq = -(-T // EXACT_Q) * EXACT_Q
            K = -(-S // pad_to) * pad_to
            if K > kc.shape[2]:
                raise ValueError(f"exact mode needs a K/V capacity of {K} (a multiple of {pad_to})")
            qpos = torch.arange(pos, pos + nq, device=self.device).clamp_(max=S - 1).unsqueeze(1)
        masks = {}   # window -> (first key, mask or None)

        def keys(window: int):
            if window not in masks:
                if pad_to:   # every key of the padded block, masked: one kernel shape per split
                    masks[window] = 0, _mask(qpos, torch.arange(K, device=self.device), window, self.dtype)
                else:        # only the keys some query of this call can see
                    ks = max(0, pos - window + 1) if window else 0
                    masks[window] = ks, (None if T == 1 else _mask(
                        torch.arange(pos, S, device=self.device).unsqueeze(1),
                        torch.arange(ks, S, device=self.device), window, self.dtype))
            return masks[window]

        def attend(li: int, ly: Layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kc[li, :, pos:S] = k.transpose(0, 1)                               # [KV, T, D]
            vc[li, :, pos:S] = v.view(T, KV, D).transpose(0, 1)
            if T > 1 and not pad_to and self.prefill_attend is not None:     # [T, H*D]
                return self.prefill_attend(q, kc[li], vc[li], pos, ly.window, self.scale, self.pairs, ly.sinks)
            ks, mask = keys(ly.window)
            if T == 1 and not pad_to and self.device.type == "cpu":
                return self.attend(q[0], kc[li, :, ks:S], vc[li, :, ks:S], self.scale, sinks=ly.sinks)  # [1, H*D]
            if ly.sinks is not None:
                if pad_to:   # exact mode's blocks, as below
                    qp = F.pad(q, (0, 0, 0, 0, 0, nq - T))
                    return torch.cat([sink_attention(qp[a:a + EXACT_Q], kc[li, :, :K], vc[li, :, :K],
                                                     mask[a:a + EXACT_Q], self.scale, ly.sinks)
                                      for a in range(0, nq, EXACT_Q)])[:T]
                return sink_attention(q, kc[li, :, ks:S], vc[li, :, ks:S], mask, self.scale, ly.sinks)
            qh = q.transpose(0, 1).unsqueeze(0)                                # [1, H, T, D]
            if pad_to:
                qh = F.pad(qh, (0, 0, 0, nq - T))
                o = torch.cat([F.scaled_dot_product_attention(
                    qh[:, :, a:a + EXACT_Q], kc[li:li + 1, :, :K], vc[li:li + 1, :, :K],
                    attn_mask=mask[a:a + EXACT_Q], enable_gqa=True, scale=self.scale)
                    for a in range(0, nq, EXACT_Q)], dim=2)[:, :, :T]
            else:
                o = F.scaled_dot_product_attention(qh, kc[li:li + 1, :, ks:S], vc[li:li + 1, :, ks:S],
                                                   attn_mask=mask, enable_gqa=True, scale=self.scale)
            return o[0].transpose(0, 1).reshape(T, H * D)
        x = self._blocks(x, ropes, lin, mm, attend, self.q_scales(slice(pos, S)),
                         lambda ly, h: ly.gdn(h, lin, [(0, T, pos, state)]))
        return self._head(x, rows, pad_to)

    @torch.inference_mode()
    def decode_batch(self, ids: list[int], pos: list[int], caches: list, exact: bool = False,
                     share=None, states: list | None = None) -> torch.Tensor:
        """One token for each of B sequences in one step: ids[b] at position pos[b] of the
        sequence whose caches are caches[b] = (kc, vc). Returns float32 logits [B, V]. The
        linears take all B rows at once (one read of each weight); K/V writes and attention
        are per sequence. The native decoder's rows equal single-token forward() bit for bit;
        torch's batched GEMMs may round differently from its one-row ones, so exact (the
        --deterministic promise that an answer does not depend on what else runs) decodes
        each sequence alone there. share: Decoder.batch's (rows shared between sequences,
        read once by the native decoder; the other paths ignore it). On CUDA,
        steps.decode_many replays graphs.GraphDecoder's graphs instead, where it can."""
        B = len(ids)
        states = states or [None] * B
        if B == 1 or (exact and self.decoder is None):
            return torch.cat([self.forward(torch.tensor([t], device=self.device), p, kc, vc, [0], state=st)
                              for t, p, (kc, vc), st in zip(ids, pos, caches, states)])
        if self.decoder is not None:
            return self.decoder.batch(torch.tensor(ids, device=self.device), pos, caches, share, states)
        c = self.cfg
        H, KV, D = c.n_heads, c.n_kv_heads, c.head_dim
        x = self.embed_rows(torch.tensor(ids, device=self.device))            # [B, dim]
        if c.embed_scale:
            x = x * c.embed_scale
        at = torch.tensor(pos, device=self.device)
        self.ensure_rope(max(pos) + 1)
        ropes = [(cos[at].unsqueeze(1), sin[at].unsqueeze(1)) for cos, sin in self.rope]  # [B, 1, D]

        def attend(li: int, ly: Layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = []
            for b, (p, (kc, vc)) in enumerate(zip(pos, caches)):
                kc[li, :, p] = k[b]
                vc[li, :, p] = v[b].view(KV, D)
                ks = max(0, p - ly.window + 1) if ly.window else 0
                if self.device.type == "cpu":
                    out.append(self.attend(q[b], kc[li, :, ks:p + 1], vc[li, :, ks:p + 1], self.scale, sinks=ly.sinks))
                elif ly.sinks is not None:
                    out.append(sink_attention(q[b:b + 1], kc[li, :, ks:p + 1], vc[li, :, ks:p + 1], None,
                                              self.scale, ly.sinks))
                else:
                    o = F.scaled_dot_product_attention(q[b].unsqueeze(1).unsqueeze(0), kc[li:li + 1, :, ks:p + 1],
                                                       vc[li:li + 1, :, ks:p + 1], enable_gqa=True, scale=self.scale)
                    out.append(o.reshape(1, H * D))
            return torch.cat(out)                                              # [B, H*D]
        lin = lambda f, h: f(h)
        x = self._blocks(x, ropes, lin, dense, attend, self.q_scales(at),
                         lambda ly, h: ly.gdn(h, lin, [(b, 1, p, st) for b, (p, st) in enumerate(zip(pos, states))]))
        return self._head(x, list(range(B)), 0)

    def q_scales(self, at) -> torch.Tensor | None:
        """The query scale of the positions `at` (a slice or an index tensor) as [T, 1, 1] in
        the compute dtype (transformers rounds it so), or None where it is 1 everywhere."""
        return None if self.q_scale is None else self.q_scale[at].to(self.dtype).view(-1, 1, 1)

    def _blocks(self, x: torch.Tensor, ropes, lin, mm, attend, qs: torch.Tensor | None = None,
                mix=None) -> torch.Tensor:
        """Every layer on the rows x [T, dim]: lin(Linear, h) and mm(h, w) are the linears
        (exact mode pads them), attend(kv, layer, q, k, v) stores K/V in cache layer kv and
        returns [T, H*D]; qs: the rows' query scales (q_scales); mix(layer, h): a Gated
        DeltaNet layer's [T, nv*dv] (gdn.py), its sequences' states advanced."""
        c = self.cfg
        T = x.shape[0]
        H, KV, D = c.n_heads, c.n_kv_heads, c.head_dim
        for ly in self.layers:
            h = F.rms_norm(x, (c.dim,), ly.attn_norm, c.norm_eps)
            if ly.gdn is not None:
                att = mix(ly, h)
            elif ly.mla is not None:     # latent rows as one K/V head, expanded after attention
                q, k, v = ly.mla.project(h, lin, *ropes[ly.rope])
                att = ly.mla.expand(attend(ly.kv, ly, q, k, v), lin)
            else:
                qkv = lin(ly.wqkv, h)                                # [T, (H+2KV)*D]
                if ly.bqkv is not None:
                    qkv = qkv + ly.bqkv
                qk = qkv[:, :(H + KV) * D].view(T, H + KV, D)
                if ly.qk_norm is not None:   # RMSNorm over each head of q and k (row-wise: exact mode holds)
                    qk = F.rms_norm(qk, (D,), None, c.norm_eps) * ly.qk_norm
                qk = rotate(qk, *ropes[ly.rope])                     # q and k at once
                q = qk[:, :H] if qs is None else qk[:, :H] * qs
                att = attend(ly.kv, ly, q, qk[:, H:], qkv[:, (H + KV) * D:(H + 2 * KV) * D])
                if ly.gated:                                         # Qwen3-Next's output gate
                    att = att * torch.sigmoid(qkv[:, (H + 2 * KV) * D:])
            o = lin(ly.wo, att)                                      # [T, dim]
            if ly.bo is not None:
                o = o + ly.bo
            if ly.post_attn_norm is not None:
                o = F.rms_norm(o, (c.dim,), ly.post_attn_norm, c.norm_eps)
            x = x + o
            h = F.rms_norm(x, (c.dim,), ly.ffn_norm, c.norm_eps)
            o = ly.moe(h, mm, lin) if ly.moe is not None else None  # only the chosen experts
            if ly.wgu is not None:                                   # dense, or the shared expert
                g, u = lin(ly.wgu, h).chunk(2, dim=-1)               # [T, ffn] each
                d = lin(ly.wd, self.act(g) * u)
                if ly.sh_gate is not None:                           # the shared expert's gate
                    d = d * torch.sigmoid(mm(h, ly.sh_gate))
                o = d if o is None else o + d
            if ly.post_ffn_norm is not None:
                o = F.rms_norm(o, (c.dim,), ly.post_ffn_norm, c.norm_eps)
            x = x + o
        return x

    def _head(self, x: torch.Tensor, rows: list[int] | None, pad_to: int) -> torch.Tensor:
        """float32 logits [len(rows), V] of the final hidden rows x[rows] (None: all rows, no
        index: a CUDA graph cannot copy one from the host)."""
        c = self.cfg
        T = x.shape[0]
        if rows is None:
            rows = list(range(T)) if self.lm_head is None or pad_to else slice(None)
        if self.lm_head is None:   # the packed projection, row by row (so exact mode's rows hold)
            x = F.rms_norm(x[rows], (c.dim,), self.norm, c.norm_eps)
            if not rows:
                return x.new_zeros((0, self.cfg.vocab_size), dtype=torch.float32)
            return torch.stack([self.kernels.mat_vec(self.head_mat, r) for r in x])
        if pad_to:
            if not rows:
                return x.new_zeros((0, self.lm_head.shape[0]), dtype=torch.float32)
            return torch.cat([F.linear(F.rms_norm(x[i:i + 1], (c.dim,), self.norm, c.norm_eps), self.lm_head)
                              for i in rows]).float()
        x = x[rows]                                                            # only rows we need
        x = F.rms_norm(x, (c.dim,), self.norm, c.norm_eps)
        if self.head is not None and self.head.packed is not None and T <= PACKED_MAX_ROWS:
            return self.head(x).float()    # a decode-sized call, as the layers' linears decide
        if x.device.type == "cpu" and 0 < x.shape[0] <= self.mv_rows:
            return torch.stack([torch.mv(self.lm_head, r) for r in x]).float()
        return F.linear(x, self.lm_head).float()                              # [len(rows), V]
