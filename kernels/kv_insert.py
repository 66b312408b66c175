"""Write new K/V (and index keys) into a layer's cache pages, quantizing on the way (bf16 / fp8 / nvfp4).

The layer's cache: `cache.LayerCache` (layout there). Slots < 0 are skipped (padding).

* ``kv_insert_ref``: the readable torch path (``nvfp4.quantize_nvfp4`` / ``fp8.quantize_fp8`` + index_put).
* ``kv_insert``: one Triton launch for K, V and the index key. NVFP4 and FP8 bytes are bit-exact with the
  references: exact (round-to-nearest) division everywhere, E4M3 rounding in integer ops
  (``codecs.f32_to_e4m3_bits``), E2M1 by the same threshold chain. (vLLM uses ``rcp.approx``, so its
  bytes may differ from both on rare ties: formats.md 1.4.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import dispatch, fp8, nvfp4
from .cache import LayerCache, cache_part
from .codecs import FMT_FP8, FMT_NVFP4, FP8, NVFP4, cache_format, cast_to, fp8_encode, nvfp4_encode, u8_view

__all__ = ["kv_insert_ref", "kv_insert"]


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


def kv_insert_ref(k, v, slot_mapping, cache: LayerCache, ik=None) -> None:
    """k, v ``[T, H_kv, D]``, ik ``[T, D_idx]`` (or None), slot_mapping ``int64 [T]``: quantize and write them into
    the layer's pages in place (the index key where the cache has index pages)."""
    _store_one_ref(k, slot_mapping, *cache_part(cache, "k"))
    _store_one_ref(v, slot_mapping, *cache_part(cache, "v"))
    _store_one_ref(ik, slot_mapping, *cache_part(cache, "index"))


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
    if FMT == NVFP4:
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
        if FMT == FP8:
            tl.store(dst_ptr + dst_row[:, None] + dd, fp8_encode(x.to(tl.float32), scale), mask=m)
        else:
            tl.store(dst_ptr + dst_row[:, None] + dd, cast_to(x, dst_ptr.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["T"])
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


def paged_operands(cache: LayerCache, with_index: bool):
    """What the insert kernels write, as they take it: ``(fmt, index fmt, B, (K, V, K scales, V scales),
    (index, index scales))``, e4m3 tensors as uint8 views (the kernels write bits); the data again as unused
    placeholders where a format has no block scales, K's where the layer writes no index key."""
    fmt = cache_format(cache.k)
    B = cache.k.shape[2]
    kd, vd = u8_view(cache.k), u8_view(cache.v)
    ks, vs = (u8_view(cache.k_scale_blocks), u8_view(cache.v_scale_blocks)) if fmt == FMT_NVFP4 else (kd, kd)
    if not with_index:
        return fmt, fmt, B, (kd, vd, ks, vs), (kd, kd)
    if cache.index is None or cache.index.shape[1] != B:
        raise ValueError("a sparse layer needs index-key pages with the K/V block size")
    ifmt = cache_format(cache.index)
    idd = u8_view(cache.index)
    return fmt, ifmt, B, (kd, vd, ks, vs), (idd, u8_view(cache.index_scale_blocks) if ifmt == FMT_NVFP4 else idd)


def kv_insert(k, v, slot_mapping, cache: LayerCache, ik=None) -> None:
    """Triton version of :func:`kv_insert_ref` (same signature, same bytes): one launch, grid
    (token blocks, K | V | index key)."""
    T, H, D = k.shape
    if T == 0:
        return
    has_idx = ik is not None and cache.index is not None
    fmt, ifmt, B, (kd, vd, ks, vs), (idd, isb) = paged_operands(cache, has_idx)
    k, v = k.contiguous(), v.contiguous()
    slot_mapping = slot_mapping.contiguous()
    ik, di, idx_scale = (ik.contiguous(), ik.shape[-1], cache.index_scale) if has_idx else (k, 16, 1.0)
    h_pad = dispatch.next_pow2(H)
    tb = dispatch.insert_tokens(h_pad)
    _kv_insert_kernel[(triton.cdiv(T, tb), 3 if has_idx else 2)](
        slot_mapping, T,
        k, v, k.stride(0), k.stride(1),
        kd, vd, kd.stride(0), kd.stride(1), kd.stride(2),
        ks, vs, ks.stride(0), ks.stride(1), ks.stride(2),
        float(cache.k_scale), float(cache.v_scale),
        ik, ik.stride(0),
        idd, idd.stride(0), idd.stride(1),
        isb, isb.stride(0), isb.stride(1),
        float(idx_scale),
        H, B,
        FMT=fmt, IFMT=ifmt, H_PAD=h_pad, TB=tb, D=D, DI=di,
        num_warps=dispatch.tuning().insert_num_warps,
    )
