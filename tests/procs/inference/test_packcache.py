"""The packed-weight cache (procs/inference/packcache.py) through the inference process's own
build(): the first start writes the native decoder's packs, the second maps them without
packing anything, and both answer exactly as a load without the cache; a damaged file is
ignored and rewritten; a changed model file gets a file of its own and the old one goes."""
from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from common.config import Settings
from common.models import ModelError, resolve
from procs.inference import model as model_mod
from procs.inference.kvsession import KVSession
from procs.inference.runtime import build

N = 64


def answer(m) -> torch.Tensor:
    """Logits after a prefill and after each of 4 decode steps (fixed tokens)."""
    ids = [(i * 37 + 11) % 1000 + 10 for i in range(N + 4)]
    s = KVSession(m, 256, 512)
    s.prefill(ids[:N])
    out = [s.logits.float().clone()]
    for t in ids[N:]:
        out.append(s.decode(t).float().clone())
    return torch.stack(out)


def settings(model: str, cache: str, dtype: str) -> Settings:
    return Settings(model=model, packed_cache_dir=cache, ctx_size=256, dtype=dtype)


def no_packing(monkeypatch):
    """Every pack must come from the file from now on."""
    def boom(*a, **k):
        raise AssertionError("packed a weight the cache holds")
    monkeypatch.setattr(model_mod, "fuse", boom)
    monkeypatch.setattr(model_mod, "pack_source", boom)


@pytest.mark.parametrize("name,dtype", [("smollm2-135m", "f32"), ("smollm2-135m", "bf16"), ("gemma3-270m", "bf16")])
def test_a_second_start_maps_the_packs_the_first_made(tmp_path, monkeypatch, name, dtype):
    try:
        resolve(name, Settings().models_path())
    except ModelError as e:      # `make test` fetches both
        pytest.fail(str(e))
    ref = answer(build(settings(name, "off", dtype))[0])
    first, _, _ = build(settings(name, str(tmp_path), dtype))
    files = list(tmp_path.glob("*.packed"))
    assert len(files) == 1
    assert torch.equal(answer(first), ref)
    with monkeypatch.context() as mp:
        no_packing(mp)
        second, _, _ = build(settings(name, str(tmp_path), dtype))
    assert torch.equal(answer(second), ref)


def test_a_damaged_file_is_ignored_and_rewritten(tmp_path, monkeypatch, caplog):
    build(settings("smollm2-135m", str(tmp_path), "f32"))
    ref = answer(build(settings("smollm2-135m", "off", "f32"))[0])
    (path,) = tmp_path.glob("*.packed")
    whole = path.read_bytes()
    for damage in (whole[:len(whole) // 2], b"not a packed file" + whole[17:], whole[:20] + b"{" + whole[21:]):
        path.write_bytes(damage)
        with caplog.at_level(logging.WARNING, logger="inference"):
            m, _, _ = build(settings("smollm2-135m", str(tmp_path), "f32"))
        assert "unusable" in caplog.text
        caplog.clear()
        assert torch.equal(answer(m), ref)
        with monkeypatch.context() as mp:       # rewritten whole
            no_packing(mp)
            build(settings("smollm2-135m", str(tmp_path), "f32"))


def test_a_changed_model_file_gets_its_own_file(tmp_path):
    src = resolve("smollm2-135m", Settings().models_path())
    gguf = tmp_path / "model.gguf"
    shutil.copyfile(src, gguf)
    cache = tmp_path / "packed"
    build(settings(str(gguf), str(cache), "f32"))
    (old,) = cache.glob("*.packed")
    st = os.stat(gguf)
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    build(settings(str(gguf), str(cache), "f32"))
    (new,) = cache.glob("*.packed")          # the stale one removed
    assert new != old
    build(settings(str(gguf), str(cache), "bf16"))
    assert len(list(cache.glob("*.packed"))) == 2       # another dtype keeps its own
