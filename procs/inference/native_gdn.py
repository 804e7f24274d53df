"""The Gated DeltaNet decode step's Python side (kernels/gdn.c; gdn.py's torch path is the
reference): one layer's constants as the kernel reads them, and the call."""
from __future__ import annotations

import ctypes

import torch


class GdnW(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in ("nk", "nv", "dk", "dv", "K", "tiled", "bf16", "pad")] + \
               [("eps", ctypes.c_float)] + [(n, ctypes.c_void_p) for n in ("conv", "a", "dt", "norm")]


class DeltaStep:
    """One layer's decode step for B sequences, one token each: the in-projection's rows p
    [B, conv_dim + nv*dv + 2*nv] -> [B, nv*dv] in dtype (what gdn.GatedDeltaNet returns), the
    sequences' convolution inputs and states advanced in place."""

    def __init__(self, fn, layer, dtype: torch.dtype):
        self.fn, self.dtype = fn, dtype
        # f32 copies the kernel reads (kept alive here); the values are the layer's own
        self.keep = [t.float().contiguous() for t in (layer.conv_f32, layer.a, layer.dt, layer.norm)]
        self.w = GdnW(layer.nk, layer.nv, layer.dk, layer.dv, layer.conv_f32.shape[1], int(layer.tiled),
                      int(dtype == torch.bfloat16), 0, layer.eps, *(t.data_ptr() for t in self.keep))
        self.width = layer.conv_dim + layer.value_dim + 2 * layer.nv
        self.state_values = layer.state_values

    def takes(self, convs: list[torch.Tensor]) -> bool:
        return all(c.dtype == self.dtype and c.is_contiguous() and c.device.type == "cpu" for c in convs)

    def __call__(self, p: torch.Tensor, convs: list[torch.Tensor], ssms: list[torch.Tensor]) -> torch.Tensor:
        B = p.shape[0]
        pf = p.float().contiguous()
        if pf.shape[1] != self.width or any(not s.is_contiguous() or s.dtype != torch.float32 for s in ssms):
            raise ValueError("native delta step: rows or states of another shape")
        out = torch.empty(B, self.w.nv * self.w.dv)
        rc = self.fn(ctypes.byref(self.w), B, pf.data_ptr(), pf.shape[1],
                     (ctypes.c_void_p * B)(*(c.data_ptr() for c in convs)),
                     (ctypes.c_void_p * B)(*(s.data_ptr() for s in ssms)), out.data_ptr(), out.shape[1])
        if rc:
            raise MemoryError("native delta step: no scratch memory")
        return out.to(self.dtype)


def binder(lib: ctypes.CDLL):
    """layer, dtype -> DeltaStep over the library's gdn_step."""
    fn = lib.gdn_step
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    return lambda layer, dtype: DeltaStep(fn, layer, dtype)
