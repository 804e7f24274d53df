"""Gated DeltaNet: the linear-attention layers of Qwen3-Next and Qwen3.5 (three layers of
four; the fourth is gated full attention). A layer keeps no K/V rows: each sequence carries
a fixed-size state instead (Recurrent), the last K - 1 inputs of a causal depthwise
convolution and, per value head, a matrix S [dk, dv] in f32.

Per token t and value head h (k and q heads shared by nv / nk value heads):

    x_t = SiLU(conv(qkv inputs up to t))           -> q_t, k_t (L2-normed, q times dk^-0.5), v_t
    beta_t = sigmoid(b_t),  g_t = A * softplus(a_t + dt_bias)    (A = -exp(A_log) < 0)
    S = exp(g_t) S;  S += k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
    out = W_out (RMSNorm(o) * w * SiLU(z))

Decode runs that recurrence; prefill runs it a block of BLOCK tokens at a time in the
equivalent closed form (the "chunked" delta rule: one triangular solve per block, matrix
products for the rest), blocks aligned to absolute positions. The value heads are in one of
two orders: grouped (Hugging Face's: value head h reads key head h // (nv / nk)) or tiled
(llama.cpp's qwen35: h % nk); the loader keeps each architecture's own and says which
(ModelConfig.ssm_tiled), so a state is always in its model's order.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from procs.inference.linear import Linear

BLOCK = 64          # prefill's block of tokens (the closed form's triangular solve is BLOCK x BLOCK)
L2_EPS = 1e-6       # transformers' l2norm epsilon (fla's), not the model's RMSNorm one


def state_values(c) -> tuple[int, int]:
    """(convolution inputs, recurrent state) values of one linear-attention layer of config c:
    the last K - 1 inputs of its q|k|v channels, and value heads x key dim x value dim."""
    conv_dim = 2 * c.ssm_k_heads * c.ssm_k_dim + c.ssm_v_heads * c.ssm_v_dim
    return conv_dim * (c.ssm_conv - 1), c.ssm_v_heads * c.ssm_k_dim * c.ssm_v_dim


class Recurrent:
    """One sequence's states for every linear-attention layer: conv [n, conv_dim, K - 1] in the
    compute dtype (the raw inputs, oldest first) and ssm [n, nv, dk, dv] in f32."""

    def __init__(self, c, n: int, dtype: torch.dtype, device):
        conv = state_values(c)[0] // (c.ssm_conv - 1)
        self.conv = torch.zeros(n, conv, c.ssm_conv - 1, dtype=dtype, device=device)
        self.ssm = torch.zeros(n, c.ssm_v_heads, c.ssm_k_dim, c.ssm_v_dim, dtype=torch.float32, device=device)

    @classmethod
    def like(cls, other: "Recurrent") -> "Recurrent":
        """An uninitialized state of other's shapes."""
        st = cls.__new__(cls)
        st.conv, st.ssm = torch.empty_like(other.conv), torch.empty_like(other.ssm)
        return st

    def reset(self) -> None:
        self.conv.zero_()
        self.ssm.zero_()

    def copy_(self, other: "Recurrent") -> None:
        self.conv.copy_(other.conv)
        self.ssm.copy_(other.ssm)

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.ssm.numel() * 4


def delta_step(q, k, v, g, beta, S):
    """One token: q, k [H, dk], v [H, dv], g, beta [H] (f32); S [H, dk, dv] updated in place.
    Returns o [H, dv]. S is read once for both products, before the decay (e = exp(g)):
    S^T k after it is e S^T k, and o = S'^T q = e S^T q + (k . q) delta; then one in-place
    pass decays it and one adds k delta^T (the state is MBs: passes over it are the cost)."""
    e = g.exp()
    m = torch.bmm(torch.stack([k, q], dim=1), S)                       # [H, 2, dv]
    delta = (v - e[:, None] * m[:, 0]) * beta[:, None]
    o = e[:, None] * m[:, 1] + (k * q).sum(-1, keepdim=True) * delta
    S.mul_(e[:, None, None]).baddbmm_(k[:, :, None], delta[:, None, :])
    return o


def delta_block(q, k, v, g, beta, S):
    """n <= BLOCK tokens at once, the recurrence's closed form: q, k [H, n, dk], v [H, n, dv],
    g, beta [H, n] (f32); S [H, dk, dv] updated in place. Returns o [H, n, dv].

    With G the cumulative decay within the block and D_ij = exp(G_i - G_j) (i >= j), the
    values each token writes, u_i = beta_i (v_i - S_{i-1}^T k_i), solve the unit lower
    triangular system (I + L) u = beta (v - exp(G) S^T k) with L_ij = beta_i (k_i . k_j)
    D_ij below the diagonal; then o = exp(G) q S + (q k^T o D, lower with the diagonal) u
    and S' = exp(G_n) S + (exp(G_n - G) k)^T u."""
    n = q.shape[1]
    G = g.cumsum(-1)                                                  # [H, n]
    D = (G[:, :, None] - G[:, None, :])
    low = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    D = torch.where(low, D, torch.full_like(D, -torch.inf)).exp()      # [H, n, n], 0 above
    eG = G.exp()[:, :, None]                                          # [H, n, 1]
    kk = (k @ k.transpose(1, 2)) * D * beta[:, :, None]
    L = kk.tril(-1) + torch.eye(n, dtype=q.dtype, device=q.device)
    rhs = beta[:, :, None] * (v - eG * (k @ S))
    u = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)   # [H, n, dv]
    o = eG * (q @ S) + ((q @ k.transpose(1, 2)) * D) @ u
    last = G[:, -1:]                                                   # [H, 1]
    S.mul_(last.exp()[:, :, None]).add_(((last - G).exp()[:, :, None] * k).transpose(1, 2) @ u)
    return o


class GatedDeltaNet:
    def __init__(self, c, slot: int, w_in: Linear, conv: torch.Tensor, a: torch.Tensor, dt: torch.Tensor,
                 norm: torch.Tensor, w_out: Linear):
        """c: ModelConfig (ssm_*, norm_eps); slot: the layer's index into Recurrent; w_in: the
        projections q|k|v (the convolution's channels), z, b, a in one Linear; conv
        [conv_dim, K] (the current token's weight last); a = -exp(A_log) [nv] f32; dt [nv];
        norm [dv]: the gated RMSNorm's weight (not offset); w_out: the output projection."""
        self.slot, self.eps = slot, c.norm_eps
        self.state_values = state_values(c)          # its elements in a Recurrent: convolution, state
        self.nk, self.nv, self.dk, self.dv = c.ssm_k_heads, c.ssm_v_heads, c.ssm_k_dim, c.ssm_v_dim
        self.tiled = c.ssm_tiled
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.w_in, self.w_out = w_in, w_out
        self.conv_w = conv.unsqueeze(1).contiguous()                   # [conv_dim, 1, K]
        self.conv_f32 = conv.float().contiguous()                       # decode's [conv_dim, K]
        self.a, self.dt, self.norm = a, dt, norm
        self.native = None      # native_gdn.DeltaStep, set by the model where the kernels run

    def __call__(self, h: torch.Tensor, lin: Callable, seqs) -> torch.Tensor:
        """The rows h [T, dim] -> [T, nv * dv] for the output projection (lin(w_out, ...) by the
        caller, as attention's). seqs: (first row, rows, position of the first, Recurrent) per
        sequence, in row order: one for a prefill, one row each for a batched decode step."""
        T = h.shape[0]
        p = lin(self.w_in, h)
        if self.native is not None and all(n == 1 for _, n, _, _ in seqs):
            convs = [st.conv[self.slot] for _, _, _, st in seqs]
            if self.native.takes(convs):        # decode: the whole step between the projections in C
                return self.native(p, convs, [st.ssm[self.slot] for _, _, _, st in seqs])
        mixed, z, b, a = p.split([self.conv_dim, self.value_dim, self.nv, self.nv], dim=-1)
        beta = torch.sigmoid(b).float()                                # [T, nv]
        g = self.a * F.softplus(a.float() + self.dt)                   # [T, nv] f32, < 0
        out = torch.empty(T, self.nv, self.dv, dtype=torch.float32, device=h.device)
        for r0, n, pos, st in seqs:
            x = self._conv(mixed[r0:r0 + n], st.conv[self.slot])       # [n, conv_dim] f32
            q, k, v = x.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
            q = _l2(q.view(n, self.nk, self.dk)) * self.dk ** -0.5
            k = _l2(k.view(n, self.nk, self.dk))
            r = self.nv // self.nk
            q, k = (t.repeat(1, r, 1) if self.tiled else t.repeat_interleave(r, dim=1) for t in (q, k))
            v = v.view(n, self.nv, self.dv)
            S = st.ssm[self.slot]
            if n == 1:
                out[r0] = delta_step(q[0], k[0], v[0], g[r0], beta[r0], S)
                continue
            # blocks end at absolute multiples of BLOCK, as prefill's chunks do
            ends = sorted({*range((pos // BLOCK + 1) * BLOCK, pos + n, BLOCK), pos + n})
            lo = pos
            qh, kh, vh = (t.transpose(0, 1) for t in (q, k, v))         # [H, n, d]
            gh, bh = g[r0:r0 + n].t(), beta[r0:r0 + n].t()
            for hi in ends:
                s = slice(lo - pos, hi - pos)
                out[r0 + s.start:r0 + s.stop] = delta_block(qh[:, s], kh[:, s], vh[:, s], gh[:, s], bh[:, s],
                                                            S).transpose(0, 1)
                lo = hi
        # rounded to the compute dtype first, as transformers' kernel returns it
        o = F.rms_norm(out.to(h.dtype).float(), (self.dv,), None, self.eps).to(h.dtype) * self.norm
        o = (o.float() * F.silu(z.float().view(T, self.nv, self.dv))).to(h.dtype)
        return o.view(T, self.value_dim)

    def _conv(self, x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """SiLU of the causal depthwise convolution of x [n, conv_dim] after the inputs in
        state [conv_dim, K - 1] (updated to the last K - 1), f32 [n, conv_dim]."""
        n, K1 = x.shape[0], state.shape[1]
        ext = torch.cat([state, x.t().to(state.dtype)], dim=1)         # [conv_dim, K - 1 + n]
        if n == 1:     # one output: products and a sum (a convolution call costs 2-3x that)
            y = (ext.float() * self.conv_f32).sum(1).to(self.conv_w.dtype)
            state.copy_(ext[:, 1:])
            return F.silu(y).float().unsqueeze(0)
        y = F.conv1d(ext.unsqueeze(0).to(self.conv_w.dtype), self.conv_w, groups=self.conv_dim)[0]
        state.copy_(ext[:, ext.shape[1] - K1:])
        return F.silu(y).t().float()


def _l2(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)
