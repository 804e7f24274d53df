"""A Hugging Face dir's files as the loader reads them: safetensors mapped without copying
the file, and the tensor names of checkpoints whose layout is not a text model's own (gpt-oss's
fused experts, an image-text checkpoint's language model)."""
from __future__ import annotations

import json
import struct

import numpy as np
import torch

from procs.inference.rope import ModelLoadError


def gpt_oss_experts(st: dict) -> dict:
    """gpt-oss's HF experts in place as stacked [E, rows, cols] linears (GGUF's layout, the
    names of Arch.hf_names): gate_up_proj [E, dim, 2*ffn] (gate and up interleaved by
    column) and down_proj [E, ffn, dim] transposed. The released checkpoints' MXFP4
    *_blocks / *_scales (rows already out-major) are not expanded here: they are returned,
    {name: (blocks [E, rows, G, 16], scales [E, rows, G])}, and their names left out of st,
    for the loader to read as levels (the native kernels' exact 5-bit groups) or, only where
    asked, as dense values."""
    mx = {}
    for key in [k for k in st if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_blocks"))]:
        p = key[:key.index("mlp.experts.") + len("mlp.experts.")]
        if key.endswith("_blocks"):
            gb, gs = st.pop(key), st.pop(p + "gate_up_proj_scales")                           # [E, 2F, ...]
            mx[p + "gate_proj"], mx[p + "up_proj"] = (gb[:, 0::2], gs[:, 0::2]), (gb[:, 1::2], gs[:, 1::2])
            mx[p + "down_proj"] = st.pop(p + "down_proj_blocks"), st.pop(p + "down_proj_scales")
        else:
            gu = st.pop(key).transpose(1, 2)
            st[p + "gate_proj"], st[p + "up_proj"] = gu[:, 0::2].contiguous(), gu[:, 1::2].contiguous()
            st[p + "down_proj"] = st[p + "down_proj"].transpose(1, 2).contiguous()
        b = st.pop(p + "gate_up_proj_bias")                                                   # [E, 2F]
        st[p + "gate_proj_bias"], st[p + "up_proj_bias"] = b[:, 0::2].contiguous(), b[:, 1::2].contiguous()
    return mx


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    dt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "U8": torch.uint8}
    out = {}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        base = 8 + n
        data = np.memmap(path, dtype=np.uint8, mode="r")
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            if meta["dtype"] not in dt:
                raise ModelLoadError(f"{path}: tensor {name} has unsupported dtype {meta['dtype']}")
            a, b = meta["data_offsets"]
            buf = torch.from_numpy(np.array(data[base + a:base + b]))
            out[name] = buf.view(dt[meta["dtype"]]).reshape(meta["shape"])
    return out


# a multimodal checkpoint's language-model tensors (the 4.x layout, then transformers 5's)
# and the names a text model gives them; the vision tower and projector are not read
_TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                  ("model.language_model.", "model."), ("lm_head.", "lm_head."))


def text_tensors(st: dict) -> dict:
    """A multimodal checkpoint's language-model tensors under a text model's names."""
    out = {}
    for name, t in st.items():
        for pre, new in _TEXT_PREFIXES:
            if name.startswith(pre):
                out[new + name[len(pre):]] = t
                break
    return out
