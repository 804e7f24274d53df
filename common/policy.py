"""When checkpoints are written and which entries are evicted (docs/kv-format.md sections 6
and 8). Pure arithmetic on token counts and file metadata: no I/O, no settings; the caller
passes the option values (ds4-server's defaults: min 512, cold max 30000, align 2048, trim 32,
continued interval 10000)."""
from __future__ import annotations


def _check(align: int, trim: int = 0) -> None:
    if align < 1 or trim < 0:
        raise ValueError(f"align must be >= 1 and trim >= 0 (align {align}, trim {trim})")


def cold_position(n_prompt: int, reused: int, min_tokens: int, cold_max: int,
                  align: int, trim: int) -> int | None:
    """Where the cold checkpoint of a prompt of n_prompt tokens goes, or None for no save.

    None unless min_tokens <= n_prompt <= cold_max (both inclusive). The position is the
    multiple of align at or below n_prompt, minus trim (10500 -> 10240 - 32 = 10208); when
    that is below min_tokens, n_prompt - trim if that reaches min_tokens, else None. None as
    well when the position is not beyond `reused` (the tokens the request took over from the
    live session or a restored checkpoint: a checkpoint there would add nothing)."""
    _check(align, trim)
    if not min_tokens <= n_prompt <= cold_max:
        return None
    pos = n_prompt // align * align - trim
    if pos < min_tokens:
        pos = n_prompt - trim
        if pos < min_tokens:
            return None
    return pos if pos > reused and pos > 0 else None


def prefix_position(prefix_end: int, n_prompt: int, reused: int, min_tokens: int,
                    cold_max: int) -> int | None:
    """The extra cold checkpoint at the end of the leading system/tool-schema part (section 6,
    beyond ds4-server): prefix_end itself (no alignment or trim: the part ends at a rendered
    message boundary), when the prompt qualifies for a cold save (min_tokens <= n_prompt <=
    cold_max), the part alone reaches min_tokens, and it lies beyond `reused`."""
    if not min_tokens <= n_prompt <= cold_max:
        return None
    if min_tokens <= prefix_end <= n_prompt and prefix_end > reused and prefix_end > 0:
        return prefix_end
    return None


def frontier(i: int, interval: int, align: int) -> int:
    """The i-th continued frontier (i >= 1): i * interval rounded up to a multiple of align."""
    return -(-(i * interval) // align) * align


def continued_frontiers(start: int, end: int, interval: int, align: int,
                        last_stored: int) -> list[int]:
    """The continued checkpoints due while the live session grows from start to end tokens:
    every frontier f (10000 -> 10240, 20000 -> 20480, 30000 -> 30720 with the defaults) with
    start < f <= end and f > last_stored, ascending and distinct (with interval < align two
    multiples can round to the same frontier). interval <= 0 disables continued saves."""
    _check(align)
    if interval <= 0:
        return []
    lo = max(start, last_stored)
    out: list[int] = []
    i = max(1, (lo - align) // interval)          # frontier(i) < i*interval + align
    while True:
        f = frontier(i, interval, align)
        if f > end:
            return out
        if f > lo and (not out or out[-1] != f):
            out.append(f)
        i += 1


def should_evict_save(live_len: int, keep: int, min_tokens: int, already_on_disk: bool) -> bool:
    """Whether to save the whole live session (live_len tokens) before the next request keeps
    only its first `keep` tokens: yes when the part that would be lost (live_len - keep)
    reaches min_tokens, unless a checkpoint of exactly this state is already on disk."""
    return not already_on_disk and live_len - max(keep, 0) >= max(min_tokens, 1)


def lru_victims(entries, budget_bytes: int, keep=frozenset()) -> list[str]:
    """Entries to delete so that the total size fits budget_bytes.

    entries: iterable of (name, size, last_used, created). Returns names, in deletion order:
    1. every entry whose size alone exceeds the budget (it can never fit), whether or not
       in `keep`, least recently used first;
    2. then entries not in `keep`, least recently used first (last_used, then created, then
       name for a stable order), until the remaining total is <= budget_bytes.
    An entry in `keep` (the one just written, one being restored) is therefore never a victim
    unless it alone exceeds the budget. If the kept entries together still exceed the budget
    after step 2, they stay and the total remains above it. [] when already within budget."""
    rows = sorted(entries, key=lambda e: (e[2], e[3], e[0]))
    total = sum(e[1] for e in rows)
    if total <= budget_bytes:
        return []
    out = []
    for name, size, _, _ in rows:
        if size > budget_bytes:
            out.append(name)
            total -= size
    for name, size, _, _ in rows:
        if total <= budget_bytes:
            break
        if size <= budget_bytes and name not in keep:
            out.append(name)
            total -= size
    return out


PREFIX_BLOCK = 256   # ids compared a slice at a time (in C) before the one that differs


def common_prefix(a, b) -> int:
    """Length of the common prefix of two sequences of token ids (a list against a tuple
    too): block by block, each block's compare in C, then id by id in the block that
    differs."""
    n = min(len(a), len(b))
    same = type(a) is type(b)
    i = 0
    while i < n:
        j = min(i + PREFIX_BLOCK, n)
        x, y = a[i:j], b[i:j]
        if not (x == y if same else tuple(x) == tuple(y)):
            break
        i = j
    while i < n and a[i] == b[i]:
        i += 1
    return i
