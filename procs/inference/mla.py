"""Multi-head latent attention (DeepSeek-V2/V3's MLA; GLM-4.7-Flash), run as llama.cpp runs it
for decode: "absorbed", so that the K/V cache holds one latent row per token, not a key and a
value per head.

A token's keys and values are all functions of one compressed row: c = RMSNorm(kv_a x)[:r]
(r = kv_lora_rank) and one rotary part k_pe shared by every head. Head h's key is
[W_UK[h] c, k_pe] and its value W_UV[h] c, so

    q[h] . k[h] = (W_UK[h]^T q_nope[h]) . c + q_pe[h] . k_pe        (absorb W_UK into the query)
    sum_j p_j v_j[h] = W_UV[h] (sum_j p_j c_j)                       (apply W_UV after attention)

which is multi-query attention with one K/V head of D = r + rope dims: K rows [c, k_pe], and V
rows the K rows themselves (the output's first r dims are sum_j p_j c_j; its last rope dims,
sums of k_pe, are dropped before W_UV), so a session keeps one tensor of rows
(KVSession.one_kv, ModelConfig.kv_tensors) and what writes V rows writes K's values.
The cache geometry (weights.ModelConfig: n_kv_heads 1, head_dim r + rope) and every attention
kernel are the ones other models use; only the projections around them are MLA's. The
softmax scale stays the unabsorbed one, 1/sqrt(nope + rope) (times YaRN's mscale_all_dim
squared), in ModelConfig.attn_scale.

Decode on the CPU runs the same math in the whole-step native decoder (kernels/decode.c's
mla_layer, on each head's uk and uv rows as heads() holds them, attention.c over the latent head); this
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
from procs.inference.packs import MAT_Q4, MAT_Q8, QROWS, QUANTIZED
from procs.inference.rope import rotate


class MLA:
    def __init__(self, c, wa: Linear, q_a_norm: torch.Tensor | None, wq_b: Linear | None,
                 kv_a_norm: torch.Tensor, uk: Linear, uv: Linear):
        """c: ModelConfig (kv_lora, q_lora, qk_nope, rope_dims, v_head_dim, n_heads); wa: the
        query's first projection (q_a, or q itself without q_lora) and kv_a in one Linear over
        the layer's input; uk [H * r, nope] and uv [H * v, r]: kv_b's two parts, head by head
        (W_UK transposed as llama.cpp's converter stores it, attn_k_b), as the model's other
        Linears hold a weight (a quantized file's groups as stored where it has them). Each
        head's rows are a Linear of their own, so the model's lin() runs it as every other
        linear (exact mode's padded rows, prefill's f32 products, decode in the compute dtype)."""
        self.H, self.r, self.rope, self.nope, self.v = c.n_heads, c.kv_lora, c.rope_dims, c.qk_nope, c.v_head_dim
        self.q_lora, self.eps = c.q_lora, c.norm_eps
        self.wa, self.q_a_norm, self.wq_b, self.kv_a_norm = wa, q_a_norm, wq_b, kv_a_norm
        self.uk = heads(uk, self.H, self.r)     # q_lat[h] = q_nope[h] @ uk[h].T
        self.uv = heads(uv, self.H, self.v)     # out[h] = lat[h] @ uv[h].T
        half = (self.r + self.rope) // 2
        self.idx = torch.cat([torch.arange(self.rope // 2), half + torch.arange(self.rope // 2)]).to(kv_a_norm.device)

    def project(self, h: torch.Tensor, lin: Callable, cos: torch.Tensor, sin: torch.Tensor):
        """The rows h [T, dim] -> (q [T, H, D] absorbed and rotated, k [T, 1, D] = [c, k_pe],
        v [T, D]: k's rows, as the session's one tensor holds them) for the model's attend();
        cos/sin: the rows' [T, 1, D] tables."""
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
        return q, k, k[:, 0]

    def expand(self, att: torch.Tensor, lin: Callable) -> torch.Tensor:
        """attend()'s [T, H * D] (latent rows per head) -> [T, H * v] for the output projection."""
        T = att.shape[0]
        lat = att.view(T, self.H, self.r + self.rope)
        return torch.cat([lin(self.uv[i], lat[:, i, :self.r].contiguous()) for i in range(self.H)], dim=1)

def heads(lin: Linear, H: int, n: int) -> list[Linear]:
    """A Linear of H heads' n rows each as H Linears over the same memory: views of a dense
    weight, or of the kernels' packed groups where whole blocks make a head (else the heads'
    values dequantized once)."""
    mat = lin.mat
    if mat is not None and mat.kind in QUANTIZED:
        if mat.kind not in (MAT_Q4, MAT_Q8) or n % QROWS == 0:
            return [Linear.of(mat.rows(h * n, n), lin.kernels, lin.dtype) for h in range(H)]
        w = lin.w.clone()           # (lin.w of a quantized copy is a shared buffer)
    else:
        w = lin.w
    return [Linear(w[h * n:(h + 1) * n], packed=False, kernels=lin.kernels) for h in range(H)]


def kv_b_split(kv_b: torch.Tensor, H: int, nope: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj [H * (nope + v), r] -> (uk [H, r, nope], uv [H, v, r])."""
    w = kv_b.view(H, -1, kv_b.shape[-1])
    return w[:, :nope].transpose(1, 2), w[:, nope:]
