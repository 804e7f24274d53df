"""The GGUF metadata reader against files the `gguf` package writes: string arrays (a
vocabulary) read back equal, and a file cut inside one is a clear GGUFError, never a partial
vocabulary."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from common.gguf_file import GGUFError, GGUFFile, Skipped

TOKENS = ["<s>", "hello", " wörld", "▁x", "", "\u00e9\u00e8", "a" * 300]


def write(path) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_token_list(TOKENS)
    w.add_array("test.ints", [1, 2, 3])
    w.add_string("test.name", "ricordo")
    w.add_tensor("t", np.arange(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_string_arrays_read_back(tmp_path):
    p = tmp_path / "m.gguf"
    write(p)
    f = GGUFFile(str(p))
    assert f.meta["tokenizer.ggml.tokens"] == TOKENS
    assert list(f.meta["test.ints"]) == [1, 2, 3] and f.meta["test.name"] == "ricordo"
    assert f.tensors["t"].shape == (8,)


def test_a_file_cut_inside_the_vocabulary_is_refused(tmp_path):
    p = tmp_path / "m.gguf"
    write(p)
    data = p.read_bytes()
    end = data.index(b"a" * 300) + 100            # inside the last token
    for cut in (end, data.index(b" w\xc3\xb6rld") + 2):
        q = tmp_path / f"cut{cut}.gguf"
        q.write_bytes(data[:cut])
        with pytest.raises(GGUFError, match="truncated"):
            GGUFFile(str(q))


def test_string_arrays_can_be_stepped_over(tmp_path):
    """strings=False (the loader, the context size): the same metadata and tensors, string
    arrays only counted, and a truncated one still refused."""
    path = tmp_path / "v.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_token_list([f"tok{i}" for i in range(1000)])
    w.add_uint32("llama.context_length", 4096)
    w.add_tensor("t", np.arange(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    full, quick = GGUFFile(str(path)), GGUFFile(str(path), strings=False)
    assert full.meta["tokenizer.ggml.tokens"][999] == "tok999"
    assert isinstance(quick.meta["tokenizer.ggml.tokens"], Skipped) and quick.meta["tokenizer.ggml.tokens"].count == 1000
    assert quick.meta["llama.context_length"] == 4096 and quick.tensors == full.tensors
    data = path.read_bytes()
    cut = data.index(b"tok500")
    (tmp_path / "cut.gguf").write_bytes(data[:cut])
    with pytest.raises(GGUFError):
        GGUFFile(str(tmp_path / "cut.gguf"), strings=False)
