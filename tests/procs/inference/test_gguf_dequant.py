"""The torch dequantizers of Q5_0 and Q6_K (procs/inference/gguf_tensors.py) against the gguf
package's own: random blocks (every bit pattern of the quants, random f16 scales) give the same
float32 values, bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize

from procs.inference.gguf_tensors import _q5_0, _q6_k


@pytest.mark.parametrize("qtype, block, d_at, fn", [(T.Q5_0, 22, 0, _q5_0), (T.Q6_K, 210, 208, _q6_k)])
def test_torch_dequant_equals_gguf(qtype, block, d_at, fn):
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 256, size=(512, block), dtype=np.uint8)
    d = (rng.standard_normal(512) * 0.02).astype(np.float16)
    raw[:, d_at:d_at + 2] = np.frombuffer(d.tobytes(), dtype=np.uint8).reshape(512, 2)
    want = dequantize(raw, qtype).reshape(512, -1)
    got = fn(torch.from_numpy(raw.copy())).numpy()
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got, want)
    assert np.abs(got).max() > 0
