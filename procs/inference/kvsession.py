"""One sequence's K/V, token ids and next-token logits: what a conversation holds in memory.
Prefill runs in chunks whose ends are absolute multiples of the chunk size (Llama.forward
computes them); a session grows its rows as it fills (reserve) and can be truncated,
copied from another session's prefix, exported to and imported from a checkpoint."""
from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from procs.inference.gdn import Recurrent
from procs.inference.model import Llama
from procs.inference.pages import advise_huge

# Session contents' versions: a session takes a new one when it is rebuilt (copy_prefix,
# import_); in between, rows change only past a truncation (KVSession.cuts), so rows of two
# versions compared equal stay equal below every later cut. Unique across sessions, so a
# dropped session's version never returns.
_VERSIONS = itertools.count(1)
MAX_MARKS = 8        # recurrent-state copies a session keeps (KVSession.mark), the latest


class KVSession:
    """One sequence's K/V for the whole context, its token ids, and the next-token logits.

    Every layer keeps full-length K/V, so a session computed here can be truncated to any
    prefix. A restored checkpoint of n tokens brings a sliding-window layer only its last
    min(n, W) rows: that layer then holds no rows below its floor n - min(n, W), and the
    session may only be truncated to lengths whose next query sees no key below a floor
    (can_keep). A truncate to 0 forgets the floors; prefills never move them.

    A model with linear-attention layers (gdn.py) holds K/V rows for its attention layers only
    and a recurrent state for the others, which is the state after the last token and cannot
    be rewound. Such a session also keeps copies of the state at a few positions (marks: the
    end of each prompt, where a later turn whose template rewrites the answer diverges, and
    the positions its checkpoints are taken at; at most MAX_MARKS, the latest), and can be
    cut to 0, to its length or to a mark (can_keep), and checkpointed there (can_export)."""

    def __init__(self, model: Llama, n_ctx: int, chunk: int, exact: bool = False, huge_pages: bool = True):
        """exact: prefill rows are bit-identical however a prompt is split between cache and
        prefill (Llama.forward's pad_to); decode keeps its fast kernels, so rows it appends
        are not those a prefill computes (the server prefills them again after each answer).
        huge_pages: the rows on the CPU on transparent huge pages (procs/inference/pages.py)."""
        c = model.cfg
        self.exact, self.huge_pages = exact, huge_pages
        if n_ctx > model.max_context:
            raise ValueError(f"context {n_ctx} exceeds the rotary table ({model.max_context})")
        if exact and c.linear_layers:    # its blocked prefill's rows depend on where chunks begin
            raise ValueError("--deterministic is not supported for models with linear-attention layers "
                             "(Qwen3-Next, Qwen3.5)")
        self.model, self.n_ctx, self.chunk = model, n_ctx, chunk
        self.max_cap = -(-n_ctx // chunk) * chunk if exact else n_ctx     # exact attention reads whole chunks
        # rows are allocated as the session grows (reserve), so a short conversation kept
        # resident costs its own length, not the whole context
        shape = (c.kv_layers, c.n_kv_heads, 0, c.head_dim)
        # latent attention's V rows are its K rows (mla.py): one tensor, self.v is self.k, and
        # every write of V rows writes the K rows' own values
        self.one_kv = c.kv_tensors == 1
        self.k = torch.zeros(shape, dtype=model.dtype, device=model.device)
        self.v = self.k if self.one_kv else torch.zeros(shape, dtype=model.dtype, device=model.device)
        self.tokens: list[int] = []
        self.logits: torch.Tensor | None = None   # float32 [V], after the last token
        self.windows = list(c.windows) if c.windows else [0] * c.kv_layers   # 0: a global layer
        self.floors = [0] * c.kv_layers  # per layer: the first position it holds rows for
        self.state = Recurrent(c, sum(c.linear_layers), model.dtype, model.device) if c.linear_layers else None
        self.marks: dict[int, Recurrent] = {}    # position -> the state after its first tokens
        self.version = next(_VERSIONS)
        self.cuts: list[int] = []        # lengths truncated to, in order, since the version began
        # the prompt length of the job whose answer the session ends with (0: unknown): the
        # renderer reuses a session short of --kv-cache-min-tokens when a prompt keeps all of it
        self.answer_from = 0

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        """Memory the session's K/V rows take (its capacity, not only its length), and its
        recurrent state."""
        rows = (1 if self.one_kv else 2) * self.k.numel() * self.k.element_size()
        return rows if self.state is None else rows + self.state.nbytes * (1 + len(self.marks))

    def capacity_for(self, n: int) -> int:
        """The capacity reserve(n) grows to: whole chunks, at least double the current one
        (so a growing session is copied O(log n) times), at most the context."""
        cap = self.k.shape[2]
        if n <= cap:
            return cap
        return min(self.max_cap, max(-(-n // self.chunk) * self.chunk, 2 * cap))

    def reserve(self, n: int, huge: Sequence[int] = ()) -> None:
        """Room for n rows (exact mode: for the whole chunk holding row n - 1). huge: the
        layers whose new rows go on huge pages, those about to be filled whole (copy_prefix,
        import_; procs/inference/pages.py); a growing session stays on 4 KB pages, where its
        rows past its length (up to double it) cost nothing until written, and so does a
        restored windowed layer, which is written only in its last W rows (a 2 MB page is
        resident whole once touched)."""
        if self.exact:
            n = -(-n // self.chunk) * self.chunk
        if n > self.max_cap:
            raise ValueError(f"{n} rows exceed the context of {self.n_ctx}")
        cap = self.capacity_for(n)
        if cap == self.k.shape[2]:
            return
        held = min(len(self.tokens), self.k.shape[2])
        for name in ("k",) if self.one_kv else ("k", "v"):
            old = getattr(self, name)
            # empty, not zeros: rows past the length are never read (a windowed layer's rows
            # below its floor neither), so on the CPU their pages stay untouched and cost no
            # memory until written. Zeroed in exact mode, whose attention reads whole padded
            # chunks, masked: garbage there could be NaN or inf (0 x NaN). (A CUDA graph's
            # step reads its own pool, whose rows graphs.py keeps finite.)
            new = torch.empty(old.shape[:2] + (cap, old.shape[3]), dtype=old.dtype, device=old.device)
            for a, b in _runs(huge):          # runs of adjacent layers: one span each
                advise_huge(new[a:b], within=new)
            new[:, :, :held] = old[:, :, :held]
            if self.exact:
                new[:, :, held:].zero_()
            setattr(self, name, new)
        if self.one_kv:
            self.v = self.k

    def copy_prefix(self, src: "KVSession", n: int) -> None:
        """Become the first n tokens of src (another session of the same model): its rows
        copied, so either can then go on alone. The logits are unknown (None)."""
        if not src.can_keep(n):
            raise ValueError(f"cannot keep {n} tokens of the source session")
        self.truncate(0)
        self.version, self.cuts = next(_VERSIONS), []
        self.reserve(n, huge=range(len(self.windows)) if self.huge_pages else ())
        self.k[:, :, :n] = src.k[:, :, :n]
        if not self.one_kv:
            self.v[:, :, :n] = src.v[:, :, :n]
        self.floors = list(src.floors)
        if self.state is not None:          # can_keep: all of src or one of its marks
            self.state.copy_(src.state_at(n))
        self.tokens = list(src.tokens[:n])
        self.logits = src.logits.clone() if n == len(src.tokens) and src.logits is not None else None

    @property
    def window_floor(self) -> int:
        """The first position every layer holds rows for (0 unless restored from a windowed
        checkpoint)."""
        return max(self.floors)

    def can_keep(self, k: int) -> bool:
        """Whether truncating to k tokens leaves a correct session: the next query (position
        k) of each windowed layer sees keys max(0, k - W + 1) .. k - 1, which that layer must
        hold."""
        k = min(k, len(self.tokens))
        if self.state is not None:
            return k in (0, len(self.tokens)) or k in self.marks
        return k == 0 or all(max(0, k - w + 1) >= f for w, f in zip(self.windows, self.floors) if w)

    @property
    def keep_from(self) -> int:
        """The shortest prefix > 0 that can_keep (0: every prefix), for the renderer's plan."""
        if self.state is not None:     # the marks say it (kept_marks)
            return 0
        return max((f + w - 1 for w, f in zip(self.windows, self.floors) if w and f), default=0)

    def rows(self, n: int) -> list[int]:
        """Rows per layer a checkpoint of n tokens holds (common.geometry.Geometry.rows)."""
        return [min(n, w) if w else n for w in self.windows]

    def can_export(self, n: int) -> bool:
        """Whether the session holds every row a checkpoint of its first n tokens stores (and
        the recurrent state there: at its length or a mark)."""
        if self.state is not None:
            return n == len(self.tokens) or (0 < n < len(self.tokens) and n in self.marks)
        return 0 <= n <= len(self.tokens) and all(n - r >= f for r, f in zip(self.rows(n), self.floors))

    def boundaries(self, start: int, end: int, split_at=()) -> list[int]:
        """Chunk ends from start to end: absolute multiples of chunk, plus split_at."""
        ends = set(range((start // self.chunk + 1) * self.chunk, end, self.chunk))
        ends |= {p for p in split_at if start < p < end}
        ends.add(end)
        return sorted(ends)

    @property
    def kept_marks(self) -> tuple[int, ...] | None:
        """The positions below its length a session with a recurrent state can be cut to (its
        marks; None for any other session), for the renderer's plan."""
        if self.state is None:
            return None
        return tuple(sorted(p for p in self.marks if p < len(self.tokens)))

    def state_at(self, n: int) -> Recurrent:
        """The recurrent state after the first n tokens: the current one or a mark's."""
        return self.state if n == len(self.tokens) else self.marks[n]

    def mark(self) -> None:
        """Keep a copy of the recurrent state at the current length (no-op without one)."""
        n = len(self.tokens)
        if self.state is None or n == 0:
            return
        st = self.marks.pop(n, None) or Recurrent.like(self.state)
        st.copy_(self.state)
        self.marks[n] = st                     # the newest last
        while len(self.marks) > MAX_MARKS:
            del self.marks[next(iter(self.marks))]

    def rewind(self, k: int) -> None:
        """Keep the first k tokens whatever can_keep says: cut to the longest prefix it can
        keep and prefill the tokens from there to k again (a recurrent state's session cut
        between its marks). The logits are those after token k."""
        if self.can_keep(k):
            self.truncate(k)
            return
        p = max((m for m in self.marks if m <= k), default=0)
        redo = self.tokens[p:k]
        self.truncate(p)
        self.prefill(redo)

    def prefill(self, ids: list[int], logits_at=(), split_at=(), on_chunk=None,
                _decode: bool = False, marks=()) -> dict[int, torch.Tensor]:
        """Append ids. Returns {n: logits after the first n tokens} for each n in logits_at
        within the new span; self.logits is the logits after the last token. marks: positions
        whose recurrent state to keep (mark), chunks split there."""
        start = len(self.tokens)
        end = start + len(ids)
        if end > self.n_ctx:
            raise ValueError(f"{end} tokens exceed the context of {self.n_ctx}")
        if not ids:
            return {}
        self.reserve(end)
        want = {n for n in logits_at if start < n <= end} | {end}
        out, lo = {}, start
        dev = self.model.device
        graphs = None if self.exact else self.model.graphs
        marks = {p for p in marks if start < p <= end} if self.state is not None else set()
        for hi in self.boundaries(start, end, set(split_at) | marks):
            need = sorted(n for n in want if lo < n <= hi)
            rows = [n - lo - 1 for n in need]
            logits = graphs.prefill(self, ids[lo - start:hi - start], rows) if graphs is not None else None
            if logits is None:       # torch's ops, or the native kernels
                chunk_ids = torch.tensor(ids[lo - start:hi - start], dtype=torch.long, device=dev)
                logits = self.model.forward(chunk_ids, lo, self.k, self.v, rows,
                                            pad_to=self.chunk if self.exact and not _decode else 0, state=self.state)
            for n, row in zip(need, logits):
                out[n] = row
            self.tokens.extend(ids[lo - start:hi - start])
            if hi in marks:
                self.mark()
            lo = hi
            if on_chunk is not None:
                on_chunk(hi - start, end - start)
        self.logits = out[end]
        return {n: v for n, v in out.items() if n in logits_at}

    def decode(self, token: int) -> torch.Tensor:
        """One token, as a prefill of one (on CUDA, the shortest prefill graph). A loop of
        steps goes through decode_many."""
        self.prefill([token], _decode=True)
        return self.logits

    def truncate(self, k: int) -> None:
        """Keep the first k tokens. Logits are unknown until a token is prefilled (None).
        Raises ValueError for a k the session cannot keep (can_keep)."""
        if k <= 0:
            self.floors = [0] * len(self.floors)
            if self.state is not None:
                self.state.reset()
                self.marks.clear()
        elif not self.can_keep(k):
            raise ValueError(f"cannot keep {k} tokens: " + ("a recurrent state is not rewound"
                             if self.state is not None else f"windowed layers hold no rows below {self.window_floor}"))
        if self.state is not None and 0 < k < len(self.tokens):   # a mark's state: can_keep
            self.state.copy_(self.marks[k])
        if self.state is not None:
            for p in [p for p in self.marks if p > k]:
                del self.marks[p]
        if k < len(self.tokens):
            del self.tokens[k:]
            self.logits = None
            self.cuts.append(k)
        if k < self.answer_from:
            self.answer_from = 0

    def export(self, n: int | None = None):
        """(tokens, K, V) of the first n tokens, copies: K and V are [layers, n, KV, D] for a
        model without windowed layers, else lists per layer of [rows(n)[l], KV, D] (the
        layer's last rows, positions n - rows .. n - 1)."""
        n = len(self.tokens) if n is None else n
        if self.state is not None:
            raise ValueError("a session with a recurrent state is checkpointed through disk.Disk.save")
        if not any(self.windows):
            k = self.k[:, :, :n].transpose(1, 2).contiguous()
            v = k if self.one_kv else self.v[:, :, :n].transpose(1, 2).contiguous()
            return list(self.tokens[:n]), k, v
        if not self.can_export(n):
            raise ValueError(f"the session does not hold the rows of a checkpoint of {n} tokens")
        rows = self.rows(n)
        k = [self.k[i, :, n - r:n].transpose(0, 1).contiguous() for i, r in enumerate(rows)]
        v = k if self.one_kv else [self.v[i, :, n - r:n].transpose(0, 1).contiguous() for i, r in enumerate(rows)]
        return list(self.tokens[:n]), k, v

    def import_(self, tokens: list[int], logits: torch.Tensor | None, k, v, state=None) -> None:
        """Replace the session by a checkpoint: K and V [layers, n, KV, D], or per layer
        [rows, KV, D] holding the layer's last rows (a global layer all n, a windowed one at
        least min(n, W)). The layers' floors follow from the rows. state: (convolution
        inputs, recurrent states) after the n tokens, each [linear layers, values], for a
        model with linear-attention layers (which also marks n)."""
        n = len(tokens)
        if n > self.n_ctx:
            raise ValueError("checkpoint larger than the context")
        if (self.state is None) != (state is None) or (state is not None and (
                state[0].numel() != self.state.conv.numel() or state[1].numel() != self.state.ssm.numel())):
            raise ValueError("the checkpoint's recurrent state does not fit the model's")
        rows = [x.shape[0] for x in k]
        need = self.rows(n)
        if len(rows) != len(need) or [x.shape[0] for x in v] != rows or \
                any(not need_l <= r <= n for r, need_l in zip(rows, need)):
            raise ValueError(f"checkpoint rows {rows} for {n} tokens; the model needs {need}")
        self.truncate(0)
        self.version, self.cuts = next(_VERSIONS), []
        self.reserve(n, huge=[li for li, r in enumerate(rows) if r == n] if self.huge_pages else ())
        if isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):   # all n rows: one copy
            self.k[:, :, :n] = k.to(self.k.device, self.k.dtype).transpose(1, 2)
            if not self.one_kv:     # (a checkpoint's V of latent attention: K's rows, or [c, 0] before)
                self.v[:, :, :n] = v.to(self.v.device, self.v.dtype).transpose(1, 2)
        else:
            for i, r in enumerate(rows):
                self.k[i, :, n - r:n] = k[i].to(self.k.device, self.k.dtype).transpose(0, 1)
                if not self.one_kv:
                    self.v[i, :, n - r:n] = v[i].to(self.v.device, self.v.dtype).transpose(0, 1)
        self.floors = [n - r for r in rows]
        self.tokens = list(tokens)
        if state is not None:
            self.state.conv.copy_(state[0].reshape(self.state.conv.shape))
            self.state.ssm.copy_(state[1].reshape(self.state.ssm.shape))
            self.mark()
        self.logits = None if logits is None else logits.to(self.model.device, torch.float32).clone()


def _runs(layers: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted layer indices as [a, b) runs of consecutive ones."""
    out: list[list[int]] = []
    for li in sorted(layers):
        if out and out[-1][1] == li:
            out[-1][1] = li + 1
        else:
            out.append([li, li + 1])
    return [(a, b) for a, b in out]
