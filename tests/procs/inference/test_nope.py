"""SmolLM3's layers without RoPE (NoPE), beyond the parity of
tests/procs/inference/test_architectures.py (whose tiny random model these reuse): where each
config layout and a GGUF put them, that they matter, and that their rotary table leaves q and
k as they are."""
from __future__ import annotations

import dataclasses
import json

import torch

from procs.inference.archs import nope_layers
from procs.inference.kvsession import KVSession
from procs.inference.loader import load
from procs.inference.model import Llama
from tests.procs.inference.tiny_models import MAX_POS, PROMPT, _prompt, build  # noqa: F401


def _last_logits(w) -> torch.Tensor:
    s = KVSession(Llama(w, MAX_POS), MAX_POS, 64)
    return s.prefill(_prompt("smollm3"), logits_at=[PROMPT])[PROMPT]


def test_nope_layers_where_each_file_puts_them_and_they_matter(build):
    _, m, hf_dir, gguf_path = build("smollm3")
    assert m.config.no_rope_layers == [1, 1, 1, 0]          # transformers' own layout: layer 3 has none
    w = load(hf_dir, torch.float32, "cpu")
    assert w.config.no_rope == (False, False, False, True) == load(gguf_path, torch.float32, "cpu").config.no_rope
    assert nope_layers(8) == (False, False, False, True) * 2
    model = Llama(w, MAX_POS)
    assert [ly.rope for ly in model.layers] == [0, 0, 0, 1]
    cos, sin = model.rope[1]
    assert torch.equal(cos[:PROMPT], torch.ones_like(cos[:PROMPT])) and not sin[:PROMPT].any()
    a = _last_logits(load(hf_dir, torch.float32, "cpu"))
    w = load(hf_dir, torch.float32, "cpu")            # (a model takes its weights' tensors)
    every = dataclasses.replace(w, config=dataclasses.replace(w.config, no_rope=()))
    assert (a - _last_logits(every)).abs().max().item() > 0.05


def test_a_config_list_of_nope_layers_is_read_as_given(build, tmp_path):
    """no_rope_layers as a config lists it (1: the layer rotates), not the interval's."""
    _, _, hf_dir, _ = build("smollm3")
    c = json.loads(open(f"{hf_dir}/config.json").read())
    c["no_rope_layers"] = [0, 1, 1, 1]
    for f in ("model.safetensors", "config.json"):
        (tmp_path / f).write_bytes(open(f"{hf_dir}/{f}", "rb").read())
    (tmp_path / "config.json").write_text(json.dumps(c))
    assert load(str(tmp_path), torch.float32, "cpu").config.no_rope == (True, False, False, False)
