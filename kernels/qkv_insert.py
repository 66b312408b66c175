"""From the fused QKV projection to attention-ready tensors in one pass: QK RMSNorm, partial RoPE, and the
new K / V / index key quantized into their cache pages.

The attention layer runs one GEMM for all its projections (``qkv = x @ W_qkv^T``); its columns are, per
token: ``q [H_q, D] | k [H_kv, D] | v [H_kv, D] | iq [H_i, D_i] | ik [D_i]`` (the indexer parts on sparse
layers only). Then, per head row:

* q, k, iq, ik: Gemma RMSNorm (``x * rsqrt(mean(x^2) + eps) * (1 + w)``, fp32), then NeoX RoPE on the first
  ``rot`` channels (``x * cos + rotate_half(x) * sin`` in fp32, ``cos``/``sin`` of the step's positions as the
  model computed them, in its dtype like transformers);
* v: as is;
* q and iq are written to their outputs, k, v and ik to their pages (bf16 / fp8 / nvfp4, same bytes as
  ``kv_insert`` would write for the same values).

``qkv_insert_ref`` is the readable torch path (fp32 throughout, then ``kv_insert_ref``). The model's own
unfused path rounds to the activation dtype between norm and RoPE; this one does not (it is closer to fp32).

``qkv_insert`` is one Triton launch, grid (token tiles, head rows): each program normalizes and rotates one
head of TB tokens from registers. The rotate-half partner of each channel is a second load of the same row
(an L1 hit) instead of a register shuffle, so the kernel is plain ``tl`` (ROCm, interpreter) and the partial
rotation is a mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import dispatch
from .cache import LayerCache
from .codecs import FP8, NVFP4, PLAIN, cast_to, fp8_encode, nvfp4_encode
from .kv_insert import kv_insert_ref, paged_operands

__all__ = ["QKVLayout", "qkv_insert_ref", "qkv_insert"]


@dataclass(frozen=True)
class QKVLayout:
    """Column layout of the fused projection output (per-rank head counts under tensor parallelism)."""

    n_q: int  # query heads
    n_kv: int  # KV heads
    head_dim: int
    rot: int  # rotated channels (partial RoPE), even, <= head_dim and <= index_dim
    n_idx: int = 0  # index heads (0 on dense layers)
    index_dim: int = 0

    @property
    def sizes(self) -> list[int]:
        d, di = self.head_dim, self.index_dim
        s = [self.n_q * d, self.n_kv * d, self.n_kv * d]
        return s + ([self.n_idx * di, di] if self.n_idx else [])

    @property
    def width(self) -> int:
        return sum(self.sizes)


# ----------------------------------------------------------------------------------------------- torch reference
def _norm_rope(x: torch.Tensor, w: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] -> RMSNorm(1 + w) then RoPE on the first cos.shape[-1] channels; fp32."""
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())
    rot = cos.shape[-1]
    c, s = cos[:, None, :].float(), sin[:, None, :].float()
    xr = x[..., :rot]
    h = rot // 2
    rotated = torch.cat((-xr[..., h:], xr[..., :h]), dim=-1)
    return torch.cat((xr * c + rotated * s, x[..., rot:]), dim=-1)


def qkv_insert_ref(qkv, layout: QKVLayout, norms, eps: float, cos, sin, slot_mapping, cache: LayerCache,
                   out_dtype=None):
    """qkv ``[T, layout.width]``; norms = (q_w, k_w, iq_w, ik_w) (the last two None on dense layers);
    cos/sin ``[T, rot]``. Writes the layer's K/V/index-key pages; returns ``(q [T, H_q, D], iq [T, H_i, D_i] or
    None)``."""
    t = qkv.shape[0]
    out_dtype = out_dtype or qkv.dtype
    parts = torch.split(qkv, layout.sizes, dim=-1)
    d = layout.head_dim
    q = _norm_rope(parts[0].view(t, layout.n_q, d), norms[0], eps, cos, sin)
    k = _norm_rope(parts[1].view(t, layout.n_kv, d), norms[1], eps, cos, sin)
    v = parts[2].view(t, layout.n_kv, d).float()
    iq = ik = None
    if layout.n_idx:
        di = layout.index_dim
        iq = _norm_rope(parts[3].view(t, layout.n_idx, di), norms[2], eps, cos, sin)
        ik = _norm_rope(parts[4].view(t, 1, di), norms[3], eps, cos, sin)[:, 0]
    kv_insert_ref(k, v, slot_mapping, cache, ik=ik)
    return q.to(out_dtype), None if iq is None else iq.to(out_dtype)


# ----------------------------------------------------------------------------------------------- Triton kernel
@triton.jit
def _values(src_ptr, row, ok, cols, rstd, w_ptr, cos_ptr, sin_ptr, cs_row,
            NORM: tl.constexpr, ROPE: tl.constexpr, ROT: tl.constexpr):
    """fp32 values of channels ``cols`` of the rows at ``src_ptr + row`` (masked by ``ok``), normed and rotated."""
    m = ok & (cols >= 0)
    x = tl.load(src_ptr + row + cols, mask=m, other=0.0).to(tl.float32)
    if NORM:
        x = x * rstd * (1.0 + tl.load(w_ptr + cols).to(tl.float32))
    if ROPE:
        HALF: tl.constexpr = ROT // 2
        in_rot = cols < ROT
        partner = tl.where(cols < HALF, cols + HALF, tl.where(in_rot, cols - HALF, cols))
        xp = tl.load(src_ptr + row + partner, mask=m, other=0.0).to(tl.float32)
        if NORM:
            xp = xp * rstd * (1.0 + tl.load(w_ptr + partner).to(tl.float32))
        cc = tl.where(in_rot, cols, 0)
        c = tl.load(cos_ptr + cs_row + cc, mask=m & in_rot, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + cs_row + cc, mask=m & in_rot, other=0.0).to(tl.float32)
        x = tl.where(in_rot, x * c + tl.where(cols < HALF, -xp, xp) * s, x)
    return x


@triton.jit
def _head_rows(src_ptr, s_t, col0, t0, T, w_ptr, eps, cos_ptr, sin_ptr, cs_t,
               dst_ptr, sd_p, sd_t, head_off, sb_ptr, ss_p, ss_t, sb_head_off, scale, slot_ptr, B,
               D: tl.constexpr, ROT: tl.constexpr, TB: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr,
               PAGED: tl.constexpr, FMT: tl.constexpr):
    """One head of TB tokens: channels ``col0 .. col0 + D`` of each token's row, to an output row (PAGED=False:
    ``dst + tok * sd_t + head_off``) or to the token's cache slot (``page * sd_p + head_off + offset * sd_t``)."""
    tok = t0 + tl.arange(0, TB)
    if PAGED:
        slot = tl.load(slot_ptr + tok, mask=tok < T, other=-1).to(tl.int64)
        ok1 = slot >= 0
        page = tl.where(ok1, slot // B, 0)
        dst_row = page * sd_p + head_off + (slot % B) * sd_t
    else:
        ok1 = tok < T
        dst_row = tok.to(tl.int64) * sd_t + head_off
    row = (tok.to(tl.int64) * s_t + col0)[:, None, None]
    cs_row = (tok.to(tl.int64) * cs_t)[:, None, None]
    ok = ok1[:, None, None]
    rstd = tl.zeros([TB, 1, 1], dtype=tl.float32)
    if NORM:
        dd = tl.arange(0, D)[None, None, :]
        x = tl.load(src_ptr + row + dd, mask=ok & (dd >= 0), other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=2) / D + eps)[:, :, None]  # [TB, 1, 1]
    if FMT == NVFP4:
        gg = tl.arange(0, D // 16)[None, :, None]
        ii = tl.arange(0, 8)[None, None, :]
        xe = _values(src_ptr, row, ok, gg * 16 + ii * 2, rstd, w_ptr, cos_ptr, sin_ptr, cs_row, NORM, ROPE, ROT)
        xo = _values(src_ptr, row, ok, gg * 16 + ii * 2 + 1, rstd, w_ptr, cos_ptr, sin_ptr, cs_row, NORM, ROPE, ROT)
        byte, sf_bits = nvfp4_encode(xe, xo, scale)
        tl.store(dst_ptr + dst_row[:, None, None] + gg * 8 + ii, byte, mask=ok & (gg >= 0) & (ii >= 0))
        g2 = tl.arange(0, D // 16)[None, :]
        sb_row = page * ss_p + sb_head_off + (slot % B) * ss_t
        tl.store(sb_ptr + sb_row[:, None] + g2, sf_bits, mask=ok1[:, None] & (g2 >= 0))
    else:
        dd = tl.arange(0, D)[None, None, :]
        y = _values(src_ptr, row, ok, dd, rstd, w_ptr, cos_ptr, sin_ptr, cs_row, NORM, ROPE, ROT)
        m = ok & (dd >= 0)
        if FMT == FP8:
            tl.store(dst_ptr + dst_row[:, None, None] + dd, fp8_encode(y, scale), mask=m)
        else:
            tl.store(dst_ptr + dst_row[:, None, None] + dd, cast_to(y, dst_ptr.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["T"])
def _qkv_insert_kernel(
    qkv_ptr, s_t, T, cos_ptr, sin_ptr, cs_t, eps, slot_ptr, B,
    qw_ptr, kw_ptr, iqw_ptr, ikw_ptr,
    q_ptr, sq_t, sq_h, iq_ptr, siq_t, siq_h,
    kd_ptr, vd_ptr, sd_p, sd_h, sd_t, ks_ptr, vs_ptr, ss_p, ss_h, ss_t, k_scale, v_scale,
    id_ptr, sid_p, sid_t, is_ptr, sis_p, sis_t, idx_scale,
    HQ: tl.constexpr, HKV: tl.constexpr, HI: tl.constexpr, D: tl.constexpr, DI: tl.constexpr,
    ROT: tl.constexpr, TB: tl.constexpr, FMT: tl.constexpr, IFMT: tl.constexpr,
):
    t0 = tl.program_id(0) * TB
    j = tl.program_id(1)  # head row: q heads, k heads, v heads, index-query heads, the index key
    if j < HQ:
        _head_rows(qkv_ptr, s_t, j * D, t0, T, qw_ptr, eps, cos_ptr, sin_ptr, cs_t,
                   q_ptr, 0, sq_t, j * sq_h, q_ptr, 0, 0, 0, 1.0, slot_ptr, B,
                   D, ROT, TB, True, True, False, PLAIN)
    elif j < HQ + HKV:
        h = j - HQ
        _head_rows(qkv_ptr, s_t, (HQ + h) * D, t0, T, kw_ptr, eps, cos_ptr, sin_ptr, cs_t,
                   kd_ptr, sd_p, sd_t, h * sd_h, ks_ptr, ss_p, ss_t, h * ss_h, k_scale, slot_ptr, B,
                   D, ROT, TB, True, True, True, FMT)
    elif j < HQ + 2 * HKV:
        h = j - HQ - HKV
        _head_rows(qkv_ptr, s_t, (HQ + HKV + h) * D, t0, T, kw_ptr, eps, cos_ptr, sin_ptr, cs_t,
                   vd_ptr, sd_p, sd_t, h * sd_h, vs_ptr, ss_p, ss_t, h * ss_h, v_scale, slot_ptr, B,
                   D, ROT, TB, False, False, True, FMT)
    elif j < HQ + 2 * HKV + HI:
        h = j - HQ - 2 * HKV
        _head_rows(qkv_ptr, s_t, (HQ + 2 * HKV) * D + h * DI, t0, T, iqw_ptr, eps, cos_ptr, sin_ptr, cs_t,
                   iq_ptr, 0, siq_t, h * siq_h, iq_ptr, 0, 0, 0, 1.0, slot_ptr, B,
                   DI, ROT, TB, True, True, False, PLAIN)
    else:
        _head_rows(qkv_ptr, s_t, (HQ + 2 * HKV) * D + HI * DI, t0, T, ikw_ptr, eps, cos_ptr, sin_ptr, cs_t,
                   id_ptr, sid_p, sid_t, 0, is_ptr, sis_p, sis_t, 0, idx_scale, slot_ptr, B,
                   DI, ROT, TB, True, True, True, IFMT)


def qkv_insert(qkv, layout: QKVLayout, norms, eps: float, cos, sin, slot_mapping, cache: LayerCache,
               out_dtype=None):
    """Triton version of :func:`qkv_insert_ref` (same signature and contract), one launch."""
    T = qkv.shape[0]
    if qkv.shape[-1] != layout.width:
        raise ValueError(f"qkv has {qkv.shape[-1]} columns, the layout needs {layout.width}")
    d, di, rot = layout.head_dim, layout.index_dim, layout.rot
    if rot % 2 or rot > d or (layout.n_idx and rot > di) or cos.shape[-1] != rot:
        raise ValueError(f"rotary dim {rot} (cos has {cos.shape[-1]}) must be even and fit every head")
    for dim in (d, di) if layout.n_idx else (d,):
        if dim != dispatch.next_pow2(dim) or dim < 16:
            raise ValueError(f"head dims must be powers of two >= 16, got {dim}")
    out_dtype = out_dtype or qkv.dtype
    dev = qkv.device
    q = torch.empty(T, layout.n_q, d, dtype=out_dtype, device=dev)
    iq = torch.empty(T, layout.n_idx, di, dtype=out_dtype, device=dev) if layout.n_idx else None
    if T == 0:
        return q, iq
    qkv = qkv.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    slot_mapping = slot_mapping.contiguous()
    fmt, ifmt, B, (kd, vd, ks, vs), (idd, isb) = paged_operands(cache, bool(layout.n_idx))
    qw, kw = norms[0], norms[1]
    if layout.n_idx:
        iqw, ikw, iq_t = norms[2], norms[3], iq
    else:  # unused placeholders
        iqw, ikw, iq_t, di = qw, kw, q, 16
    t = dispatch.tuning()
    tb = t.qkv_insert_tokens
    rows = layout.n_q + 2 * layout.n_kv + (layout.n_idx + 1 if layout.n_idx else 0)
    _qkv_insert_kernel[(triton.cdiv(T, tb), rows)](
        qkv, qkv.stride(0), T, cos, sin, cos.stride(0), float(eps), slot_mapping, B,
        qw, kw, iqw, ikw,
        q, q.stride(0), q.stride(1), iq_t, iq_t.stride(0), iq_t.stride(1),
        kd, vd, kd.stride(0), kd.stride(1), kd.stride(2), ks, vs, ks.stride(0), ks.stride(1), ks.stride(2),
        float(cache.k_scale), float(cache.v_scale),
        idd, idd.stride(0), idd.stride(1), isb, isb.stride(0), isb.stride(1), float(cache.index_scale or 1.0),
        HQ=layout.n_q, HKV=layout.n_kv, HI=layout.n_idx, D=d, DI=di, ROT=rot, TB=tb, FMT=fmt, IFMT=ifmt,
        num_warps=t.insert_num_warps,
    )
    return q, iq
