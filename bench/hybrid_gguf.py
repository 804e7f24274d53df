"""A random-weight GGUF of a Qwen3.5-like shape (Gated DeltaNet layers, three of four; the
default model's vocabulary), or with --gpt-oss of gpt-oss's (attention sinks and biases,
every other layer over a window of 128, 32 experts of which 4 chosen, in MXFP4 as released),
written as llama.cpp's converter writes one, for comparing ricordo's speed with llama.cpp's
on the same file (bench/bench_model.py --model PATH). Speed does not depend on the values
(with experts, which experts a token chooses does: a random router spreads tokens over the
experts about evenly, as trained ones are balanced to); neither model is on PyPI.

    .venv/bin/python bench/hybrid_gguf.py OUT.gguf [--layers 24] [--hidden 1024] [--qtype Q8_0] [--moe]
    .venv/bin/python bench/hybrid_gguf.py OUT.gguf --gpt-oss --layers 12 --ffn 1024 [--heads 16 --kv-heads 4]
    .venv/bin/python bench/hybrid_gguf.py OUT.gguf --mla --layers 8 --hidden 2048 --ffn 3072 --qtype Q4_0

--mla writes GLM-4.7-Flash's attention (multi-head latent attention: 20 heads, a 768-rank
query and a 512-rank K/V compression, 192 + 64 rotary key dims, values of 256), its first
layer dense (MLP --ffn), the others 32 experts of --ffn/4, 4 chosen, one shared.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gguf  # noqa: E402
import torch  # noqa: E402

from common.config import Settings  # noqa: E402
from common.models import resolve  # noqa: E402
from tests.procs.inference import tiny_models as tm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=3584)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--linear-heads", type=int, default=16, help="key and value heads of the DeltaNet")
    ap.add_argument("--qtype", default="Q8_0", help="a gguf GGMLQuantizationType name (F16, Q8_0, Q4_0, ...)")
    ap.add_argument("--moe", action="store_true", help="Qwen3.5 MoE: 64 experts of --ffn/4, 4 chosen, a shared one")
    ap.add_argument("--mla", action="store_true",
                    help="GLM-4.7-Flash's latent attention and experts (32 of --ffn/4, 4 chosen, a shared one)")
    ap.add_argument("--gpt-oss", action="store_true",
                    help="gpt-oss: heads of 64, 32 experts of --ffn, 4 chosen, in MXFP4 (the rest --qtype)")
    a = ap.parse_args()
    default = resolve("", Settings().models_path())
    vocab = len(gguf.GGUFReader(default).fields["tokenizer.ggml.tokens"].data)
    shape = dict(vocab_size=vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                 num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=256,
                 max_position_embeddings=32768, linear_num_key_heads=a.linear_heads,
                 linear_num_value_heads=a.linear_heads, linear_key_head_dim=128, linear_value_head_dim=128,
                 tie_word_embeddings=True)
    name = "qwen3_5_moe" if a.moe else "qwen3_5"
    experts_qtype = None
    if a.gpt_oss:      # gpt-oss-20b's own attention shape and experts, fewer and narrower layers
        name, experts_qtype = "gpt_oss", gguf.GGMLQuantizationType.MXFP4
        shape = dict(vocab_size=vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                     num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=64,
                     num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                     max_position_embeddings=131072, tie_word_embeddings=False,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                      "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                      "original_max_position_embeddings": 4096})
    elif a.mla:        # GLM-4.7-Flash's attention shape as released, fewer and narrower experts
        name = "glm4_moe_lite"
        shape = dict(vocab_size=vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                     num_attention_heads=20, num_key_value_heads=20, kv_lora_rank=512, q_lora_rank=768,
                     qk_nope_head_dim=192, qk_rope_head_dim=64, head_dim=64, v_head_dim=256, n_routed_experts=32,
                     num_experts_per_tok=4, moe_intermediate_size=a.ffn // 4, n_shared_experts=1,
                     routed_scaling_factor=1.8, n_group=1, topk_group=1, norm_topk_prob=True,
                     max_position_embeddings=32768, rope_interleave=True, tie_word_embeddings=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    elif a.moe:
        shape.update(num_experts=64, num_experts_per_tok=4, moe_intermediate_size=a.ffn // 4,
                     shared_expert_intermediate_size=a.ffn // 4, tie_word_embeddings=False)
    torch.manual_seed(0)
    m = tm._hf_model(name, **shape)
    with torch.no_grad():          # weights of a trained model's scale: activations stay O(1)
        for pname, p in m.named_parameters():
            if p.ndim >= 2 and "conv1d" not in pname:   # (gpt-oss's experts are [E, in, out])
                p.normal_(0.0, p.shape[-2 if name == "gpt_oss" and "experts" in pname else -1] ** -0.5)
    qtype = getattr(gguf.GGMLQuantizationType, a.qtype)
    tm._write_gguf(m, a.out, tm.CASES[name][2], qtype=None if a.qtype == "F32" else qtype,
                   experts_qtype=experts_qtype or (None if a.qtype == "F32" else qtype), tokenizer_from=default)
    print(a.out, f"{os.path.getsize(a.out) / 2**20:.0f} MiB", sum(p.numel() for p in m.parameters()) / 1e6, "M params")


if __name__ == "__main__":
    main()
