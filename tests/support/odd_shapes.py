"""Checks of the quantized linears and the fused MoE layer at shapes that are not multiples of 64 or 128, shared by
the GPU tests (tests/gpu/test_odd_shapes_gpu.py) and their interpreter twin on the CPU (tests/kernels/
test_odd_shapes.py): the kernel against the fp32 torch reference on the same packed weights, outputs poisoned first
(every element must be written), and `guarded`, which puts a tensor right before a page that may not be read, so
that a kernel reading past a weight faults in the interpreter instead of reading a neighbour's bytes."""
from __future__ import annotations

import ctypes
import mmap

import torch

from m3serve.kernels.moe import fused_moe, fused_moe_ref, moe_prepare_module
from m3serve.kernels.quant_linear import quant_linear, quant_linear_prepare, quant_linear_ref
from m3serve.model.weights import QuantWeight
from support.moe import fill_random, random_moe, rel_err, tiny_moe_config

FORMATS = ("nvfp4", "mxfp8", "fp8", "dense")
_KEEP: list = []  # the guarded buffers live as long as the process


def guarded(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``t`` whose last byte is the last byte before a PROT_NONE page."""
    page = mmap.PAGESIZE
    nbytes = t.numel() * t.element_size()
    size = -(-nbytes // page) * page
    mm = mmap.mmap(-1, size + page)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mprotect(ctypes.c_void_p(addr + size), ctypes.c_size_t(page), 0) != 0:
        raise OSError(ctypes.get_errno(), "mprotect")
    out = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=size - nbytes).view(t.dtype).view(t.shape)
    out.copy_(t)
    _KEEP.append(mm)
    return out


def guard_packed(pw) -> None:
    """Every tensor of a `PackedWeight` moved in front of a guard page (CPU only)."""
    for name in ("data", "scale", "rowscale"):
        t = getattr(pw, name)
        if t is not None:
            setattr(pw, name, guarded(t.contiguous()))


def check_linear(fmt: str, n: int, k: int, rows: tuple[int, ...], device, gen, guard: bool = False,
                 tol: float = 1e-2) -> None:
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    with torch.device(device):
        qw = QuantWeight(n, k, fmt, dtype)
    fill_random(qw, gen)
    ql = quant_linear_prepare(qw)
    if guard and ql.packed is not None:
        guard_packed(ql.packed)
    for m in rows:
        x = torch.randn(m, k, generator=gen, device=device).to(dtype)
        y = quant_linear(x, ql)
        assert y.shape == (m, n) and not torch.isnan(y).any(), (fmt, n, k, m)
        err = rel_err(y, quant_linear_ref(x, ql))
        assert err < tol, (fmt, n, k, m, err)


def check_moe(expert_fmt: str, shared_fmt: str, hidden: int, inter: int, shared_inter: int, tokens: tuple[int, ...],
              device, gen, experts: int = 8, top_k: int = 2, guard: bool = False, tol: float = 1e-2) -> None:
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    cfg = tiny_moe_config(hidden=hidden, inter=inter, experts=experts, top_k=top_k, shared_inter=shared_inter)
    moe = random_moe(cfg, expert_fmt, shared_fmt, gen, device=device, dtype=dtype)
    w = moe_prepare_module(moe)
    if guard:
        for pw in (w.gate_up, w.down, w.shared_gate_up, w.shared_down):
            guard_packed(pw)
    kw = dict(top_k=top_k, routed_scaling=cfg.routed_scaling_factor, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
    for t in tokens:
        x = torch.randn(t, hidden, generator=gen, device=device).to(dtype)
        out = torch.full_like(x, float("nan"))  # poisoned: every element must be written
        routing = []
        y = fused_moe(x, moe.gate.weight, moe.gate.e_score_correction_bias, w, out=out, routing_out=routing, **kw)
        assert not torch.isnan(y).any(), (expert_fmt, shared_fmt, hidden, t)
        ref = fused_moe_ref(x, moe.gate.weight, moe.gate.e_score_correction_bias, w, routing=routing[0], **kw)
        err = rel_err(y, ref)
        assert err < tol, (expert_fmt, shared_fmt, hidden, inter, shared_inter, t, err)
