"""Write new K/V (and index keys) into their cache pages, quantizing on the way (bf16 / fp8 / nvfp4).

Paged layout (docs: /work/shared/design/architecture.md): page = MSA block of ``B`` tokens.
K, V: ``[P, H_kv, B, D]`` (bf16 or ``float8_e4m3fn``) or ``uint8 [P, H_kv, B, D/2]`` + block scales
``float8_e4m3fn [P, H_kv, B, D/16]`` (nvfp4). Index keys: the same without the head dim (``[P, B, ...]``).
A token with slot ``page * B + offset`` lives at ``[page, :, offset]``; slots < 0 are skipped (padding).
One fp32 per-layer scale per tensor (dequant side: x = q * scale, x = E2M1(q) * S * scale).

* ``kv_insert_ref``: the readable torch path (``nvfp4.quantize_nvfp4`` / ``fp8.quantize_fp8`` + index_put).
* ``kv_insert``: one Triton launch for K, V and the index key. NVFP4 and FP8 bytes are bit-exact with the
  references: exact (round-to-nearest) division everywhere, E4M3 rounding in integer ops
  (``triton_utils.f32_to_e4m3_bits``), E2M1 by the same threshold chain. (vLLM uses ``rcp.approx``, so its
  bytes may differ from both on rare ties: formats.md 1.4.)
* ``gather_pages_ref``: the inverse for the references: a sequence's first ``n`` tokens, dequantized.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import fp8, nvfp4
from .triton_utils import (FMT_FP8, FMT_NVFP4, cache_format, cast_to, fp8_encode, interpreting, next_pow2,
                           nvfp4_encode, u8_view)

__all__ = ["kv_insert_ref", "kv_insert", "gather_pages_ref", "dequant_pages_ref"]


# ----------------------------------------------------------------------------------------------- torch reference
def _encode_ref(x: torch.Tensor, data: torch.Tensor, scale: float):
    fmt = cache_format(data)
    if fmt == FMT_NVFP4:
        packed, block_scale, _ = nvfp4.quantize_nvfp4(x, scale)
        return packed, block_scale
    if fmt == FMT_FP8:
        return fp8.quantize_fp8(x, scale)[0], None
    return x.to(data.dtype), None


def _store_one_ref(x, slots, data, scale_blocks, scale):
    if x is None or data is None:
        return
    keep = slots >= 0
    x, slots = x[keep], slots[keep].long()
    B = data.shape[-2]
    page, off = slots // B, slots % B
    vals, block_scale = _encode_ref(x, data, scale)
    if data.dim() == 4:  # [P, H, B, *]: advanced indices around a slice put the token dim first
        data[page, :, off] = vals
        if block_scale is not None:
            scale_blocks[page, :, off] = block_scale
    else:  # [P, B, *]
        data[page, off] = vals
        if block_scale is not None:
            scale_blocks[page, off] = block_scale


def kv_insert_ref(k, v, slot_mapping, k_data, v_data, k_scale_blocks=None, v_scale_blocks=None,
                  k_scale: float = 1.0, v_scale: float = 1.0, ik=None, idx_data=None,
                  idx_scale_blocks=None, idx_scale: float = 1.0) -> None:
    """k, v ``[T, H_kv, D]``, ik ``[T, D_idx]`` (or None), slot_mapping ``int64 [T]``; writes the caches in place."""
    _store_one_ref(k, slot_mapping, k_data, k_scale_blocks, k_scale)
    _store_one_ref(v, slot_mapping, v_data, v_scale_blocks, v_scale)
    _store_one_ref(ik, slot_mapping, idx_data, idx_scale_blocks, idx_scale)


def dequant_pages_ref(data, scale_blocks, scale, dtype=torch.float32):
    """Dequantize whole cache tensors (any leading shape) to ``dtype``."""
    fmt = cache_format(data)
    if fmt == FMT_NVFP4:
        return nvfp4.dequantize_nvfp4(data, scale_blocks, scale, dtype)
    if fmt == FMT_FP8:
        return fp8.dequantize_fp8(data, scale, dtype)
    return data.to(dtype)


def gather_pages_ref(data, scale_blocks, scale, block_table_row: torch.Tensor, n_tokens: int,
                     dtype=torch.float32) -> torch.Tensor:
    """The first ``n_tokens`` of one sequence: ``[n, H, D]`` (K/V) or ``[n, D]`` (index keys), dequantized."""
    B = data.shape[-2]
    pages = block_table_row[: -(-n_tokens // B)].long()
    x = dequant_pages_ref(data[pages], None if scale_blocks is None else scale_blocks[pages], scale, dtype)
    if x.dim() == 4:  # [n_pages, H, B, D] -> [n_pages * B, H, D]
        x = x.permute(0, 2, 1, 3)
    return x.reshape(-1, *x.shape[2:])[:n_tokens]


# ----------------------------------------------------------------------------------------------- Triton kernel
@triton.jit
def _quant_store(x_ptr, sx_t, sx_h, dst_ptr, sd_p, sd_h, sd_t, sb_ptr, ss_p, ss_h, ss_t, scale,
                 slot_ptr, t0, T, H, B, FMT: tl.constexpr, H_PAD: tl.constexpr, TB: tl.constexpr,
                 D: tl.constexpr):
    """Rows = (token, head) pairs of TB tokens: quantize each row of D values and store it at its slot."""
    R: tl.constexpr = TB * H_PAD
    r = tl.arange(0, R)
    tok = t0 + r // H_PAD
    hd = r % H_PAD
    slot = tl.load(slot_ptr + tok, mask=tok < T, other=-1).to(tl.int64)
    ok = (slot >= 0) & (hd < H)
    page = tl.where(ok, slot // B, 0)
    dst_row = page * sd_p + hd * sd_h + (slot % B) * sd_t  # [R]
    src_row = tok.to(tl.int64) * sx_t + hd * sx_h
    if FMT == 2:
        gg = tl.arange(0, D // 16)[None, :, None]
        ii = tl.arange(0, 8)[None, None, :]
        m = ok[:, None, None] & (gg >= 0) & (ii >= 0)
        xp = x_ptr + src_row[:, None, None] + gg * 16 + ii * 2
        xe = tl.load(xp, mask=m, other=0.0).to(tl.float32)
        xo = tl.load(xp + 1, mask=m, other=0.0).to(tl.float32)
        byte, sf_bits = nvfp4_encode(xe, xo, scale)
        tl.store(dst_ptr + dst_row[:, None, None] + gg * 8 + ii, byte, mask=m)
        sb_row = page * ss_p + hd * ss_h + (slot % B) * ss_t
        g2 = tl.arange(0, D // 16)[None, :]
        tl.store(sb_ptr + sb_row[:, None] + g2, sf_bits, mask=ok[:, None] & (g2 >= 0))
    else:
        dd = tl.arange(0, D)[None, :]
        m = ok[:, None] & (dd >= 0)
        x = tl.load(x_ptr + src_row[:, None] + dd, mask=m, other=0.0)
        if FMT == 1:
            tl.store(dst_ptr + dst_row[:, None] + dd, fp8_encode(x.to(tl.float32), scale), mask=m)
        else:
            tl.store(dst_ptr + dst_row[:, None] + dd, cast_to(x, dst_ptr.dtype.element_ty), mask=m)


@triton.jit
def _kv_insert_kernel(
    slot_ptr, T,
    k_ptr, v_ptr, sx_t, sx_h,
    kd_ptr, vd_ptr, sd_p, sd_h, sd_t,
    ks_ptr, vs_ptr, ss_p, ss_h, ss_t,
    k_scale, v_scale,
    ik_ptr, sik_t,
    id_ptr, sid_p, sid_t,
    is_ptr, sis_p, sis_t,
    idx_scale,
    H, B,
    FMT: tl.constexpr, IFMT: tl.constexpr, H_PAD: tl.constexpr, TB: tl.constexpr, D: tl.constexpr,
    DI: tl.constexpr,
):
    t0 = tl.program_id(0) * TB
    which = tl.program_id(1)
    if which == 0:
        _quant_store(k_ptr, sx_t, sx_h, kd_ptr, sd_p, sd_h, sd_t, ks_ptr, ss_p, ss_h, ss_t, k_scale,
                     slot_ptr, t0, T, H, B, FMT, H_PAD, TB, D)
    elif which == 1:
        _quant_store(v_ptr, sx_t, sx_h, vd_ptr, sd_p, sd_h, sd_t, vs_ptr, ss_p, ss_h, ss_t, v_scale,
                     slot_ptr, t0, T, H, B, FMT, H_PAD, TB, D)
    else:
        _quant_store(ik_ptr, sik_t, 0, id_ptr, sid_p, 0, sid_t, is_ptr, sis_p, 0, sis_t, idx_scale,
                     slot_ptr, t0, T, 1, B, IFMT, 1, TB, DI)


def kv_insert(k, v, slot_mapping, k_data, v_data, k_scale_blocks=None, v_scale_blocks=None,
              k_scale: float = 1.0, v_scale: float = 1.0, ik=None, idx_data=None,
              idx_scale_blocks=None, idx_scale: float = 1.0) -> None:
    """Triton version of :func:`kv_insert_ref` (same signature, same bytes): one launch, grid
    (token blocks, K | V | index key)."""
    T, H, D = k.shape
    if T == 0:
        return
    fmt = cache_format(k_data)
    B = k_data.shape[2]
    k, v = k.contiguous(), v.contiguous()
    slot_mapping = slot_mapping.contiguous()
    kd, vd = u8_view(k_data), u8_view(v_data)
    if fmt != FMT_NVFP4:
        k_scale_blocks = v_scale_blocks = kd  # unused placeholders
    ks, vs = u8_view(k_scale_blocks), u8_view(v_scale_blocks)
    has_idx = ik is not None and idx_data is not None
    if has_idx:
        ik = ik.contiguous()
        ifmt = cache_format(idx_data)
        idd = u8_view(idx_data)
        isb = u8_view(idx_scale_blocks) if ifmt == FMT_NVFP4 else idd
        di = ik.shape[-1]
        if idx_data.shape[1] != B:
            raise ValueError("index-key pages must have the same block size as K/V pages")
    else:
        ik, idd, isb, ifmt, di = k, kd, kd, fmt, 16
    h_pad = next_pow2(H)
    tb = max(1, (64 if interpreting() else 16) // h_pad)  # tokens per program
    _kv_insert_kernel[(triton.cdiv(T, tb), 3 if has_idx else 2)](
        slot_mapping, T,
        k, v, k.stride(0), k.stride(1),
        kd, vd, kd.stride(0), kd.stride(1), kd.stride(2),
        ks, vs, ks.stride(0), ks.stride(1), ks.stride(2),
        float(k_scale), float(v_scale),
        ik, ik.stride(0),
        idd, idd.stride(0), idd.stride(1),
        isb, isb.stride(0), isb.stride(1),
        float(idx_scale),
        H, B,
        FMT=fmt, IFMT=ifmt, H_PAD=h_pad, TB=tb, D=D, DI=di,
        num_warps=4,
    )
