"""Text side of the default model against llama.cpp: token ids, piece bytes, the incremental
detokenizer, the chat template; and the GGUF reader / model resolution error paths."""
from __future__ import annotations

import os
import struct

import pytest

from common.detok import Detokenizer
from common.gguf_file import GGUFError, GGUFFile
from common.models import ModelError, load_text, resolve
from tests.helpers import detokenize_cases


def all_cases(vectors):
    return [(c.get("name") or c["text"][:30], c["text"], c["token_ids"])
            for c in vectors["cases"] + vectors["tokenizer_cases"]]


def test_token_ids_match_llama_cpp(text_model, vectors):
    bad = []
    for name, text, ref in all_cases(vectors):
        got = text_model.encode(text)
        if got != ref:
            bad.append((name, got, ref))
    assert not bad, f"{len(bad)} case(s) differ from llama.cpp: {bad[:2]}"


def test_encode_bytes_and_empty(text_model, vectors):
    text = vectors["cases"][4]["text"]          # several scripts, emoji
    assert text_model.encode(text.encode()) == vectors["cases"][4]["token_ids"]
    assert text_model.encode("") == [] and text_model.encode(b"") == []


def test_piece_bytes_are_the_text_bytes(text_model, vectors):
    for name, text, ref in all_cases(vectors):
        assert text_model.piece_bytes(ref) == text.encode("utf-8"), name
    assert text_model.vocab_size == len(text_model.pieces) == 49152


def test_detokenizer_reconstructs_text(text_model, vectors):
    split_chars = detokenize_cases(text_model.pieces, all_cases(vectors), str.encode)
    assert split_chars > 10, "no case splits a multi-byte character across tokens"


def test_detokenizer_holds_partial_char_and_flushes_invalid(text_model):
    d = Detokenizer(text_model.pieces)
    ids = text_model.encode("🙂")
    assert len(ids) > 1                          # a 4-byte char in several byte tokens
    assert [d.push(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.push(ids[-1]) == "🙂"
    # a lone lead byte at the end is flushed as a replacement char, not lost or raised
    lead = text_model.pieces.index(b"\xf0")
    assert d.push(lead) == ""
    assert d.flush() == "\ufffd" and d.flush() == ""


def test_chat_template_renders_reference(text_model, vectors):
    msgs = [{"role": "user", "content": "Ciao"},
            {"role": "assistant", "content": "Ciao! How can I help you today?"},
            {"role": "user", "content": "Come stai?"}]
    assert text_model.render_chat(msgs) == vectors["cases"][0]["text"]   # default system prompt


def test_special_ids(text_model):
    p = text_model.pieces
    assert p[text_model.eos_id] == b"<|im_end|>"
    assert {p[i] for i in text_model.stop_ids} == {b"<|im_end|>", b"<|endoftext|>"}
    assert text_model.bos_text() == b""          # SmolLM2: add_bos_token false


# ------------------------------------------------------------------ GGUF reader / resolution

def test_gguf_reader(model_path):
    g = GGUFFile(model_path)
    assert g.version == 3 and g.arch() == "llama"
    emb = g.tensors["token_embd.weight"]
    assert emb.shape == (576, 49152)
    assert g.raw("token_embd.weight").nbytes == emb.nbytes
    assert int(g.meta["llama.block_count"]) == 30


def _write(path, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


@pytest.mark.parametrize("data", [
    b"",                                                    # empty
    bytes(range(256)) * 4,                                  # junk
    b"GGUF",                                                # header cut short
    b"GGUF" + struct.pack("<I", 9) + bytes(16),             # unknown version
    b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1 << 40),   # key past EOF
    b"GGUF" + struct.pack("<IQQ", 3, 1 << 40, 0),           # implausible counts
], ids=["empty", "junk", "short", "version", "key-past-eof", "counts"])
def test_gguf_reader_rejects_bad_files(tmp_path, data):
    p = _write(tmp_path / "bad.gguf", data)
    with pytest.raises(GGUFError):
        GGUFFile(p)
    with pytest.raises(ModelError):
        load_text(p)


def test_load_text_rejects_gguf_without_tokenizer(tmp_path):
    p = _write(tmp_path / "bare.gguf", b"GGUF" + struct.pack("<IQQ", 3, 0, 0))
    with pytest.raises(ModelError, match="tokenizer"):
        load_text(p)


def test_resolve(tmp_path, model_path):
    assert resolve(model_path, str(tmp_path)) == model_path
    with pytest.raises(ModelError, match="not found"):
        resolve(str(tmp_path / "nope.gguf"), str(tmp_path))
    with pytest.raises(ModelError, match="fetch-model smollm2-135m"):   # default model missing: a hint
        resolve("", str(tmp_path))
    with pytest.raises(ModelError, match="fetch-model gemma3-270m"):    # a catalogue name, not fetched
        resolve("gemma3-270m", str(tmp_path))
    (tmp_path / "gemma-3-270m-q4_k_m.gguf").write_bytes(b"")
    assert resolve("gemma3-270m", str(tmp_path)) == str(tmp_path / "gemma-3-270m-q4_k_m.gguf")
    os.mkdir(tmp_path / "dir")
    with pytest.raises(ModelError, match="tokenizer.json"):
        load_text(str(tmp_path / "dir"))


def test_qwen2_pre_tokenizer_matches_tokenizer_json(tmp_path):
    """A GGUF with tokenizer.ggml.pre "qwen2" (Qwen2, Qwen3) splits like Qwen's own
    tokenizer.json regex: digits one at a time (llama3 takes up to three), contractions
    any case. Merges that join digits or letters across those splits make a wrong split
    show in the ids."""
    gguf = pytest.importorskip("gguf")
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from common.tokenizer import _byte_decoder
    chars = sorted(_byte_decoder(), key=_byte_decoder().get)          # byte order
    merges = [("1", "2"), ("12", "3"), ("'", "S"), ("Ġ", "4"), ("a", "b"), ("Ċ", "Ċ"), ("Ġ", "!")]
    tokens = chars + [a + b for a, b in merges]

    def gguf_tokenizer(pre: str):
        path = str(tmp_path / f"{pre}.gguf")
        w = gguf.GGUFWriter(path, "qwen2")
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types([1] * len(tokens))
        w.add_token_merges([f"{a} {b}" for a, b in merges])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.close()
        return load_text(path).tokenizer
    ours = gguf_tokenizer("qwen2")
    ref = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    ref.pre_tokenizer = pre_tokenizers.Sequence([   # Qwen2.5's tokenizer.json, verbatim
        pre_tokenizers.Split(Regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                                   r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
                             behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    ref.decoder = decoders.ByteLevel()
    for text in ["123 1234 ab's IT'S x 4!", "a\n\n\nb  12\t3 !!", "ünïcödé 42 'S'", ""]:
        got, want = ours.encode(text).ids, ref.encode(text).ids
        assert got == want, text
    # the merges make a wrong split visible: llama3's regex keeps "123" whole
    assert gguf_tokenizer("llama3").encode("123").ids == [tokens.index("123")]
    assert ours.encode("123").ids == [tokens.index(c) for c in "123"]


def _o200k_pattern() -> str:
    """tiktoken's own o200k pattern (gpt-oss's o200k_harmony uses it), read without fetching
    the vocabulary its constructor would download."""
    tiktoken_ext = pytest.importorskip("tiktoken_ext.openai_public")
    real = tiktoken_ext.load_tiktoken_bpe
    tiktoken_ext.load_tiktoken_bpe = lambda *a, **k: {}
    try:
        return tiktoken_ext.o200k_harmony()["pat_str"]
    finally:
        tiktoken_ext.load_tiktoken_bpe = real


def test_gpt4o_pre_tokenizer_splits_as_tiktoken(tmp_path):
    """A GGUF with tokenizer.ggml.pre "gpt-4o" (gpt-oss) splits text where tiktoken's o200k
    pattern does (the regex module, as tiktoken's Python reference): camel case apart,
    contractions on their word, digits by three, slashes and newlines after punctuation."""
    gguf = pytest.importorskip("gguf")
    regex = pytest.importorskip("regex")
    from common.tokenizer import _byte_decoder
    chars = sorted(_byte_decoder(), key=_byte_decoder().get)
    path = str(tmp_path / "o200k.gguf")
    w = gguf.GGUFWriter(path, "gpt-oss")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o")
    w.add_token_list(chars)
    w.add_token_types([1] * len(chars))
    w.add_token_merges([])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    tok = load_text(path).tokenizer
    pattern = regex.compile(_o200k_pattern())
    byte_of = _byte_decoder()
    texts = ["HelloWorld's IT'S CamelCASEWord x 1234567 a/b//\n\nc", "ünïcödé ÜBER straße 42.5%",
             "def f(x):\n    return x  # ok\r\n\t\tdone  ", "日本語のテキスト, 中文!", "'s 's'S  \n \n"]
    for text in texts:
        want = pattern.findall(text)
        got = [bytes(byte_of[c] for c in piece).decode("utf-8")
               for piece, _ in tok.pre_tokenizer.pre_tokenize_str(text)]
        assert got == want, text
        assert "".join(want) == text
    assert pattern.findall("HelloWorld") == ["Hello", "World"]   # what tells it from llama3's


def _tekken_gguf(path: str):
    """Mistral's tekken.json (mistral-common's copy: Nemo, Small 3, Devstral) in a GGUF as
    llama.cpp's converter writes one: gguf's MistralVocab for the pieces, types and merges,
    tokenizer.ggml.pre "tekken", no add_bos_token key. Returns mistral-common's encoder."""
    import pathlib
    import shutil
    import gguf
    from gguf.vocab import MistralVocab
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer
    src = pathlib.Path(__import__("mistral_common").__file__).parent / "data" / "tekken_240911.json"
    d = pathlib.Path(path).parent / "tekken"
    d.mkdir()
    shutil.copy(src, d / "tekken.json")
    v = MistralVocab(d)
    toks, types = zip(*((t, int(ty)) for t, _, ty in v.all_tokens()))
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("tekken")
    w.add_token_list(list(toks))
    w.add_token_types(list(types))
    w.add_token_merges(v.extract_vocab_merges_from_model())
    w.add_bos_token_id(v.bos_id)
    w.add_eos_token_id(v.eos_id)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return Tekkenizer.from_file(str(d / "tekken.json"))


def test_tekken_ids_equal_mistral_common(tmp_path):
    """A tekken GGUF (tokenizer.ggml.pre "tekken") encodes as Mistral's own Tekkenizer:
    camel case apart, digits one by one, no contractions, bytes of any script; control
    tokens in the text ([INST], [TOOL_CALLS]) are single ids; BOS by default, as llama.cpp."""
    import random
    ref = _tekken_gguf(str(tmp_path / "tekken.gguf"))
    tm = load_text(str(tmp_path / "tekken.gguf"))
    texts = ["HelloWorld's IT'S CamelCASEWord x 1234567 a/b//\n\nc", "ünïcödé ÜBER straße 42.5%",
             "def f(x):\n    return x  # ok\r\n\t\tdone  ", "日本語のテキスト, 中文!", "'s 's'S  \n \n",
             "emoji 🤖🎉 and ZWJ 👩\u200d💻", "  leading", "class Foo(Bar):\n    self.x = {'a': [1, 2]}\n"]
    rng = random.Random(5)
    alpha = "abcXYZ éÜß日本 \n\t0123456789.,;:!?'\"/\\-_()[]{}<>@#$%^&*+=~`|🤖"
    texts += ["".join(rng.choice(alpha) for _ in range(rng.randint(1, 60))) for _ in range(200)]
    for text in texts:
        assert tm.encode(text) == ref.encode(text, bos=False, eos=False), text
        assert b"".join(tm.pieces[i] for i in tm.encode(text)) == text.encode()
    assert tm.encode("HelloWorld") == ref.encode("HelloWorld", bos=False, eos=False)
    assert len(tm.encode("2025")) == 4                     # what tells it from o200k's split
    inst = tm.encode("[INST]hi[/INST]")
    assert inst[0] == ref.get_special_token("[INST]") and inst[-1] == ref.get_special_token("[/INST]")
    assert tm.add_bos and tm.bos_id == ref.bos_id and ref.eos_id in tm.stop_ids


def test_piece_bytes_of_a_tuple_is_remembered_and_bounded(text_model):
    """The resident sessions' ids (tuples) are asked for their bytes at every plan: the same
    tuple gives the same bytes object back; a list, or another tuple of the same ids, is
    joined again; at most TEXT_CACHE_SIZE tuples are held."""
    from common.tokenizer import TEXT_CACHE_MIN, TEXT_CACHE_SIZE
    ids = tuple(text_model.encode("a resident session, " * 400))
    assert len(ids) >= TEXT_CACHE_MIN
    first = text_model.piece_bytes(ids)
    assert text_model.piece_bytes(ids) is first
    assert text_model.piece_bytes(list(ids)) == first and text_model.piece_bytes(list(ids)) is not first
    assert text_model.piece_bytes(tuple(list(ids))) == first
    many = [ids + (i,) for i in range(TEXT_CACHE_SIZE + 5)]
    for t in many:
        assert text_model.piece_bytes(t) == first + text_model.pieces[t[-1]]
    assert len(text_model._texts) <= TEXT_CACHE_SIZE


def _bytes_gguf(path: str, arch: str, pre: str, extra: list[str], ids: dict[str, int]) -> None:
    """A byte-level GGUF: the 256 byte pieces, then `extra` as control tokens; ids: the
    tokenizer.ggml.*_token_id fields to write (bos, eos, eot, eom)."""
    gguf = pytest.importorskip("gguf")
    from common.tokenizer import _byte_decoder
    chars = sorted(_byte_decoder(), key=_byte_decoder().get)
    w = gguf.GGUFWriter(path, arch)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(chars + extra)
    w.add_token_types([1] * len(chars) + [3] * len(extra))
    w.add_token_merges([])
    for k, v in ids.items():
        w.add_uint32(f"tokenizer.ggml.{k}_token_id", v)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()


def test_glm4_vocabulary_splits_as_llama3_and_ends_at_its_end_ids(tmp_path):
    """GLM-4.5's GGUF (tokenizer.ggml.pre "glm4"): Llama 3's split, no BOS whatever
    add_bos_token says (the template writes [gMASK]<sop>), and <|user|> and <|observation|>
    (its eot and eom ids, as llama.cpp's converter writes them) end an answer besides the EOS."""
    extra = ["<|endoftext|>", "[gMASK]", "<sop>", "<|user|>", "<|observation|>"]
    ids = {"bos": 256 + 1, "eos": 256, "eot": 256 + 3, "eom": 256 + 4}
    _bytes_gguf(str(tmp_path / "glm.gguf"), "glm4moe", "glm4", extra, ids)
    _bytes_gguf(str(tmp_path / "l3.gguf"), "llama", "llama-bpe", extra, {"eos": 256})
    glm, l3 = load_text(str(tmp_path / "glm.gguf")), load_text(str(tmp_path / "l3.gguf"))
    assert glm.stop_ids == {256, 259, 260} and l3.stop_ids == {256}
    assert glm.bos_id is None and not glm.add_bos
    for text in ["HelloWorld's IT'S x 1234567 a/b//\n\nc", "def f(x):\n    return x  # ok\r\n"]:
        assert glm.tokenizer.pre_tokenizer.pre_tokenize_str(text) == l3.tokenizer.pre_tokenizer.pre_tokenize_str(text)
    assert glm.encode("[gMASK]<sop><|user|>\nhi") == [257, 258, 259, 10, 104, 105]


def test_hf_dir_generation_config_ends_answers(tmp_path, model_path):
    """An HF dir's generation_config.json may list several EOS ids (GLM, Llama 3): each ends
    an answer."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={"a": 0, "b": 1, "<|user|>": 2, "<|end|>": 3}, merges=[]))
    tok.add_special_tokens(["<|user|>", "<|end|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|end|>"}')
    assert load_text(str(tmp_path)).stop_ids == {3}
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [3, 2]}')
    assert load_text(str(tmp_path)).stop_ids == {2, 3}


def test_hf_dir_chat_template_beside_the_tokenizer_config(tmp_path):
    """The chat template where transformers saves it now (chat_template.jinja, which wins over
    tokenizer_config.json's) or where a multimodal processor kept it (chat_template.json)."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={"a": 0, "<|end|>": 1}, merges=[]))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|end|>", "chat_template": "config"}')
    assert load_text(str(tmp_path)).chat_template == "config"
    (tmp_path / "chat_template.json").write_text('{"chat_template": "processor"}')
    assert load_text(str(tmp_path)).chat_template == "processor"
    (tmp_path / "chat_template.jinja").write_text("jinja")
    assert load_text(str(tmp_path)).chat_template == "jinja"
