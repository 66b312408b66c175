"""The grouped GEMM of `grouped_gemm.py` for decode-sized steps on NVIDIA sm_89 / sm_90 (Hopper first), in Gluon:
weights are the mma's M side (swap-AB: each decoded weight tile serves every token of its tile), decoded in
registers straight into ``mma.sync`` m16n8k16 operand fragments, as `nvfp4_mma.py` does for the NVFP4 KV cache.

Per K chunk of 128 elements, each thread loads 16 (NVFP4) or 32 (MXFP8 / FP8) contiguous bytes of each of its two
rows of every 16-row weight tile (one tile = one contiguous block of `weight_layout`, so a warp load instruction
reads 512 contiguous bytes), and 64 contiguous bytes of fp16 activations per token. Decoders (inline PTX, two
values per 32-bit op):

* NVFP4: ``nvfp4_mma._INT_ASM``: codes k and k + 4 of a 32-bit word into one f16x2 (sign -> bit 15, magnitude ->
  bits 9-11), times the block scale (``S * 2^7``): values ``E2M1 * S * 2^-7``, exact.
* MXFP8 / FP8: ``_MX_ASM``: bytes 0 / 2 and 1 / 3 of a word into two f16x2 (``e4m3 * 2^-8``, exact), times the
  block multiplier of `weight_layout` (1 for FP8).

Both produce, per group of 8 elements, the f16x2 pairs (j, j + 4); the activations are stored in the matching order
by the kernels that write them (``moe_router.x16_position``), so each thread's 32 elements of a chunk are its mma
fragments once the reduction dimension is *permuted*: the thread's position p = 4 s + 2 b + a (s the k16 step, b
which half of it, a which of the pair) is logical column 16 s + 8 b + 2 t + a. A dot product does not care about
the order, and ``convert_layout(..., assert_trivial=True)`` proves at compile time that no data moves.

A program computes ``R = 16 * P`` weight rows against one tile of up to ``NT`` rows (tokens or assignments): its
``NUM_WARPS`` warps take every NUM_WARPS-th K chunk (a batched mma over a leading warp dimension, summed at the end),
each with ``UNROLL`` chunks' loads issued before the first is decoded. Tiles,
modes, row indices and epilogues are those of `grouped_gemm.py` (gate_up writes its output in the activation
order above, fp16, for the down projection to read).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .grouped_gemm import MODE_GATE_UP, launch_grid
from . import platform
from .nvfp4_mma import _INT_ASM
from .codecs import FMT_FP8, FMT_MXFP8, FMT_NVFP4, FP8, MXFP8, NVFP4
from .weight_layout import CHUNK_K, TILE_N, PackedWeight

NUM_WARPS = 4
UNSCALE = {FMT_NVFP4: 128.0, FMT_MXFP8: 256.0, FMT_FP8: 256.0}  # decoded value -> true value (times rowscale)

# e4m3 bytes 0 / 2 and 1 / 3 of $2 -> f16x2 valued e4m3 * 2^-8, times the block multiplier $3
_MX_ASM = gl.constexpr("""
{
.reg .b32 a, b;
and.b32 a, $2, 0x007F007F;
shl.b32 a, a, 7;
and.b32 b, $2, 0x00800080;
shl.b32 b, b, 8;
or.b32 a, a, b;
mul.rn.f16x2 $0, a, $3;
and.b32 a, $2, 0x7F007F00;
shr.b32 a, a, 1;
and.b32 b, $2, 0x80008000;
or.b32 a, a, b;
mul.rn.f16x2 $1, a, $3;
}
""")


def available(device: torch.device) -> bool:
    """The platform gate `platform.moe_mma_ok`."""
    return platform.moe_mma_ok(device)


def supported(w: PackedWeight) -> bool:
    return w.fmt in (FMT_NVFP4, FMT_MXFP8, FMT_FP8)


def _bits(n: int) -> int:
    return n.bit_length() - 1


def _bases(dim0: list[int], dims: int, pos: int) -> list[list[int]]:
    out = []
    for v in dim0:
        b = [0] * dims
        b[pos] = v
        out.append(b)
    return out


@functools.lru_cache(maxsize=None)
def layouts(p: int, nt: int, w: int = NUM_WARPS) -> dict:
    """Distributed layouts of a program: ``w`` warps, each on every w-th K chunk (dim 0), of ``16 p`` weight rows
    (dim 1) against ``nt`` activation rows."""
    rows_reg = [8] + [16 << i for i in range(_bits(p))]
    warp = _bases([1 << i for i in range(_bits(w))], 3, 0)
    lay = {}
    for name, nbytes in (("fp4", 64), ("fp8", 128)):  # weight bytes per tile row and chunk
        per = nbytes // 4  # bytes per thread and row
        lay[name] = gl.DistributedLinearLayout(
            reg_bases=_bases([1 << i for i in range(_bits(per))], 3, 2) + _bases(rows_reg, 3, 1),
            lane_bases=_bases([per, 2 * per], 3, 2) + _bases([1, 2, 4], 3, 1),
            warp_bases=warp, block_bases=[], shape=[w, 16 * p, nbytes])
    warp4 = _bases([1 << i for i in range(_bits(w))], 4, 0)
    # nvfp4 bytes as [w, rows, 8 groups of 16 elements, 8 bytes] (the decoder's view) and its block scales
    lay["fp4_4d"] = gl.DistributedLinearLayout(
        reg_bases=_bases([1, 2, 4], 4, 3) + _bases([1], 4, 2) + _bases(rows_reg, 4, 1),
        lane_bases=_bases([2, 4], 4, 2) + _bases([1, 2, 4], 4, 1),
        warp_bases=warp4, block_bases=[], shape=[w, 16 * p, 8, 8])
    lay["fp4_sc"] = gl.SliceLayout(3, lay["fp4_4d"])
    # mxfp8 bytes as [w, rows, 4 blocks of 32, 32] and its block multipliers (one per thread and row)
    lay["fp8_4d"] = gl.DistributedLinearLayout(
        reg_bases=_bases([1, 2, 4, 8, 16], 4, 3) + _bases(rows_reg, 4, 1),
        lane_bases=_bases([1, 2], 4, 2) + _bases([1, 2, 4], 4, 1),
        warp_bases=warp4, block_bases=[], shape=[w, 16 * p, 4, 32])
    lay["fp8_sc"] = gl.SliceLayout(3, lay["fp8_4d"])
    # activations [w, nt rows, 128 positions]: 32 contiguous fp16 per thread
    lay["act"] = gl.DistributedLinearLayout(
        reg_bases=_bases([1, 2, 4, 8, 16], 3, 2) + _bases([8 << i for i in range(_bits(nt // 8))], 3, 1),
        lane_bases=_bases([32, 64], 3, 2) + _bases([1, 2, 4], 3, 1),
        warp_bases=warp, block_bases=[], shape=[w, nt, 128])
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[w, 1, 1], instr_shape=[1, 16, 8])
    lay["mma"] = mma
    lay["a"] = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    lay["b"] = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    lay["e"] = gl.BlockedLayout([1], [32], [w], [0])
    return lay


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _routed_tile(counts_ptr, tile, E, E_PAD: gl.constexpr, BM: gl.constexpr, LE: gl.constexpr):
    """As `grouped_gemm.routed_tile`: routed tile -> (expert, first bucket slot, rows in the tile)."""
    e = gl.arange(0, E_PAD, layout=LE)
    c = gl.load(counts_ptr + e, mask=e < E, other=0)
    nt = (c + BM - 1) // BM
    expert = gl.sum((gl.associative_scan(nt, 0, _add) <= tile).to(gl.int32), 0)
    first = (tile - gl.sum(gl.where(e < expert, nt, 0), 0)) * BM  # the expert's first tile starts its bucket
    return gl.minimum(expert, E - 1), first, gl.minimum(gl.sum(gl.where(e == expert, c, 0), 0) - first, BM)


@gluon.jit
def _to_logical(v, W: gl.constexpr, R: gl.constexpr):
    """[W, R, 128] in a thread's position order (p = 4 s + 2 b + a within each 32) -> logical mma column order."""
    v = gl.permute(gl.reshape(v, [W, R, 4, 8, 2, 2]), [0, 1, 3, 4, 2, 5])
    return gl.reshape(v, [W, R, 128])


@gluon.jit
def _w_offsets(g, row0, NT16, KC, W: gl.constexpr, R: gl.constexpr, NB: gl.constexpr, NS: gl.constexpr,
               LD: gl.constexpr, LS: gl.constexpr):
    """Offsets of warp w's first chunk (chunk w) of a program's R weight rows: bytes [W, R, NB], scales [W, R, NS]."""
    w = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, LD)))
    r = gl.arange(0, R, layout=gl.SliceLayout(0, gl.SliceLayout(2, LD)))
    rc = ((g * NT16 + (row0 + r) // 16).to(gl.int64) * KC * 16 + (row0 + r) % 16)[None, :] + w[:, None] * 16
    boff = rc[:, :, None] * NB + gl.arange(0, NB, layout=gl.SliceLayout(0, gl.SliceLayout(1, LD)))[None, None, :]
    ws = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, LS)))
    rs = gl.arange(0, R, layout=gl.SliceLayout(0, gl.SliceLayout(2, LS)))
    rcs = ((g * NT16 + (row0 + rs) // 16).to(gl.int64) * KC * 16 + (row0 + rs) % 16)[None, :] + ws[:, None] * 16
    soff = rcs[:, :, None] * NS + gl.arange(0, NS, layout=gl.SliceLayout(0, gl.SliceLayout(1, LS)))[None, None, :]
    return boff, soff


@gluon.jit
def _w_load(data, scale, boff, soff, c, FMT: gl.constexpr, NB: gl.constexpr, NS: gl.constexpr):
    """Raw bytes and block scales of the chunks c + w (a chunk of 16 tile rows is 16 rows further)."""
    w = gl.load(data + boff + c * (16 * NB))
    if FMT == FP8:
        return w, w
    else:
        return w, gl.load(scale + soff + c * (16 * NS))


@gluon.jit
def _w_decode(raw, sc, FMT: gl.constexpr, W: gl.constexpr, R: gl.constexpr, L4: gl.constexpr, LA: gl.constexpr):
    """Raw chunk [W, R, bytes] -> the A operand [W, R, 128] (fp16, logical column order)."""
    if FMT == NVFP4:
        x = gl.convert_layout(gl.reshape(raw, [W, R, 8, 8]), L4, assert_trivial=True)
        s = gl.expand_dims(sc.to(gl.float16) * 128.0, 3)
        o0, o1 = gl.inline_asm_elementwise(_INT_ASM, "=r,=r,=r,=r,r,r,r", [x, s],
                                           dtype=(gl.float16, gl.float16), is_pure=True, pack=4)
        # o0 / o1 at byte 4 u + j of a group hold codes [0 4 1 5][j] / [2 6 3 7][j] of word u, so the position of
        # (group = 2 t + gb, u, o, j) is 16 gb + 8 u + 4 o + j; logical: s = o + 2 u + 4 gb, b = j >> 1, a = j & 1
        v = gl.reshape(gl.join(o0, o1), [W, R, 4, 2, 2, 2, 2, 2])  # (t, gb, u, j1, j0, o)
        v = gl.reshape(gl.permute(v, [0, 1, 3, 4, 7, 5, 2, 6]), [W, R, 128])  # (gb, u, o, j1, t, j0)
    else:
        x = gl.convert_layout(gl.reshape(raw, [W, R, 4, 32]), L4, assert_trivial=True)
        if FMT == MXFP8:
            s = gl.expand_dims(sc, 3)
        else:
            s = gl.full([W, R, 4, 1], 1.0, gl.float16, layout=L4)
        o = gl.inline_asm_elementwise(_MX_ASM, "=r,=r,r,r,r", [x, s], dtype=gl.float16, is_pure=True, pack=4)
        v = _to_logical(gl.reshape(o, [W, R, 128]), W, R)
    return gl.convert_layout(v, LA, assert_trivial=True)


@gluon.jit
def _chunk(x_ptr, xoff, xmask, data, scale, boff, soff, boff2, soff2, c, acc, acc2, FMT: gl.constexpr,
           TWO: gl.constexpr, W: gl.constexpr, R: gl.constexpr, NT: gl.constexpr, NB: gl.constexpr,
           NS: gl.constexpr, L4: gl.constexpr, LA: gl.constexpr, LB: gl.constexpr):
    """One K chunk per warp (chunks c + w): loads, decode, mma."""
    wr, ws = _w_load(data, scale, boff, soff, c, FMT, NB, NS)
    if TWO:
        wr2, ws2 = _w_load(data, scale, boff2, soff2, c, FMT, NB, NS)
    xr = gl.load(x_ptr + xoff + c * 128, mask=xmask, other=0.0)
    xb = gl.convert_layout(gl.permute(_to_logical(xr, W, NT), [0, 2, 1]), LB, assert_trivial=True)
    acc = mma_v2(_w_decode(wr, ws, FMT, W, R, L4, LA), xb, acc)
    if TWO:
        acc2 = mma_v2(_w_decode(wr2, ws2, FMT, W, R, L4, LA), xb, acc2)
    return acc, acc2


@gluon.jit
def _gemm(x_ptr, xoff, xmask, data, scale, g, row0, row0b, NT16, KC, FMT: gl.constexpr, TWO: gl.constexpr,
          W: gl.constexpr, R: gl.constexpr, NT: gl.constexpr, UNROLL: gl.constexpr, LD: gl.constexpr,
          LS: gl.constexpr, L4: gl.constexpr, MMA: gl.constexpr, LA: gl.constexpr, LB: gl.constexpr):
    """Partial sums [W, R, NT] (a second set for the rows from row0b when TWO: gate / up) of each warp's chunks
    (KC % (W * UNROLL) == 0); UNROLL chunks' loads are issued before the first of them is decoded."""
    NB: gl.constexpr = 64 if FMT == NVFP4 else 128
    NS: gl.constexpr = 8 if FMT == NVFP4 else 4
    boff, soff = _w_offsets(g, row0, NT16, KC, W, R, NB, NS, LD, LS)
    boff2, soff2 = _w_offsets(g, row0b, NT16, KC, W, R, NB, NS, LD, LS)
    acc = gl.zeros([W, R, NT], gl.float32, layout=MMA)
    acc2 = gl.zeros([W, R, NT], gl.float32, layout=MMA)
    for c0 in tl.range(0, KC, W * UNROLL, loop_unroll_factor=1):
        for u in gl.static_range(UNROLL):
            acc, acc2 = _chunk(x_ptr, xoff, xmask, data, scale, boff, soff, boff2, soff2, c0 + u * W, acc, acc2,
                               FMT, TWO, W, R, NT, NB, NS, L4, LA, LB)
    return acc, acc2


@gluon.jit
def _tile(x_ptr, sx, xrow, nrows, orow, wt, data, scale, rsc, g, row0, NT16, KC, NG, N_OUT, N_PAD,
          out_ptr, so, alpha, limit, unscale, MODE: gl.constexpr, FMT: gl.constexpr, W: gl.constexpr,
          R: gl.constexpr, NT: gl.constexpr, UNROLL: gl.constexpr, LD: gl.constexpr, LS: gl.constexpr,
          L4: gl.constexpr, LACT: gl.constexpr, MMA: gl.constexpr, LA: gl.constexpr, LB: gl.constexpr):
    """One program's rows against one tile: GEMM, sum of the warps' partials, epilogue, store (as
    `grouped_gemm._tile_body`)."""
    LW: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, LACT))
    LN: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, LACT))
    LK: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, LACT))
    wv = gl.arange(0, W, layout=LW)
    n_act = gl.arange(0, NT, layout=LN)
    k_act = gl.arange(0, 128, layout=LK)
    xoff = (gl.convert_layout(xrow, LN)[None, :] * sx + wv[:, None] * 128)[:, :, None] + k_act[None, None, :]
    xmask = ((wv >= 0)[:, None] & (n_act < nrows)[None, :])[:, :, None] & (k_act >= 0)[None, None, :]
    acc, acc2 = _gemm(x_ptr, xoff, xmask, data, scale, g, row0, row0 + NG, NT16, KC, FMT, MODE == 0, W, R, NT,
                      UNROLL, LD, LS, L4, MMA, LA, LB)
    OUT: gl.constexpr = gl.SliceLayout(0, MMA)
    r = gl.arange(0, R, layout=gl.SliceLayout(1, OUT))
    n = gl.arange(0, NT, layout=gl.SliceLayout(0, OUT))
    orow_m = gl.convert_layout(orow, gl.SliceLayout(0, OUT))
    nmask = n < nrows
    rows = row0 + r
    y = gl.sum(acc, 0) * (gl.load(rsc + g * N_PAD + rows) * unscale)[:, None]
    if MODE == 0:
        up = gl.sum(acc2, 0) * (gl.load(rsc + g * N_PAD + NG + rows) * unscale)[:, None]
        gate = gl.minimum(y, limit)
        up = gl.minimum(gl.maximum(up, -limit), limit)
        y = (up + 1.0) * (gate / (1.0 + gl.exp(-alpha * gate)))
        y = y * gl.convert_layout(wt, gl.SliceLayout(0, OUT))[None, :]
        pos = (rows & -8) + 2 * (rows & 3) + ((rows >> 2) & 1)  # moe_router.x16_position
        gl.store(out_ptr + orow_m[None, :] * so + pos[:, None], y.to(gl.float16),
                 mask=(rows < NG)[:, None] & nmask[None, :])
    else:
        gl.store(out_ptr + orow_m[None, :] * so + rows[:, None], y.to(out_ptr.dtype.element_ty),
                 mask=(rows < N_OUT)[:, None] & nmask[None, :])


@gluon.jit(do_not_specialize=["T", "cap", "n_plain_tiles", "x_off", "out_off"])
def _grouped_gemm_mma_kernel(
    x_ptr, sx,
    w_data, w_scale, w_rows,
    s_data, s_scale, s_rows,
    counts_ptr, bucket_ptr, cap, tw_ptr,
    out_ptr, so,
    T, NG, N_OUT, n_plain_tiles, x_off, out_off, scaling, alpha, limit, w_unscale, s_unscale,
    E, NT16, KC, N_PAD,
    MODE: gl.constexpr, FMT: gl.constexpr, SFMT: gl.constexpr, ROUTED: gl.constexpr, X_DIV: gl.constexpr,
    E_PAD: gl.constexpr, W: gl.constexpr, R: gl.constexpr, NT: gl.constexpr, UNROLL: gl.constexpr,
    LD_W: gl.constexpr, LS_W: gl.constexpr, L4_W: gl.constexpr, LD_S: gl.constexpr, LS_S: gl.constexpr,
    L4_S: gl.constexpr, LACT: gl.constexpr, MMA: gl.constexpr, LA: gl.constexpr, LB: gl.constexpr,
    LE: gl.constexpr,
):
    tile = gl.program_id(0)
    row0 = gl.program_id(1) * R
    LT: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, MMA))
    i = gl.arange(0, NT, layout=LT)
    if tile < n_plain_tiles:  # shared expert / dense linear rows
        t = tile * NT + i
        _tile(x_ptr, sx, (t + x_off).to(gl.int64), T - tile * NT, (t + out_off).to(gl.int64),
              gl.full([NT], 1.0, gl.float32, layout=LT), s_data, s_scale, s_rows, 0, row0,
              NT16, KC, NG, N_OUT, N_PAD, out_ptr, so, alpha, limit, s_unscale, MODE, SFMT, W, R, NT, UNROLL,
              LD_S, LS_S, L4_S, LACT, MMA, LA, LB)
    elif ROUTED:
        e, first, nrows = _routed_tile(counts_ptr, tile - n_plain_tiles, E, E_PAD, NT, LE)
        if nrows > 0:
            a = gl.load(bucket_ptr + e.to(gl.int64) * cap + first + i, mask=i < nrows, other=0)
            if MODE == 0:
                wt = gl.load(tw_ptr + a, mask=i < nrows, other=0.0) * scaling
            else:
                wt = gl.full([NT], 1.0, gl.float32, layout=LT)
            _tile(x_ptr, sx, (a // X_DIV).to(gl.int64), nrows, a.to(gl.int64), wt, w_data, w_scale, w_rows, e,
                  row0, NT16, KC, NG, N_OUT, N_PAD, out_ptr, so, alpha, limit, w_unscale, MODE, FMT, W, R, NT,
                  UNROLL, LD_W, LS_W, L4_W, LACT, MMA, LA, LB)


def _fmt_layouts(lay: dict, fmt: int) -> tuple:
    k = "fp4" if fmt == FMT_NVFP4 else "fp8"
    return lay[k], lay[k + "_sc"], lay[k + "_4d"]


def _scale_arg(w: PackedWeight) -> torch.Tensor:
    if w.fmt == FMT_NVFP4:
        return w.scale.view(torch.float8_e4m3fn)
    return w.scale if w.scale is not None else w.rowscale


def grouped_gemm_mma(x16: torch.Tensor, out: torch.Tensor, mode: int, *, routed: PackedWeight | None = None,
                     plain: PackedWeight | None = None, routing=None, T: int, x_div: int = 1, x_off: int = 0,
                     out_off: int = 0, ng: int = 0, scaling: float = 1.0, alpha: float = 1.702, limit: float = 7.0,
                     p: int = 1, nt: int = 8, unroll: int = 2) -> torch.Tensor:
    """Launch (arguments as `grouped_gemm.grouped_gemm`; ``x16`` fp16 activations in the x16 layout, K padded;
    GATE_UP writes ``out`` fp16 in that layout). ``p`` 16-row weight tiles per program, ``nt`` rows per tile (a power
    of two >= 8), ``unroll`` K chunks in flight per warp (the K chunks must divide among the warps in unroll steps)."""
    r = 16 * p
    n_rows = ng if mode == MODE_GATE_UP else (routed if routed is not None else plain).n
    if n_rows % r and mode == MODE_GATE_UP:
        raise ValueError(f"gate rows {n_rows} must be a multiple of the program's {r} rows")
    grid, n_plain, rr, pr = launch_grid(routed, plain, routing, T, nt, n_rows, r)
    if grid[0] == 0:
        return out
    if pr.n_pad != rr.n_pad or pr.k_pad != rr.k_pad or rr.n_pad % r:
        raise ValueError("routed and plain weights must share their padded shape, a multiple of the program rows")
    if (rr.k_pad // CHUNK_K) % (NUM_WARPS * unroll) or nt < 8 or nt & (nt - 1):
        raise ValueError(f"K chunks {rr.k_pad // CHUNK_K} not a multiple of {NUM_WARPS} warps x unroll {unroll}, "
                         f"or nt={nt} not a power of two >= 8")
    lay = layouts(p, nt)
    lw, ls = _fmt_layouts(lay, rr.fmt), _fmt_layouts(lay, pr.fmt)
    _grouped_gemm_mma_kernel[grid](
        x16, x16.stride(0),
        rr.data, _scale_arg(rr), rr.rowscale,
        pr.data, _scale_arg(pr), pr.rowscale,
        routing.counts if routing is not None else out, routing.bucket if routing is not None else out,
        routing.cap if routing is not None else 0, routing.weights if routing is not None else rr.rowscale,
        out, out.stride(0),
        T, ng, rr.n, n_plain, x_off, out_off, float(scaling), float(alpha), float(limit),
        UNSCALE[rr.fmt], UNSCALE[pr.fmt],
        rr.groups, rr.n_pad // TILE_N, rr.k_pad // CHUNK_K, rr.n_pad,
        MODE=mode, FMT=rr.fmt, SFMT=pr.fmt, ROUTED=routed is not None, X_DIV=x_div,
        E_PAD=triton.next_power_of_2(max(rr.groups, 2)), W=NUM_WARPS, R=r, NT=nt, UNROLL=unroll,
        LD_W=lw[0], LS_W=lw[1], L4_W=lw[2], LD_S=ls[0], LS_S=ls[1], L4_S=ls[2],
        LACT=lay["act"], MMA=lay["mma"], LA=lay["a"], LB=lay["b"], LE=lay["e"], num_warps=NUM_WARPS,
    )
    return out
