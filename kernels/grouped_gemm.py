"""Grouped GEMM over `PackedWeight`s in plain Triton (`tl`): the MoE expert GEMMs and the quantized linears.

Portable: runs in the interpreter (CI), on ROCm, and serves prefill-sized steps on NVIDIA, where ``tl.dot`` of the
activation tile and the weight tile decoded in registers is a wgmma (decode-sized steps on Hopper go to
`grouped_gemm_mma.py`). One program computes one output tile ``[BM rows, BN columns]``:

* **routed tiles** (MoE): the rows are assignments ``a = token * top_k + slot`` routed to one expert, taken in
  ``BM``-row tiles from ``bucket[e, :counts[e]]`` (`moe_router.py`); a program finds its expert from ``counts``
  alone (a cumulative sum of tiles per expert), so the grid is an upper bound fixed on the host and programs past
  the last tile return at once: no host synchronisation.
* **plain tiles**: rows ``t`` of all ``T`` tokens against group 0 of a second weight (the MoE shared expert, or a
  dense linear when there are no routed tiles). They come first in the grid (the larger per-row work starts first).

Modes (``MODE``):

* ``GATE_UP``: the weight holds gate rows ``[0, NG)`` then up rows ``[NG, 2 NG)``; the epilogue applies
  SwiGLU-OAI ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit)``, times the row's
  routing weight (``topk_weight[a] * scaling``; 1 for the shared expert) and stores ``[rows, NG]``.
* ``DOWN``: ``out[row] = x[row] @ W^T`` per assignment / shared row (combined afterwards, `moe.combine`).
* ``LINEAR``: a plain ``x @ W^T`` (group 0).

Row indices: a routed row ``a`` reads activation row ``a // X_DIV`` (``X_DIV`` = top_k for gate_up: the token;
1 for down: the intermediate row) and writes output row ``a``; a plain row ``t`` reads ``t + x_off`` and writes
``t + out_off``.

Activations: x's own dtype and element order, the weights decoded element by element (`load_weight_tile`); or, with
``wg16``, fp16 in the wg16 order (`moe_router.wg16_position`), the weights decoded a 32-bit word at a time straight
into the wgmma's register fragments (`load_weight_tile_wg16`), gate_up's intermediate written in that order. With
``a8`` (FP8 dots, sm_89+; lossy, in no default row): e4m3 activations with a scale per row (`moe_router.to_x8`, in
either order), each decoded weight tile rounded to e4m3 in the units of `weight_layout.A8_UNIT` by the hardware
convert and packed into the FP8 wgmma's register operand (byte permutes, no shared memory: sm_90 SASS,
tests/kernels/test_grouped_gemm_compile.py), both scales applied in the epilogue.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .codecs import (DENSE, FMT_DENSE, FMT_NVFP4, MXFP8, NVFP4, cast_to, e2m1_to_f16, e4m3_bits_to_f32,
                     fp8_words_f16, nvfp4_asm_ok, nvfp4_words_f16, nvfp4_words_f16_asm, to_e4m3)
from .moe_router import wg16_position
from .platform import compiled_cuda, interpreting
from .weight_layout import A8_UNIT, CHUNK_K, TILE_N, PackedWeight, unpack

MODE_GATE_UP, MODE_DOWN, MODE_LINEAR = 0, 1, 2


@triton.jit
def swiglu_oai_f32(gate, up, alpha, limit):
    g = tl.minimum(gate, limit)
    u = tl.minimum(tl.maximum(up, -limit), limit)
    return (u + 1.0) * (g * tl.sigmoid(g * alpha))


@triton.jit
def routed_tile(counts_ptr, tile, E, E_PAD: tl.constexpr, BM: tl.constexpr):
    """Routed tile index -> (expert, first bucket slot, rows in the tile); rows <= 0 past the last tile.
    Tiles are numbered expert by expert, ceil(counts[e] / BM) each."""
    e = tl.arange(0, E_PAD)
    c = tl.load(counts_ptr + e, mask=e < E, other=0)
    nt = (c + BM - 1) // BM
    cum = tl.cumsum(nt, 0)
    expert = tl.sum((cum <= tile).to(tl.int32), 0)
    mine = e == expert
    first = (tile - tl.sum(tl.where(mine, cum - nt, 0), 0)) * BM
    rows = tl.minimum(tl.sum(tl.where(mine, c, 0), 0) - first, BM)
    return tl.minimum(expert, E - 1), first, rows


@triton.jit
def load_weight_tile(data, scale, g, rows, c, NT16, KC, N_PAD, K_PAD, FMT: tl.constexpr, BN: tl.constexpr,
                     WDT: tl.constexpr):
    """Rows ``rows`` [BN] of group ``g``, K chunk ``c`` (128 elements) -> [BN, 128] in WDT, element order. For a
    16-bit WDT (the GPU path) the codes are decoded exactly with fp16 ops and the hardware e4m3 convert, then
    converted; mxfp8 values then carry a factor 2^-8 (the caller's ``UNS`` restores it)."""
    DEC: tl.constexpr = tl.float32 if WDT == tl.float32 else tl.float16
    if FMT == DENSE:  # dense, row-major [G, N_PAD, K_PAD]
        k = c * 128 + tl.arange(0, 128)
        w = tl.load(data + (g * N_PAD + rows.to(tl.int64))[:, None] * K_PAD + k[None, :])
        return w.to(WDT)
    else:
        rc = ((g * NT16 + rows // 16).to(tl.int64) * KC + c) * 16 + rows % 16  # tile row index [BN]
        if FMT == NVFP4:  # nvfp4: 64 bytes + 8 e4m3 scales per tile row
            b = tl.load(data + rc[:, None] * 64 + tl.arange(0, 64)[None, :])
            sb = tl.load(scale + rc[:, None] * 8 + tl.arange(0, 8)[None, :])
            if DEC == tl.float16:
                s = sb.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            else:
                s = e4m3_bits_to_f32(sb)
            s = tl.reshape(tl.broadcast_to(s[:, :, None], (BN, 8, 8)), (BN, 64))
            lo = e2m1_to_f16(b & 0xF).to(DEC) * s
            hi = e2m1_to_f16(b >> 4).to(DEC) * s
            return tl.reshape(tl.join(lo, hi), (BN, 128)).to(WDT)
        else:  # mxfp8 / fp8: 128 e4m3 bytes per tile row, groups of 8 stored as 0 1 4 5 2 3 6 7
            b = tl.load(data + rc[:, None] * 128 + tl.arange(0, 128)[None, :])
            if DEC == tl.float16:
                v = b.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            else:
                v = e4m3_bits_to_f32(b)
            v = tl.reshape(tl.permute(tl.reshape(v, (BN, 16, 2, 2, 2)), (0, 1, 3, 2, 4)), (BN, 128))
            if FMT == MXFP8:
                s = tl.load(scale + rc[:, None] * 4 + tl.arange(0, 4)[None, :])
                if DEC == tl.float16:
                    s = s * 0.00390625  # 2^-8: e4m3 (<= 448) times the multiplier (<= 2^15) stays in fp16
                v = v * tl.reshape(tl.broadcast_to(s[:, :, None], (BN, 4, 32)), (BN, 128)).to(DEC)
            return v.to(WDT)


@triton.jit
def wg16_element(p):
    """Element index held at position p of the wg16 order (the inverse of `moe_router.wg16_position`)."""
    c = p & 127
    return (p & ~127) + 8 * (4 * ((c >> 1) & 3) + (c >> 5)) + ((c >> 3) & 3) + 4 * (c & 1)


@triton.jit
def _wg16_tile(e0, e1, e2, e3, e4, e5, e6, e7, BN: tl.constexpr):
    """The 8 decoded values of 16 words (fp16 [BN, 16] each: element 8w + j of the chunk in ``ej``) -> [BN, 128] in
    the wg16 order (column 32b + 8j + 2a + h holds element 8(4a + b) + j + 4h). Built so that nothing moves
    between threads: the pairs (j, j + 4) that one 32-bit op decodes stay in one register, and a thread that loaded
    words 4a .. 4a + 3 holds exactly its wgmma fragment columns (a = its lane % 4; the sm_90 SASS has no shared-memory
    round trip of the tile, tests/kernels/test_grouped_gemm_compile.py). tl.join's new axis is the last one."""
    t = tl.join(tl.join(tl.join(e0, e4), tl.join(e2, e6)), tl.join(tl.join(e1, e5), tl.join(e3, e7)))
    t = tl.permute(tl.reshape(t, (BN, 4, 4, 2, 2, 2)), (0, 2, 4, 5, 1, 3))  # (a, b, h, j/2, j%2) -> (b, j, a, h)
    return tl.reshape(t, (BN, 128))


@triton.jit
def load_weight_tile_wg16(data, scale, g, rows, c, NT16, KC, N_PAD, K_PAD, FMT: tl.constexpr, BN: tl.constexpr,
                          WDT: tl.constexpr, ASM: tl.constexpr):
    """As `load_weight_tile`, columns in the wg16 order (`_wg16_tile`), decoded by the words decoders: each 32-bit
    op of `nvfp4_words_f16` (``ASM``: its inline-PTX twin) yields the codes j and j + 4 of a word; `fp8_words_f16`
    the bytes 0 and 2 / 1 and 3 of a word, which the fp8 layout fills with elements 8i + (0 1 4 5) / (2 3 6 7), so
    a pair of fp8 words plays the part of one NVFP4 word. Values: nvfp4 E2M1 * S * 2^-7, mxfp8 / fp8 e4m3 * 2^-8
    (times the block multiplier): the caller's ``UNS`` restores them."""
    if FMT == DENSE:  # the weight's own order: gathered (dense weights take this path in tests only)
        k = c * 128 + wg16_element(tl.arange(0, 128))
        w = tl.load(data + (g * N_PAD + rows.to(tl.int64))[:, None] * K_PAD + k[None, :])
        return w.to(WDT)
    else:
        rc = ((g * NT16 + rows // 16).to(tl.int64) * KC + c) * 16 + rows % 16  # tile row index [BN]
        if FMT == NVFP4:  # 16 words + 8 e4m3 scales per tile row; scale i covers words 2i and 2i + 1
            w = tl.load(data.to(tl.pointer_type(tl.int32)) + rc[:, None] * 16 + tl.arange(0, 16)[None, :])
            sb = tl.load(scale + rc[:, None] * 8 + tl.arange(0, 8)[None, :])
            if ASM:
                s = sb.to(tl.float8e4nv, bitcast=True).to(tl.float16) * 0.5
                e0, e1, e2, e3, e4, e5, e6, e7 = nvfp4_words_f16_asm(w)
            else:
                s = e4m3_bits_to_f32(sb).to(tl.float16) * 128.0
                e0, e1, e2, e3, e4, e5, e6, e7 = nvfp4_words_f16(w)
            s = tl.reshape(tl.broadcast_to(s[:, :, None], (BN, 8, 2)), (BN, 16))
        else:  # mxfp8 / fp8: 32 words per tile row, words 2i and 2i + 1 hold elements 8i .. 8i + 7
            w = tl.load(data.to(tl.pointer_type(tl.int32)) + rc[:, None] * 32 + tl.arange(0, 32)[None, :])
            w_lo, w_hi = tl.split(tl.reshape(w, (BN, 16, 2)))
            e0, e1, e4, e5 = fp8_words_f16(w_lo)
            e2, e3, e6, e7 = fp8_words_f16(w_hi)
            if FMT == MXFP8:  # one multiplier per 32 elements = 4 word pairs
                s = tl.load(scale + rc[:, None] * 4 + tl.arange(0, 4)[None, :]).to(tl.float16)
                s = tl.reshape(tl.broadcast_to(s[:, :, None], (BN, 4, 4)), (BN, 16))
            else:
                s = tl.full((BN, 16), 1.0, tl.float16)
        t = _wg16_tile(e0 * s, e1 * s, e2 * s, e3 * s, e4 * s, e5 * s, e6 * s, e7 * s, BN)
        return t.to(WDT)


@triton.jit
def _weight_tile(data, scale, g, rows, c, NT16, KC, N_PAD, K_PAD, FMT: tl.constexpr, BN: tl.constexpr,
                 WDT: tl.constexpr, WG16: tl.constexpr, ASM: tl.constexpr):
    """The weight tile of K chunk c in the element order (`load_weight_tile`) or the wg16 one."""
    if WG16:
        return load_weight_tile_wg16(data, scale, g, rows, c, NT16, KC, N_PAD, K_PAD, FMT, BN, WDT, ASM)
    else:
        return load_weight_tile(data, scale, g, rows, c, NT16, KC, N_PAD, K_PAD, FMT, BN, WDT)


@triton.jit
def _tile_gemm(x_ptr, sx, xrow, rmask, K, data, scale, g, wrows, wrows2, NT16, KC, N_PAD, K_PAD, FMT: tl.constexpr,
               TWO: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, WDT: tl.constexpr, SWAP: tl.constexpr,
               WG16: tl.constexpr, ASM: tl.constexpr, SPLIT: tl.constexpr, A8: tl.constexpr = False,
               W8S: tl.constexpr = 1.0, EXACT: tl.constexpr = False):
    """acc [BM, BN] over all K chunks (SPLIT > 1: this program's share of them, `_tile_body`), and a second one for
    rows ``wrows2`` when TWO (gate / up share x's tile).
    SWAP computes the transposed product ``W x^T`` [BN, BM] and transposes it once at the end: the decoded weight
    tile is then the dot's first operand, which a Hopper wgmma reads from registers, where the activation tile (the
    second) is loaded into shared memory by cp.async; unswapped, every decoded tile is written to shared memory
    before its wgmma. WG16: x and the weight tiles in the wg16 order (`load_weight_tile_wg16`). A8: x is e4m3 (its
    rows' scales applied by the caller) and each decoded weight tile, times W8S, is rounded to e4m3 (`to_e4m3`;
    EXACT: the interpreter's codec): FP8 dots."""
    if SWAP:
        acc = tl.zeros((BN, BM), tl.float32)
        acc2 = tl.zeros((BN, BM), tl.float32)
    else:
        acc = tl.zeros((BM, BN), tl.float32)
        acc2 = tl.zeros((BM, BN), tl.float32)
    kk = tl.arange(0, 128)
    c_lo, c_hi = 0, KC
    if SPLIT > 1:
        c_lo = tl.program_id(2) * tl.cdiv(KC, SPLIT)
        c_hi = tl.minimum(c_lo + tl.cdiv(KC, SPLIT), KC)
    for c in range(c_lo, c_hi):
        k = c * 128 + kk
        xt = tl.load(x_ptr + xrow[:, None] * sx + k[None, :], mask=rmask[:, None] & (k < K)[None, :], other=0.0)
        if not A8:
            xt = xt.to(WDT)
        w = _weight_tile(data, scale, g, wrows, c, NT16, KC, N_PAD, K_PAD, FMT, BN, WDT, WG16, ASM)
        if A8:
            w = to_e4m3(w * W8S, EXACT)
        acc = tl.dot(w, tl.trans(xt), acc) if SWAP else tl.dot(xt, tl.trans(w), acc)
        if TWO:
            w2 = _weight_tile(data, scale, g, wrows2, c, NT16, KC, N_PAD, K_PAD, FMT, BN, WDT, WG16, ASM)
            if A8:
                w2 = to_e4m3(w2 * W8S, EXACT)
            acc2 = tl.dot(w2, tl.trans(xt), acc2) if SWAP else tl.dot(xt, tl.trans(w2), acc2)
    if SWAP:
        acc = tl.trans(acc)
        acc2 = tl.trans(acc2)
    return acc, acc2


@triton.jit
def _tile_body(x_ptr, sx, xs_ptr, xrow, orow, rmask, wt, K, data, scale, rsc, g, NT16, KC, N_PAD, K_PAD, n0, N_OUT,
               NG, out_ptr, so, ss, alpha, limit, MODE: tl.constexpr, FMT: tl.constexpr, BM: tl.constexpr,
               BN: tl.constexpr, WDT: tl.constexpr, SWAP: tl.constexpr, WG16: tl.constexpr, ASM: tl.constexpr,
               SPLIT: tl.constexpr, A8U: tl.constexpr, FUSE: tl.constexpr = False, A8: tl.constexpr = False,
               EXACT: tl.constexpr = False):
    """One output tile: the GEMM over all K chunks (SPLIT > 1, LINEAR: over this program's share of them, its
    partial product stored at ``out_ptr + split * ss``, ss = the rows times their stride, summed by
    `_split_sum_kernel`), the mode's epilogue, the store (WG16: GATE_UP stores its columns in the wg16 order, the
    down launch's activations). The weight rows read are clamped to the group's padded rows: a tile of BN columns
    may reach past N_PAD (N_PAD is a multiple of 16 only, BN of 64 or 128), and those columns are never stored, but
    an unclamped read would run past the weight (the last group's rows, the shared expert's: an illegal memory
    access on the GPU). FUSE (GATE_UP): one product over BN weight rows, the gate rows of BN / 2 output columns then
    their up rows, split in the epilogue: one accumulator where the gate / up pair of tiles holds two.
    A8: FP8 dots (`_tile_gemm`); the decoded weights are rounded to e4m3 in units of their row scale times A8U
    (`weight_layout.A8_UNIT` of FMT: ``2^3`` for NVFP4, whose E2M1 * S is at most 6 * 448; ``2^15`` for MXFP8, E4M3
    times a multiplier of at most 2^15; 1 for FP8), so that the largest fits e4m3's 448; the products are scaled
    back, and by x's row scales, here."""
    if WG16:
        UNS: tl.constexpr = 128.0 if FMT == NVFP4 else (1.0 if FMT == DENSE else 256.0)  # the decoders' units
    else:
        UNS: tl.constexpr = 256.0 if (FMT == MXFP8) and (WDT != tl.float32) else 1.0
    if A8:
        RSU: tl.constexpr = A8U  # the e4m3 weights' unit
        xsr = tl.load(xs_ptr + xrow, mask=rmask, other=0.0)
    else:
        RSU: tl.constexpr = UNS
    W8S: tl.constexpr = UNS / RSU
    if FUSE:
        HALF: tl.constexpr = BN // 2
        cols = n0 + tl.arange(0, HALF)
        r = tl.arange(0, BN)
        wrows = tl.minimum(tl.where(r < HALF, n0 + r, NG + n0 + r - HALF), N_PAD - 1)
        both, _ = _tile_gemm(x_ptr, sx, xrow, rmask, K, data, scale, g, wrows, wrows, NT16, KC, N_PAD, K_PAD, FMT,
                             False, BM, BN, WDT, SWAP, WG16, ASM, SPLIT, A8, W8S, EXACT)
        if FMT != DENSE:
            both = both * (tl.load(rsc + g * N_PAD + wrows) * RSU)[None, :]
        if A8:
            both = both * xsr[:, None]
        y, up = tl.split(tl.permute(tl.reshape(both, (BM, 2, HALF)), (0, 2, 1)))
    else:
        cols = n0 + tl.arange(0, BN)
        wcols = tl.minimum(cols, N_PAD - 1)
        wcols2 = tl.minimum(cols + NG, N_PAD - 1)
        y, up = _tile_gemm(x_ptr, sx, xrow, rmask, K, data, scale, g, wcols, wcols2, NT16, KC, N_PAD, K_PAD, FMT,
                           MODE == 0, BM, BN, WDT, SWAP, WG16, ASM, SPLIT, A8, W8S, EXACT)
        if FMT != DENSE:
            y = y * (tl.load(rsc + g * N_PAD + wcols) * RSU)[None, :]
            if MODE == 0:
                up = up * (tl.load(rsc + g * N_PAD + wcols2) * RSU)[None, :]
        if A8:
            y = y * xsr[:, None]
            up = up * xsr[:, None]
    if MODE == 0:
        y = swiglu_oai_f32(y, up, alpha, limit) * wt[:, None]
        omask = rmask[:, None] & (cols < NG)[None, :]
        ocols = wg16_position(cols) if WG16 else cols
    else:
        omask = rmask[:, None] & (cols < N_OUT)[None, :]
        ocols = cols
    if SPLIT > 1:
        out_ptr += tl.program_id(2).to(tl.int64) * ss
    tl.store(out_ptr + orow[:, None] * so + ocols[None, :], cast_to(y, out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _split_sum_kernel(part_ptr, ss, out_ptr, so, N, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """out[row] = the sum of the SPLIT partial rows ``part[s * ss + row]`` (fixed order: the same bits every run),
    in out's dtype."""
    row = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + s * ss + row * N + n, mask=n < N, other=0.0)
    tl.store(out_ptr + row * so + n, cast_to(acc, out_ptr.dtype.element_ty), mask=n < N)


@triton.jit(do_not_specialize=["T", "cap", "n_plain_tiles", "x_off", "out_off"])
def _grouped_gemm_kernel(
    x_ptr, sx, xs_ptr,
    w_data, w_scale, w_rows,
    s_data, s_scale, s_rows,
    counts_ptr, bucket_ptr, cap, tw_ptr,
    out_ptr, so,
    T, K, N_OUT, NG, n_plain_tiles, x_off, out_off, scaling, alpha, limit,
    E, NT16, KC, N_PAD, K_PAD, S_NT16, S_N_PAD,
    MODE: tl.constexpr, FMT: tl.constexpr, SFMT: tl.constexpr, ROUTED: tl.constexpr, X_DIV: tl.constexpr,
    E_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, WDT: tl.constexpr, SWAP: tl.constexpr,
    WG16: tl.constexpr, ASM: tl.constexpr, SPLIT: tl.constexpr, A8U: tl.constexpr, SA8U: tl.constexpr,
    FUSE: tl.constexpr = False, A8: tl.constexpr = False, EXACT: tl.constexpr = False,
):
    tile = tl.program_id(0)
    n0 = tl.program_id(1) * (BN // 2 if FUSE else BN)  # FUSE: BN weight rows serve BN / 2 output columns
    i = tl.arange(0, BM)
    if tile < n_plain_tiles:  # shared expert / dense linear: rows t of all T tokens, group 0 of s_*
        t = tile * BM + i
        _tile_body(x_ptr, sx, xs_ptr, (t + x_off).to(tl.int64), (t + out_off).to(tl.int64), t < T,
                   tl.full((BM,), 1.0, tl.float32), K, s_data, s_scale, s_rows, 0, S_NT16, KC, S_N_PAD, K_PAD, n0,
                   N_OUT, NG, out_ptr, so, (T + out_off).to(tl.int64) * so, alpha, limit, MODE, SFMT, BM, BN, WDT,
                   SWAP, WG16, ASM, SPLIT, SA8U, FUSE, A8, EXACT)
    elif ROUTED:
        e, first, nrows = routed_tile(counts_ptr, tile - n_plain_tiles, E, E_PAD, BM)
        if nrows > 0:
            rmask = i < nrows
            a = tl.load(bucket_ptr + e.to(tl.int64) * cap + first + i, mask=rmask, other=0)
            if MODE == 0:
                wt = tl.load(tw_ptr + a, mask=rmask, other=0.0) * scaling
            else:
                wt = tl.full((BM,), 1.0, tl.float32)
            _tile_body(x_ptr, sx, xs_ptr, (a // X_DIV).to(tl.int64), a.to(tl.int64), rmask, wt, K, w_data, w_scale,
                       w_rows, e, NT16, KC, N_PAD, K_PAD, n0, N_OUT, NG, out_ptr, so, 0, alpha, limit, MODE, FMT, BM,
                       BN, WDT, SWAP, WG16, ASM, SPLIT, A8U, FUSE, A8, EXACT)


def work_dtype(x: torch.Tensor):
    """Dot operand dtype: fp32 under the interpreter (its bf16 dot is wrong) or for fp32 inputs, else x's own."""
    if interpreting() or x.dtype == torch.float32:
        return tl.float32
    return tl.float16 if x.dtype == torch.float16 else tl.bfloat16


def routed_tiles_bound(assignments: int, n_experts: int, bm: int) -> int:
    """Upper bound of sum_e ceil(counts[e] / bm) over any routing of ``assignments`` rows to ``n_experts``."""
    return assignments // bm + min(n_experts, assignments)


def launch_grid(routed: PackedWeight | None, plain: PackedWeight | None, routing, T: int, tile_rows: int,
                n_out: int, block_cols: int):
    """(grid, plain tiles, routed weight, plain weight) of a grouped launch: plain tiles first, then the routed
    tiles' bound; a missing weight is stood in for by the other (its pointers are never read)."""
    n_plain = triton.cdiv(T, tile_rows) if plain is not None else 0
    n_routed = routed_tiles_bound(routing.assignments, routed.groups, tile_rows) if routed is not None else 0
    rr = routed if routed is not None else plain
    pr = plain if plain is not None else routed
    return (n_plain + n_routed, triton.cdiv(n_out, block_cols)), n_plain, rr, pr


def _dummy(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return t if t is not None else like


def grouped_gemm(x: torch.Tensor, out: torch.Tensor, mode: int, *, routed: PackedWeight | None = None,
                 plain: PackedWeight | None = None, routing=None, T: int, x_div: int = 1, x_off: int = 0,
                 out_off: int = 0, ng: int = 0, scaling: float = 1.0, alpha: float = 1.702, limit: float = 7.0,
                 bm: int = 16, bn: int = 64, num_warps: int = 4, num_stages: int = 2, swap: bool = False,
                 wg16: bool = False, split: int = 1, fuse: bool = False, a8: bool = False,
                 xs: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the portable kernel (see the module doc). ``routing`` = `moe_router.Routing` (counts, bucket,
    weights) for routed tiles; ``plain`` = the shared-expert / linear weight for ``T`` plain rows; ``ng`` = the
    gate rows (GATE_UP); ``swap``: the transposed product in the K loop (`_tile_gemm`); ``wg16``: x is fp16
    [rows, k_pad] in the wg16 order (`moe_router.to_x16(..., wg16=True)`), the weights are decoded into that order
    and GATE_UP writes ``out`` in it (`load_weight_tile_wg16`); ``split`` (LINEAR): the K chunks shared out over
    that many programs per tile (more programs where the tiles alone do not fill the GPU), their fp32 partial
    products summed by a second launch; ``fuse`` (GATE_UP): each tile's ``bn`` weight rows are the gate and the up
    rows of bn / 2 output columns, one product split in the epilogue (one accumulator where the pair of gate / up
    tiles holds two); ``a8``: FP8 dots, x e4m3 ``[rows, k_pad]`` with its rows' scales ``xs`` (`moe_router.to_x8`;
    in the wg16 order with ``wg16``), the weights rounded to e4m3 as they are decoded (lossy: quantized weights
    only; compiled CUDA or the interpreter). ``out`` rows / columns as the mode says; it is written, never read."""
    if split > 1 and (mode != MODE_LINEAR or routed is not None):
        raise ValueError("split K serves plain LINEAR launches only")
    if fuse and mode != MODE_GATE_UP:
        raise ValueError("fuse serves GATE_UP launches only")
    k_pad = (routed if routed is not None else plain).k_pad
    if a8:
        if x.dtype != torch.float8_e4m3fn or x.shape[1] != k_pad or xs is None or xs.shape != (x.shape[0],):
            raise ValueError(f"a8 activations must be e4m3 [rows, k_pad] with fp32 scales [rows], got {x.dtype} "
                             f"{tuple(x.shape)}")
        if any(p is not None and p.fmt == FMT_DENSE for p in (routed, plain)):
            raise ValueError("a8 serves quantized weights only")
        if not (compiled_cuda(x.device) or interpreting()):
            raise ValueError("a8 runs on compiled CUDA (sm_89+) or in the interpreter")
    elif wg16 and (x.dtype != torch.float16 or x.shape[1] != k_pad):
        raise ValueError(f"wg16 activations must be fp16 [rows, k_pad], got {x.dtype} {tuple(x.shape)}")
    k = x.shape[1]
    n_out = ng if mode == MODE_GATE_UP else (routed if routed is not None else plain).n
    grid, n_plain, rr, pr = launch_grid(routed, plain, routing, T, bm, n_out, bn // 2 if fuse else bn)
    if grid[0] == 0:
        return out
    if pr.k_pad != rr.k_pad:  # one K loop serves both weights
        raise ValueError(f"routed and plain weights must share their padded K ({rr.k_pad} vs {pr.k_pad})")
    split = max(1, min(split, rr.k_pad // CHUNK_K))
    dest = out if split == 1 else torch.empty(split, T + out_off, n_out, dtype=torch.float32, device=out.device)
    _grouped_gemm_kernel[grid + (split,)](
        x, x.stride(0), xs if a8 else x,
        rr.data, _dummy(rr.scale, rr.data), _dummy(rr.rowscale, x),
        pr.data, _dummy(pr.scale, pr.data), _dummy(pr.rowscale, x),
        routing.counts if routing is not None else out, routing.bucket if routing is not None else out,
        routing.cap if routing is not None else 0, routing.weights if routing is not None else x,
        dest, dest.stride(-2),
        T, k, n_out, ng, n_plain, x_off, out_off, float(scaling), float(alpha), float(limit),
        rr.groups, rr.n_pad // TILE_N, rr.k_pad // CHUNK_K, rr.n_pad, rr.k_pad, pr.n_pad // TILE_N, pr.n_pad,
        MODE=mode, FMT=rr.fmt, SFMT=pr.fmt, ROUTED=routed is not None, X_DIV=x_div,
        E_PAD=triton.next_power_of_2(max(rr.groups, 2)), BM=bm, BN=bn,
        WDT=tl.float16 if a8 and not interpreting() else work_dtype(x), SWAP=swap,
        WG16=wg16, ASM=wg16 and FMT_NVFP4 in (rr.fmt, pr.fmt) and nvfp4_asm_ok(x.device), SPLIT=split,
        A8U=A8_UNIT.get(rr.fmt, 1.0), SA8U=A8_UNIT.get(pr.fmt, 1.0), FUSE=fuse, A8=a8, EXACT=a8 and interpreting(),
        num_warps=num_warps, num_stages=num_stages,
    )
    if split > 1:
        block = min(1024, triton.next_power_of_2(n_out))
        _split_sum_kernel[(T, triton.cdiv(n_out, block))](dest[:, out_off:], dest.stride(0), out[out_off:],
                                                           out.stride(0), n_out, SPLIT=split, BLOCK=block,
                                                           num_warps=4)
    return out


def grouped_gemm_ref(x: torch.Tensor, w: PackedWeight, rows: torch.Tensor, groups: torch.Tensor,
                     mode: int, ng: int = 0, row_weight: torch.Tensor | None = None, alpha: float = 1.702,
                     limit: float = 7.0, e4m3: bool = False) -> torch.Tensor:
    """Torch reference, fp32: output row i = f(x[rows[i]] @ W[groups[i]]^T) for the given mode (GATE_UP: SwiGLU of
    the gate / up halves times ``row_weight[i]``; else the product itself, logical columns only); ``e4m3``: the
    weights as the ``a8`` tiles round them (`unpack`; x is then the e4m3 activations times their scales)."""
    wd = unpack(w, e4m3=e4m3)[:, :, : x.shape[1]]
    y = torch.einsum("rk,rnk->rn", x[rows].float(), wd[groups])
    if mode != MODE_GATE_UP:
        return y[:, : w.n]
    g, u = y[:, :ng], y[:, ng: 2 * ng]
    out = (u.clamp(-limit, limit) + 1.0) * (g.clamp(max=limit) * torch.sigmoid(g.clamp(max=limit) * alpha))
    return out * (row_weight[:, None] if row_weight is not None else 1.0)


__all__ = ["MODE_GATE_UP", "MODE_DOWN", "MODE_LINEAR", "grouped_gemm", "grouped_gemm_ref", "routed_tiles_bound",
           "launch_grid", "work_dtype"]
