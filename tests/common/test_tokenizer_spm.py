"""SentencePiece ("llama") tokenizers from GGUF files against llama.cpp.

Two halves: Gemma 3 270M's 262k vocabulary against llama.cpp's ids (tests/data/gemma3-270m-
q4_k_m.json, see its README), and a tiny hand-made SPM vocabulary written with the `gguf`
package, checked against a direct transcription of llama.cpp's algorithm (`reference_spm`
below), so tie-breaking, byte fallback and special-token cutting are tested without the big file.
"""
from __future__ import annotations

import json
import os
import random
import time

import pytest

from common.models import load_text
from tests.helpers import detokenize_cases
from common.tokenizer_spm import (BYTE, CONTROL, NORMAL, SPECIAL_TYPES, UNKNOWN, USER_DEFINED,
                                  fragment_tokens, merge_score_ties, special_overlaps,
                                  spm_merges, unreachable_by_bpe)

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA_VECTORS = os.path.join(DATA, "gemma3-270m-q4_k_m.json")


def gemma_path() -> str:
    from common.config import Settings
    return os.environ.get("RICORDO_TEST_GEMMA") or os.path.join(Settings().models_path(), GEMMA_FILE)


@pytest.fixture(scope="module")
def gemma():
    path = gemma_path()
    if not os.path.isfile(path):
        pytest.fail(f"Gemma 3 270M not found at {path}: run `ricordo fetch-model gemma3-270m`",
                    pytrace=False)
    t = time.perf_counter()
    tm = load_text(path)
    print(f"\nGemma 3 text side built in {time.perf_counter() - t:.2f} s")
    return tm


@pytest.fixture(scope="module")
def gemma_vectors():
    with open(GEMMA_VECTORS) as f:
        return json.load(f)


def cases(vectors):
    return [(c.get("name") or repr(c["text"][:30]), c["text"], c["token_ids"])
            for c in vectors["cases"] + vectors["tokenizer_cases"]]


def spm_text(text: str) -> bytes:
    """The bytes an SPM tokenization stands for: a U+2581 in the text is indistinguishable
    from a space once llama.cpp has escaped spaces, and comes back as one."""
    return text.replace("\u2581", " ").encode("utf-8")


# ------------------------------------------------------------------------- Gemma vs llama.cpp

def test_gemma_ids_match_llama_cpp(gemma, gemma_vectors):
    bad = [(name, got, ref) for name, text, ref in cases(gemma_vectors)
           if (got := gemma.encode(text)) != ref]
    assert not bad, f"{len(bad)} case(s) differ from llama.cpp: {bad[:2]}"
    assert len(cases(gemma_vectors)) >= 25


def test_gemma_piece_bytes_are_the_text_bytes(gemma, gemma_vectors):
    for name, text, ref in cases(gemma_vectors):
        assert gemma.piece_bytes(ref) == spm_text(text), name
    assert gemma.vocab_size == len(gemma.pieces) == 262144


def test_gemma_detokenizer_reconstructs_text(gemma, gemma_vectors):
    split_chars = detokenize_cases(gemma.pieces, cases(gemma_vectors), spm_text)
    assert split_chars > 10, "no case splits a multi-byte character into byte tokens"


def test_gemma_encode_bytes_special_ids(gemma, gemma_vectors):
    text = next(c for c in gemma_vectors["cases"] if c["name"] == "unicode_mix")
    assert gemma.encode(text["text"].encode()) == text["token_ids"]
    assert gemma.encode("") == [] and gemma.encode(b"") == []
    p = gemma.pieces
    assert gemma.bos_text() == b"<bos>" and p[gemma.eos_id] == b"<eos>"
    assert {b"<eos>", b"<end_of_turn>"} <= {p[i] for i in gemma.stop_ids}
    assert p[gemma.encode("<unused5>")[0]] == b"<unused5>"
    assert p[gemma.encode("\t\t")[0]] == b"\t\t"          # user-defined whitespace runs
    assert p[gemma.encode(" ")[0]] == b" "                 # "\u2581" is a space byte
    assert p[gemma.encode("\x01")[0]] == b"\x01"           # <0x01>: byte fallback


def test_gemma_vocabulary_has_no_known_divergence(gemma):
    """The two places where the BPE construction may differ from llama.cpp (see
    common/tokenizer_spm.py) do not occur in this vocabulary."""
    from common.gguf_file import GGUFFile
    m = GGUFFile(gemma_path()).meta
    tokens = [str(t) for t in m["tokenizer.ggml.tokens"]]
    types = m["tokenizer.ggml.token_type"].tolist()
    assert special_overlaps([t for t, ty in zip(tokens, types) if ty in SPECIAL_TYPES]) == []
    usable = fragment_tokens(tokens, types)
    assert unreachable_by_bpe(tokens, usable) == []
    scores = m["tokenizer.ggml.scores"].tolist()
    assert merge_score_ties(tokens, scores, spm_merges(tokens, scores, usable)) == []


def test_gemma_random_texts_match_llama_cpp(gemma):
    """Where llama-cpp-python is installed: random texts (glued vocabulary tokens, code points
    from several planes, special tokens) tokenized by llama.cpp itself (vocabulary only)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from common.gguf_file import GGUFFile
    llm = llama_cpp.Llama(gemma_path(), vocab_only=True, verbose=False)
    tokens = [str(t) for t in GGUFFile(gemma_path()).meta["tokenizer.ggml.tokens"]]
    rng = random.Random(11)
    extra = ["<start_of_turn>", "<end_of_turn>", "<unused5>", "<eos>", "  ", "\n\n", "\r\n", "\t"]

    def code_point():
        return chr(rng.choice([rng.randint(0x20, 0x7E), rng.randint(0xA0, 0x2FFF),
                               rng.randint(0x3000, 0xD7FF), rng.randint(0x10000, 0x2FFFF)]))
    bad = []
    for _ in range(3000):
        if rng.random() < 0.5:
            text = "".join(rng.choice(tokens) for _ in range(rng.randint(1, 8)))
            text = text.replace("\u2581", " ")
        else:
            text = "".join(code_point() for _ in range(rng.randint(0, 30)))
        if rng.random() < 0.3:
            text = text[:4] + rng.choice(extra) + text[4:]
        ref = llm.tokenize(text.encode(), add_bos=False, special=True) if text else []
        if gemma.encode(text) != ref:
            bad.append(text)
    assert not bad, f"{len(bad)} random texts differ from llama.cpp: {bad[:3]!r}"


# ------------------------------------------------------------- tiny vocabulary, reference algorithm

def reference_spm(text: str, tokens, scores, types, add_space_prefix: bool) -> list[int]:
    """llama.cpp's SPM tokenization, transcribed plainly (quadratic, for small tests)."""
    ids = {}
    for i, t in enumerate(tokens):
        ids.setdefault(t, i)
    specials = sorted((i for i, ty in enumerate(types) if ty in SPECIAL_TYPES),
                      key=lambda i: -len(tokens[i]))
    frags: list[str | int] = [text] if text else []
    for sid in specials:                       # longest first, every occurrence, left to right
        out = []
        for f in frags:
            while isinstance(f, str) and tokens[sid] in f:
                a, f = f.split(tokens[sid], 1)
                out += ([a] if a else []) + [sid]
            if not isinstance(f, str) or f:
                out.append(f)
        frags = out
    result, prev_special = [], True
    for f in frags:
        if isinstance(f, int):
            result.append(f)
            prev_special = True
            continue
        f = ((" " if add_space_prefix and prev_special else "") + f).replace(" ", "\u2581")
        prev_special = False
        syms = list(f)
        while True:
            best = None
            for i in range(len(syms) - 1):
                j = ids.get(syms[i] + syms[i + 1])
                if j is not None and (best is None or scores[j] > scores[ids[syms[best] + syms[best + 1]]]):
                    best = i
            if best is None:
                break
            syms[best:best + 2] = [syms[best] + syms[best + 1]]
        for s in syms:
            if s in ids:
                result.append(ids[s])
            else:
                result += [ids[f"<0x{b:02X}>"] for b in s.encode()]
    return result


def write_spm(path, tokens, scores, types, add_space_prefix=False) -> str:
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([float(s) for s in scores])
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return str(path)


BASE = [("<unk>", UNKNOWN), ("<s>", CONTROL), ("</s>", CONTROL), ("<sep>", USER_DEFINED),
        ("\n", USER_DEFINED), ("\n\n", USER_DEFINED), ("<ctl>", CONTROL)] + \
    [(f"<0x{b:02X}>", BYTE) for b in range(256)]


def tiny_vocab(normal: list[tuple[str, float]]):
    tokens = [t for t, _ in BASE] + [t for t, _ in normal]
    scores = [0.0] * len(BASE) + [s for _, s in normal]
    types = [ty for _, ty in BASE] + [NORMAL] * len(normal)
    return tokens, scores, types


def test_tie_same_token_leftmost_and_score_order(tmp_path):
    normal = [("a", -1), ("b", -2), ("c", -3), ("\u2581", -4), ("aa", -10), ("ab", -5),
              ("bc", -6), ("abc", -20), ("aab", -7)]
    tokens, scores, types = tiny_vocab(normal)
    tm = load_text(write_spm(tmp_path / "t.gguf", tokens, scores, types))
    ix = {t: i for i, t in enumerate(tokens)}
    # equal score (the same token twice): leftmost first, "aa" + "a"
    assert tm.encode("aaa") == [ix["aa"], ix["a"]]
    # "ab" (-5) beats "aa" (-10) though "aa" is further left; then "a"+"ab" -> "aab" (-7)
    assert tm.encode("aab") == [ix["aab"]]
    # "ab" (-5) before "bc" (-6): "ab" + "c", and "abc" is reachable from ("ab", "c")
    assert tm.encode("abc") == [ix["abc"]]
    for text in ["aaa", "aab", "abc", "aabcbc a", "cba\n\nab<sep>aa<ctl>b\nc", ""]:
        assert tm.encode(text) == reference_spm(text, tokens, scores, types, False), text


def test_byte_fallback_and_user_defined(tmp_path):
    tokens, scores, types = tiny_vocab([("a", -1), ("\u2581", -2), ("\u2581a", -3)])
    tm = load_text(write_spm(tmp_path / "t.gguf", tokens, scores, types))
    ix = {t: i for i, t in enumerate(tokens)}
    assert tm.encode("é a") == [ix["<0xC3>"], ix["<0xA9>"], ix["\u2581a"]]
    assert tm.encode("a<sep>a") == [ix["a"], ix["<sep>"], ix["a"]]
    assert tm.encode("\n\n\n") == [ix["\n\n"], ix["\n"]]      # longest special first
    assert tm.pieces[ix["<0xC3>"]] == b"\xc3" and tm.pieces[ix["\u2581a"]] == b" a"
    assert tm.pieces[ix["<ctl>"]] == b"<ctl>" and tm.bos_text() == b"<s>"
    for text in ["é a", "a<sep>a", "\n\n\n", "  a  ", "🙂<ctl>a"]:
        assert tm.piece_bytes(tm.encode(text)) == text.encode(), text


@pytest.mark.parametrize("add_space_prefix", [False, True])
def test_random_texts_match_reference(tmp_path, add_space_prefix):
    """Random vocabularies of substrings with distinct scores (ties between different tokens
    of equal score are the documented difference) against the transcription of llama.cpp."""
    rng = random.Random(7 + add_space_prefix)
    alphabet = "ab c\u2581xé"          # "ü" and "🙂" below are in no token: byte fallback
    for round_ in range(6):
        chars = list(dict.fromkeys(alphabet.replace(" ", "")))
        pieces = set(chars)
        while len(pieces) < 60:
            n = rng.randint(2, 5)
            pieces.add("".join(rng.choice(chars) for _ in range(n)))
        pieces = sorted(pieces)
        rng.shuffle(pieces)
        normal = [(p, -float(i)) for i, p in enumerate(pieces)]
        tokens, scores, types = tiny_vocab(normal)
        tm = load_text(write_spm(tmp_path / f"r{round_}.gguf", tokens, scores, types,
                                 add_space_prefix))
        for _ in range(150):
            text = "".join(rng.choice(alphabet + "ü🙂\n") for _ in range(rng.randint(0, 24)))
            if rng.random() < 0.3:
                text = text[:5] + rng.choice(["<sep>", "<ctl>", "\n\n", "<s>"]) + text[5:]
            want = reference_spm(text, tokens, scores, types, add_space_prefix)
            assert tm.encode(text) == want, (text, pieces)
            if not add_space_prefix:     # with it, each fragment gains a leading space
                assert tm.piece_bytes(want) == spm_text(text), text


def test_unreachable_and_overlap_reports():
    # "éa" can be formed by llama.cpp from "é" + "a" though "é" is no token; BPE cannot
    assert unreachable_by_bpe(["a", "éa", "b"], [True] * 3) == ["éa"]
    assert special_overlaps(["<a>", "\n\n", "\n"]) == []
    assert ("xyz", "zw") in special_overlaps(["xyz", "zw"])
    tokens, scores = ["a", "b", "ab", "ba", "aa"], [-1.0, -2.0, -5.0, -5.0, -6.0]
    merges = spm_merges(tokens, scores, [True] * 5)
    assert merges == [("a", "b"), ("b", "a"), ("a", "a")]      # score, then id
    assert merge_score_ties(tokens, scores, merges) == [["ab", "ba"]]


def test_equal_scores_of_different_tokens_are_the_known_difference(tmp_path):
    """Documented limitation: "ab" and "ba" share a score; on "aba" llama.cpp merges the
    leftmost pair ("ab" + "a"), BPE the pair listed first (by id: "ba" here, "a" + "ba").
    `merge_score_ties` flags such vocabularies; Gemma 3 has no ties."""
    tokens, scores, types = tiny_vocab([("a", -1), ("b", -2), ("ba", -5), ("ab", -5)])
    tm = load_text(write_spm(tmp_path / "t.gguf", tokens, scores, types))
    ix = {t: i for i, t in enumerate(tokens)}
    assert reference_spm("aba", tokens, scores, types, False) == [ix["ab"], ix["a"]]
    assert tm.encode("aba") == [ix["a"], ix["ba"]]


def test_gemma_grammar_allows_user_defined_text_tokens(gemma):
    """Under a grammar, Gemma's USER_DEFINED tokens ("\n", runs of spaces) stay text tokens:
    llguidance must not treat them as special, or the model could write no newline but <0x0A>."""
    import numpy as np
    import llguidance
    from common import guidance
    m = llguidance.LLMatcher(guidance.tokenizer(gemma),
                             llguidance.LLMatcher.grammar_from_lark('start: "a" /[ \\n]+/ "b"'),
                             log_level=0)
    assert m.consume_token(gemma.encode("a")[0])
    bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
    for text in ["\n", "\n\n", "  ", " "]:
        assert bits[gemma.encode(text)[0]], repr(text)
    assert not bits[gemma.encode("<end_of_turn>")[0]]
