"""The GGUF metadata reader against files the `gguf` package writes: string arrays (a
vocabulary) read back equal, and a file cut inside one is a clear GGUFError, never a partial
vocabulary."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from common.gguf_file import GGUFError, GGUFFile

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
