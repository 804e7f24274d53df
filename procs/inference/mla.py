"""Multi-head latent attention (DeepSeek-V2/V3's MLA; GLM-4.7-Flash), run as llama.cpp runs it
for decode: "absorbed", so that the K/V cache holds one latent row per token, not a key and a
value per head.

A token's keys and values are all functions of one compressed row: c = RMSNorm(kv_a x)[:r]
(r = kv_lora_rank) and one rotary part k_pe shared by every head. Head h's key is
[W_UK[h] c, k_pe] and its value W_UV[h] c, so

    q[h] . k[h] = (W_UK[h]^T q_nope[h]) . c + q_pe[h] . k_pe        (absorb W_UK into the query)
    sum_j p_j v_j[h] = W_UV[h] (sum_j p_j c_j)                       (apply W_UV after attention)

which is multi-query attention with one K/V head of D = r + rope dims: K rows [c, k_pe], V
rows [c, 0] (the rotary part's value is zero, so the output's last dims are 0 and dropped).
The cache geometry (weights.ModelConfig: n_kv_heads 1, head_dim r + rope) and every attention
kernel are the ones other models use; only the projections around them are MLA's. The
softmax scale stays the unabsorbed one, 1/sqrt(nope + rope) (times YaRN's mscale_all_dim
squared), in ModelConfig.attn_scale.

Decode on the CPU runs the same math in the whole-step native decoder (kernels/decode.c's
mla_layer, on uk and uv as the dense matrices here, attention.c over the latent head); this
class is prefill's, CUDA's and --decode-kernels torch's.

RoPE: the rope dims are the last of each query head and of kv_a's row; the loader puts their
rows in the half-split order forward()'s rotary tables use (interleaved checkpoints
reordered), and the tables are the model's [ctx, D] ones with rope_dims rotating: their
columns idx (the first rope/2 of each half) are a rope-dim table of its own.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from procs.inference.linear import Linear
from procs.inference.rope import rotate


class MLA:
    def __init__(self, c, wa: Linear, q_a_norm: torch.Tensor | None, wq_b: Linear | None,
                 kv_a_norm: torch.Tensor, uk: torch.Tensor, uv: torch.Tensor):
        """c: ModelConfig (kv_lora, q_lora, qk_nope, rope_dims, v_head_dim, n_heads); wa: the
        query's first projection (q_a, or q itself without q_lora) and kv_a in one Linear over
        the layer's input; uk [H, r, nope] and uv [H, v, r]: kv_b's two parts per head
        (kv_b_split), W_UK transposed as llama.cpp's converter stores it (attn_k_b). Each
        head's part is a dense Linear, so the model's lin() runs it as every other linear
        (exact mode's padded rows, prefill's f32 products, decode in the compute dtype)."""
        self.H, self.r, self.rope, self.nope, self.v = c.n_heads, c.kv_lora, c.rope_dims, c.qk_nope, c.v_head_dim
        self.q_lora, self.eps = c.q_lora, c.norm_eps
        self.wa, self.q_a_norm, self.wq_b, self.kv_a_norm = wa, q_a_norm, wq_b, kv_a_norm
        self.uk = [Linear(w.contiguous(), packed=False) for w in uk]     # q_lat[h] = q_nope[h] @ uk[h].T
        self.uv = [Linear(w.contiguous(), packed=False) for w in uv]     # out[h] = lat[h] @ uv[h].T
        half = (self.r + self.rope) // 2
        self.idx = torch.cat([torch.arange(self.rope // 2), half + torch.arange(self.rope // 2)]).to(uk.device)

    def project(self, h: torch.Tensor, lin: Callable, cos: torch.Tensor, sin: torch.Tensor):
        """The rows h [T, dim] -> (q [T, H, D] absorbed and rotated, k [T, 1, D] = [c, k_pe],
        v [T, D] = [c, 0]) for the model's attend(); cos/sin: the rows' [T, 1, D] tables."""
        T, H, r = h.shape[0], self.H, self.r
        a = lin(self.wa, h)
        nq = a.shape[1] - r - self.rope
        q, kv = a[:, :nq], a[:, nq:]
        if self.wq_b is not None:
            q = lin(self.wq_b, F.rms_norm(q, (self.q_lora,), self.q_a_norm, self.eps))
        q = q.reshape(T, H, self.nope + self.rope)
        cr, sr = cos[..., self.idx], sin[..., self.idx]
        c = F.rms_norm(kv[:, :r], (r,), self.kv_a_norm, self.eps)
        k_pe = rotate(kv[:, r:].reshape(T, 1, self.rope), cr, sr)
        q_pe = rotate(q[..., self.nope:], cr, sr)
        q_lat = torch.stack([lin(self.uk[i], q[:, i, :self.nope].contiguous()) for i in range(H)], dim=1)
        q = torch.cat([q_lat, q_pe.to(q_lat.dtype)], dim=-1)                 # [T, H, D]
        k = torch.cat([c, k_pe[:, 0].to(c.dtype)], dim=-1).unsqueeze(1)      # [T, 1, D]
        v = torch.cat([c, c.new_zeros(T, self.rope)], dim=-1)                # [T, D]
        return q, k, v

    def expand(self, att: torch.Tensor, lin: Callable) -> torch.Tensor:
        """attend()'s [T, H * D] (latent rows per head) -> [T, H * v] for the output projection."""
        T = att.shape[0]
        lat = att.view(T, self.H, self.r + self.rope)
        return torch.cat([lin(self.uv[i], lat[:, i, :self.r].contiguous()) for i in range(self.H)], dim=1)

def kv_b_split(kv_b: torch.Tensor, H: int, nope: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj [H * (nope + v), r] -> (uk [H, r, nope], uv [H, v, r])."""
    w = kv_b.view(H, -1, kv_b.shape[-1])
    return w[:, :nope].transpose(1, 2), w[:, nope:]
