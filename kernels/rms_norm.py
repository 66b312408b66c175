"""The model's RMSNorm (Gemma style: ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` in fp32, weights stored as offsets) in
one launch: each program reads a block of rows once, writes the normalized rows in x's dtype.

The torch form (`rms_norm_ref`, which is `model.m3.RMSNorm`'s) runs about eight kernels a call over fp32 copies of
x: on the 4-layer geometry's 32K prefill the norms' pow / mean / elementwise / copy kernels took some 20 ms of 532
(H100, 2026-12-07, bench_prefill's profile: `pow` 4.8 ms and the mean 2.8 ms over 36 calls). Here the squares are
summed in fp32 in the kernel's order, so a row's result can differ from torch's in its last bf16 bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rms_norm", "rms_norm_ref"]


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).type_as(x)


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(x_ptr, sx, w_ptr, out_ptr, so, n_rows, N, eps, BR: tl.constexpr, BN: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.arange(0, BN)
    m = (r < n_rows)[:, None] & (c < N)[None, :]
    x = tl.load(x_ptr + r.to(tl.int64)[:, None] * sx + c[None, :], mask=m, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    w = 1.0 + tl.load(w_ptr + c, mask=c < N, other=0.0).to(tl.float32)
    y = x * inv[:, None] * w[None, :]
    tl.store(out_ptr + r.to(tl.int64)[:, None] * so + c[None, :], y.to(out_ptr.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x ``[..., N]`` (rows of stride 1 inside) -> the same shape and dtype."""
    N = x.shape[-1]
    if weight.shape != (N,):
        raise ValueError(f"norm weight {tuple(weight.shape)} does not match the last dim {N}")
    x2 = x.reshape(-1, N)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out2 = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if out is None else out.view(-1, N)
    rows = x2.shape[0]
    if rows:
        bn = triton.next_power_of_2(N)
        br = max(1, min(16, 8192 // bn))  # a block of rows per program: ~8K elements in registers
        _rms_norm_kernel[(triton.cdiv(rows, br),)](x2, x2.stride(0), weight, out2, out2.stride(0), rows, N, float(eps),
                                                   BR=br, BN=bn, num_warps=4 if bn * br <= 4096 else 8)
    return out2.view(x.shape) if out is None else out
