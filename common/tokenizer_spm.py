"""SentencePiece ("llama") vocabularies from a GGUF, tokenized the way llama.cpp does it.

llama.cpp's SPM tokenizer (src/llama-vocab.cpp), in outline:
1. CONTROL, USER_DEFINED and UNKNOWN token texts are cut out of the raw text first (special
   tokens parsed), longest text first; each becomes its own id. What is left are fragments.
2. In each fragment " " becomes "▁" (U+2581); with `add_space_prefix` a "▁" is put in front of
   a fragment that starts the text or follows a special token.
3. The fragment is split into characters; repeatedly the adjacent pair whose concatenation is a
   vocabulary token of the highest score is merged (equal scores: the leftmost pair first).
   Any token of the vocabulary may be the result of a merge, whatever its type.
4. A final symbol that is not a token (a character outside the vocabulary) becomes its UTF-8
   bytes as byte tokens `<0xNN>`.

Here that is a `tokenizers` BPE with no pre-tokenizer: its merges are every split (a, b) of a
token t into two tokens that can occur in a fragment, ranked by t's score (highest first; equal
scores by token id, then split point). BPE applies the lowest-ranked available pair and breaks
ties by position, leftmost first, like llama.cpp, so the two agree except where two *different*
merges of *equal* score compete for one symbol: llama.cpp takes the leftmost, BPE the one
listed first (`merge_score_ties` lists the candidates; Gemma 3 has none). Step 1 is
`tokenizers`' added tokens (leftmost-longest matching rather than longest-first); the two agree
unless a special text's suffix is another's prefix (or one contains another): `special_overlaps`
lists such pairs so a test can check a vocabulary. Step 2 is a normalizer that only touches
fragments; step 4 is the BPE's byte fallback. Not reproduced: the lstrip/rstrip attributes
llama.cpp gives special tokens of a few models by name (Phi-3, some Jina/BERT models).

A text containing U+2581 itself cannot round-trip: after step 2 it is the same as a space, and
llama.cpp (and these pieces) give it back as a space.

Invariant kept (see common/tokenizer.py): pieces[id] is the exact bytes of id: "▁" is a space
byte in normal tokens, `<0xNN>` is the byte NN, special and user-defined tokens are their text.
"""
from __future__ import annotations

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPECIAL_TYPES = (UNKNOWN, CONTROL, USER_DEFINED)    # cut out of the text before merging
SPACE = "\u2581"


def _byte_value(text: str) -> int | None:
    """The byte a `<0xNN>` token stands for, else None."""
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return int(text[3:5], 16)
        except ValueError:
            return None
    return None


def pieces_of(tokens: list[str], types) -> list[bytes]:
    """The bytes each id stands for, as llama.cpp's token_to_piece gives them with special
    tokens rendered (UNUSED tokens, which llama.cpp renders as nothing, keep their text so
    that a text containing it still round-trips)."""
    pieces = []
    for t, ty in zip(tokens, types):
        ty = int(ty)
        b = _byte_value(t) if ty == BYTE else None
        if b is not None:
            pieces.append(bytes([b]))
        elif ty == NORMAL:
            pieces.append(t.replace(SPACE, " ").encode("utf-8"))
        else:
            pieces.append(t.encode("utf-8"))
    return pieces


_P = np.uint64(0x100000001B3)          # odd, so invertible modulo 2**64
_LEN_SALT = np.uint64(0x9E3779B97F4A7C15)


def spm_merges(tokens: list[str], scores, usable) -> list[tuple[str, str]]:
    """Every way a token can be made from two tokens, best score first.

    Order: the merged token's score, highest first; equal scores by the merged token's id,
    then by split point. Only tokens with `usable[i]` (those that can occur in a fragment)
    are merged or used as halves; the rest can never be a symbol, so no merge of theirs fires.

    Vectorized (a Python loop over the ~1.2 M splits of a 262k vocabulary takes seconds):
    each prefix and suffix of each token gets a 64-bit polynomial hash, looked up among the
    hashes of whole tokens; every hit is then checked character by character, so a hash
    collision can cost a merge's discovery but never produce a wrong merge."""
    n = len(tokens)
    if not n:
        return []
    lens = np.fromiter(map(len, tokens), dtype=np.int64, count=n)
    # all texts as one array of code points; token t is codes[off[t]:off[t] + lens[t]]
    codes = np.frombuffer("".join(tokens).encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    off = np.zeros(n, dtype=np.int64)
    np.cumsum(lens[:-1], out=off[1:])
    ok = np.asarray(usable, dtype=bool) & (lens > 0)
    with np.errstate(over="ignore"):
        # hash(codes[s:e]) = (h[e] - h[s]) * P**-s  (+ a salt times the length), modulo 2**64
        powers = np.full(len(codes) + 1, _P, dtype=np.uint64)
        powers[0] = 1
        np.multiply.accumulate(powers, out=powers)
        inv_powers = np.full(len(codes) + 1, np.uint64(pow(int(_P), -1, 1 << 64)), dtype=np.uint64)
        inv_powers[0] = 1
        np.multiply.accumulate(inv_powers, out=inv_powers)
        h = np.zeros(len(codes) + 1, dtype=np.uint64)
        np.cumsum(codes.astype(np.uint64) * powers[:-1], out=h[1:])

        def sub_hash(start, length):
            return ((h[start + length] - h[start]) * inv_powers[start]
                    + length.astype(np.uint64) * _LEN_SALT)
        # the first id of each text, as llama.cpp's token_to_id (np.unique keeps the first)
        cand = np.flatnonzero(ok)
        keys, first = np.unique(sub_hash(off[cand], lens[cand]), return_index=True)
        key_ids = cand[first]
        found = []                                               # (token, split, left, right)
        for k in range(1, int(lens.max())):
            rows = np.flatnonzero(ok & (lens > k))
            left, hit = _lookup(keys, key_ids, sub_hash(off[rows], np.full(len(rows), k)))
            rows, left = rows[hit], left[hit]
            right, hit = _lookup(keys, key_ids, sub_hash(off[rows] + k, lens[rows] - k))
            found.append(np.stack([rows[hit], np.full(int(hit.sum()), k), left[hit], right[hit]]))
    if not found:
        return []
    f = np.concatenate(found, axis=1)
    f = f[:, _exact(f, codes, off, lens)]      # a hash collision may not make a wrong merge
    sc = np.asarray(scores, dtype=np.float64)[f[0]]
    f = f[:, np.lexsort((f[1], f[0], -sc))]
    get = tokens.__getitem__
    return list(zip(map(get, f[2].tolist()), map(get, f[3].tolist())))


def _exact(f, codes, off, lens):
    """For each (t, k, a, b) column of f: tokens[a] + tokens[b] == tokens[t], by characters."""
    t, k, a, b = f
    ok = (lens[a] == k) & (lens[b] == lens[t] - k)
    n = lens[t]
    start = np.zeros(len(t), dtype=np.int64)
    np.cumsum(n[:-1], out=start[1:])
    j = np.arange(int(n.sum())) - np.repeat(start, n)            # position inside t
    ti, ki, ai, bi = (np.repeat(x, n) for x in (t, k, a, b))
    other = np.where(j < ki, off[ai] + j, off[bi] + np.minimum(j - ki, lens[bi] - 1).clip(0))
    same = codes[off[ti] + j] == codes[other]
    bad = np.bincount(np.repeat(np.arange(len(t)), n)[~same], minlength=len(t))
    return ok & (bad == 0)


def _lookup(keys, key_ids, h):
    pos = np.minimum(np.searchsorted(keys, h), len(keys) - 1)
    return key_ids[pos], keys[pos] == h


def unreachable_by_bpe(tokens: list[str], usable) -> list[str]:
    """Tokens llama.cpp can form in a fragment only through a character that is not itself a
    token (llama.cpp merges such characters; BPE turns them into bytes first). Empty for
    every vocabulary we ship tests for; a non-empty list means ids may differ."""
    vocab = set(tokens)
    return [t for t, u in zip(tokens, usable) if u and len(t) > 1
            and any(c not in vocab for c in t)]


def merge_score_ties(tokens: list[str], scores, merges) -> list[list[str]]:
    """Groups of different merge results with one score: the only merges whose order among
    themselves can differ from llama.cpp's (which takes the leftmost pair of equal score;
    BPE takes the one listed first). Empty for Gemma 3: its scores are distinct."""
    index = {}
    for i, t in enumerate(tokens):
        index.setdefault(t, i)
    groups: dict[float, set[str]] = {}
    for a, b in merges:
        groups.setdefault(float(scores[index[a + b]]), set()).add(a + b)
    return [sorted(g) for g in groups.values() if len(g) > 1]


def special_overlaps(texts: list[str]) -> list[tuple[str, str]]:
    """Pairs of special texts where longest-first cutting (llama.cpp) and leftmost-longest
    matching (`tokenizers`) can disagree: one text inside another, or a proper suffix of one
    equal to a proper prefix of the other. Runs of a single repeated character (Gemma's
    whitespace tokens) are left out: on a run both methods take the longest token first."""
    def run(t):
        return len(set(t)) == 1
    out = []
    by_first: dict[str, list[str]] = {}
    for t in texts:
        by_first.setdefault(t[0], []).append(t)
    for a in texts:
        for k in range(1, len(a)):
            for b in by_first.get(a[k], ()):
                if b is a or (run(a) and run(b) and a[0] == b[0]):
                    continue
                tail = a[k:]
                if b.startswith(tail) or tail.startswith(b):
                    out.append((a, b))
    return out


def fragment_tokens(tokens: list[str], types) -> list[bool]:
    """Which tokens can be a symbol inside a fragment. Not: a text with an ASCII space (a
    fragment has "▁" instead), nor one containing a one-character special text such as
    Gemma's "\n" or "\t" (cut out before merging). Only a pruning: a merge that cannot fire
    changes nothing, leaving it out saves build time."""
    cut = {t for t, ty in zip(tokens, types) if len(t) == 1 and int(ty) in SPECIAL_TYPES}
    cut.add(" ")
    return [cut.isdisjoint(t) for t in tokens]


def build(meta: dict) -> tuple[Tokenizer, list[bytes]]:
    tokens = [str(t) for t in meta["tokenizer.ggml.tokens"]]
    n = len(tokens)
    scores = meta.get("tokenizer.ggml.scores")
    scores = list(scores) if scores is not None else [0.0] * n
    types = meta.get("tokenizer.ggml.token_type")
    types = [int(t) for t in types] if types is not None else [NORMAL] * n
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))   # llama.cpp's default

    usable = fragment_tokens(tokens, types)
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    bpe = models.BPE(vocab=vocab, merges=spm_merges(tokens, scores, usable),
                     byte_fallback=True, fuse_unk=False, ignore_merges=False)
    tok = Tokenizer(bpe)
    norm = [normalizers.Replace(" ", SPACE)]
    if add_prefix:
        # a fragment after a special token gets the prefix too, as in llama.cpp, because
        # `tokenizers` normalizes each fragment between added tokens separately
        norm.insert(0, normalizers.Prepend(SPACE))
    tok.normalizer = normalizers.Sequence(norm)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    # all of them are cut out of the raw text (normalized=False: matched before the space
    # escaping); USER_DEFINED ones (Gemma's "\n", whitespace runs) are ordinary text, so they
    # are not flagged special, which lets a consumer tell them from control tokens
    tok.add_tokens([AddedToken(tokens[i], special=types[i] != USER_DEFINED, normalized=False)
                    for i in range(n) if types[i] in SPECIAL_TYPES])
    return tok, pieces_of(tokens, types)
