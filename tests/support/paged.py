"""Helpers for the paged-kernel tests: caches filled through shuffled page tables, fresh random data."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from m3serve.kernels.kv_insert import kv_insert_ref

KV_DTYPES = ("bfloat16", "fp8", "nvfp4")


def alloc(dtype: str, lead: tuple, dim: int, device="cpu"):
    """Cache tensors for `dtype`, filled with random (valid) bytes so unwritten slots are not zero."""
    if dtype == "nvfp4":
        data = torch.randint(0, 256, (*lead, dim // 2), dtype=torch.uint8, device=device)
        sb = (torch.rand(*lead, dim // 16, device=device) * 4 + 0.1).to(torch.float8_e4m3fn)
        return data, sb
    if dtype == "fp8":
        return torch.randn(*lead, dim, device=device).to(torch.float8_e4m3fn), None
    return torch.randn(*lead, dim, device=device).to(torch.bfloat16), None


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert not torch.isnan(a).any(), "NaN in the kernel output (unwritten or broken)"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def page_tables(seq_lens, block_size: int, spare: int = 3, gen=None, device="cpu"):
    """Shuffled, disjoint page tables: int32 [S, max_pages] (padding entries point at pages too)."""
    S = len(seq_lens)
    max_pages = max(-(-int(n) // block_size) for n in seq_lens) + 1
    P = S * max_pages + spare
    perm = torch.randperm(P, generator=gen)[: S * max_pages].view(S, max_pages)
    return perm.to(torch.int32).to(device), P


def slots_of(block_table_row, positions, block_size):
    pos = positions.long()
    return block_table_row.long()[pos // block_size] * block_size + pos % block_size


@dataclass
class PagedSetup:
    bt: torch.Tensor
    seq_lens: torch.Tensor
    kd: torch.Tensor
    vd: torch.Tensor
    ksb: torch.Tensor | None
    vsb: torch.Tensor | None
    k_scale: float
    v_scale: float
    idx: torch.Tensor | None
    isb: torch.Tensor | None
    idx_scale: float
    k_dense: list  # per sequence [L, H, D] inputs that were inserted (bf16)
    v_dense: list
    ik_dense: list


def build(seq_lens, H_kv, D, B, kv_dtype, index_dtype=None, D_idx=None, gen=None, scale=None, device="cpu"):
    """Insert random K/V/index keys of every sequence (all its positions) into shuffled pages (torch ref).
    Random values come from the CPU generator `gen`; caches and inserted tensors live on `device`."""
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    bt, P = page_tables(seq_lens.tolist(), B, gen=gen)
    kd, ksb = alloc(kv_dtype, (P, H_kv, B), D, device)
    vd, vsb = alloc(kv_dtype, (P, H_kv, B), D, device)
    if scale is None:  # a per-layer calibration-like scale for quantized caches, exercising the epilogue
        scale = {"bfloat16": 1.0, "fp8": 2.0 / 448, "nvfp4": 2.5 / 2688}[kv_dtype]
    ks = vs = scale
    idx = isb = None
    i_scale = 1.0
    if index_dtype is not None:
        idx, isb = alloc(index_dtype, (P, B), D_idx, device)
        i_scale = {"bfloat16": 1.0, "fp8": 3.0 / 448, "nvfp4": 3.0 / 2688}[index_dtype]
    kl, vl, il = [], [], []
    for s, n in enumerate(seq_lens.tolist()):
        k = torch.randn(n, H_kv, D, generator=gen).to(device, torch.bfloat16)
        v = torch.randn(n, H_kv, D, generator=gen).to(device, torch.bfloat16)
        ik = torch.randn(n, D_idx, generator=gen).to(device, torch.bfloat16) if idx is not None else None
        slots = slots_of(bt[s], torch.arange(n), B).to(device)
        kv_insert_ref(k, v, slots, kd, vd, ksb, vsb, ks, vs, ik, idx, isb, i_scale)
        kl.append(k), vl.append(v), il.append(ik)
    return PagedSetup(bt.to(device), seq_lens.to(device), kd, vd, ksb, vsb, ks, vs, idx, isb, i_scale, kl, vl, il)


def chunk_positions(seq_lens, chunk_lens):
    """query_start_loc and positions for a prefill step whose chunks are the last tokens of each sequence."""
    qsl = [0]
    pos = []
    for n, c in zip(seq_lens, chunk_lens):
        qsl.append(qsl[-1] + c)
        pos.append(torch.arange(n - c, n))
    return qsl, torch.cat(pos).to(torch.int64)
