"""NVFP4 cache decode kernels for NVIDIA sm_89 / sm_90 (Hopper's H100/H200 first), written in Gluon: the packed
E2M1 codes are decoded in registers straight into the operand layout of ``mma.sync`` (m16n8k16, fp16), so no
decoded tile goes through shared memory and no register moves between threads.

Why: the portable kernels (`indexer.py`, `msa_attention.py`) decode NVFP4 with plain ``tl`` ops and let the
compiler stage the fp16 tile into the dot's layout; on the H200 that staging, not the memory traffic, bounded
them (index scan at 23% of copy bandwidth). Here the layouts are explicit (docs/performance.md has the figures):

* Each thread loads 16 contiguous bytes (32 codes, one ``LDG.128``) of a key row: the 4 lanes of a lane quad
  cover the 64 bytes of a 128-element row.
* An inline-PTX decoder turns each 32-bit word (8 codes) into 4 f16x2 registers and multiplies them by the
  16-element block scale (one ``mul.f16x2`` per pair; exact: E2M1 * E4M3 has at most 6 significant bits and the
  pre-scaled values stay within fp16's range, subnormals included). Two decoders: ``MODE_INT`` places the code
  bits into fp16 bit fields with shifts and masks (pairs codes k and k + 4 of a word: the default, measured
  faster), ``MODE_CVT`` builds e4m3 bytes and uses the hardware e4m3x2 -> f16x2 convert.
* The dot's reduction dimension is *permuted*: logical column ``c = 16 s + 8 b + 2 t + a`` is an element of the
  thread's 32 (``logical_to_element``) chosen so that the decoded registers are the mma fragment as they stand
  (``convert_layout(..., assert_trivial=True)`` proves it at compile time); the query is loaded in the same
  permuted order once per program. A dot product does not care about the order.

Kernels: the indexer's decode scan (block max scores; `indexer.indexer_block_scores` dispatches here) and the
decode attention over selected or all blocks (`msa_attention.msa_decode`). Their references are the portable
kernels' (``indexer_decode_ref``, ``msa_decode_ref``); tests/gpu/test_nvfp4_mma_gpu.py checks them on the H200,
tests/kernels/test_nvfp4_mma_compile.py compiles them for sm_90 in CI. CUDA only (Gluon has no interpreter);
elsewhere, and for other shapes, the portable kernels serve: `dispatch` chooses (`use_mma_index_scan`,
`use_mma_decode_attention`) and holds the launch defaults (`dispatch.Tuning`).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .codecs import CVT, INT, MODE_CVT, e4m3_high_nibbles_ptx, e4m3_low_nibbles_ptx

PAGE, HEAD_DIM = 128, 128  # M3's index block (= cache page) and head dims, both models
MAX_INDEX_HEADS = 8  # the index scan's mma n: index heads padded to 8
ATT_GROUP = 16  # query heads per KV head of the decode attention (M3: 64 / 4; per rank under TP alike)
ROWS = gl.constexpr(PAGE)  # key rows (tokens) per indexer tile: one page
D = gl.constexpr(HEAD_DIM)
NUM_WARPS = 4


# Bytes of a page as [128 rows, 8 groups of 16 elements, 8 bytes]: lanes 0-1 = which 16-byte quarter of the row
# (groups 2 t, 2 t + 1), lanes 2-4 = rows 0-7, registers = the 16 bytes, then rows +8 and +64; warps = rows +16,
# +32 (each warp's rows are the m16 tiles mma.sync wants). One LDG.128 per thread and row.
KEY_BYTES = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 1, 0], [8, 0, 0], [64, 0, 0]],
    lane_bases=[[0, 2, 0], [0, 4, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
    warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[128, 8, 8]))
KEY_SCALES = gl.constexpr(gl.SliceLayout(2, KEY_BYTES.value))  # [128 rows, 8 groups]
KEY_BYTES_64 = gl.constexpr(gl.DistributedLinearLayout(  # 64 rows (the attention's K tile: 16 per warp)
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 1, 0], [8, 0, 0]],
    lane_bases=[[0, 2, 0], [0, 4, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
    warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[64, 8, 8]))
KEY_BYTES_2D = gl.constexpr(gl.DistributedLinearLayout(  # the same as [128, 64], for the loads (16-byte vectors)
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0], [64, 0]],
    lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[128, 64]))
IDX_MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8]))
IDX_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=IDX_MMA.value, k_width=2))
IDX_B = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=IDX_MMA.value, k_width=2))
IDX_N = gl.constexpr(MAX_INDEX_HEADS)
# decoders (codecs.MODE_CVT / MODE_INT): through the hardware e4m3 -> f16x2 convert, or integer ops alone


@gluon.jit
def logical_to_element(c, MODE: gl.constexpr):
    """Element index (in a row) of logical dot column c = 16 s + 8 b + 2 t + a. Thread t of a lane quad holds
    elements 32 t + e, e < 32; a is the bit that tells the two halves of a decoded f16x2 register apart: element
    bit 0 for MODE_CVT, bit 2 for MODE_INT (which pairs codes k and k + 4 of a word)."""
    a = c & 1
    t = (c >> 1) & 3
    b = (c >> 3) & 1
    s = c >> 4
    if MODE == CVT:
        e = 4 * s + 2 * b + a
    else:
        e = 16 * (s >> 2) + 8 * ((s >> 1) & 1) + 4 * a + 2 * (s & 1) + b
    return 32 * t + e


# Four packed bytes (8 codes, one 32-bit register) and their block scales -> 8 fp16 values as 4 f16x2 registers:
# outputs $0 $1 (tensor o0) $2 $3 (o1), inputs $4 (the bytes) $5 $6 (the scales of the register pairs $0/$2 and
# $1/$3). MODE_CVT: code c -> e4m3 byte ((c & 7) << 2) | ((c & 8) << 4), valued E2M1(c) * 2^-6; the hardware
# converts e4m3x2 -> f16x2; one f16x2 multiply applies the scale S. Values E2M1 * S * 2^-6. With `interleave`
# (keys: the 4 bytes are one row's) the low / high nibbles are put back in element order, so each register holds
# elements (2i, 2i + 1); without (V: bytes (t, b) (t+1, b) (t, b+1) (t+1, b+1) of two tokens), o0 holds the low
# nibbles and o1 the high ones, each register a token pair.
def _cvt_asm(interleave: bool) -> str:
    lines = ["{", ".reg .b32 a, b, lo, hi;", ".reg .b16 h0, h1, h2, h3;", ".reg .b32 f0, f1, f2, f3;"]
    lines += e4m3_low_nibbles_ptx("$4", "lo", "a", "b") + e4m3_high_nibbles_ptx("$4", "hi", "a", "b")
    if interleave:
        lines += ["prmt.b32 a, lo, hi, 0x5140;", "prmt.b32 b, lo, hi, 0x7362;", "mov.b32 {h0, h1}, a;",
                  "mov.b32 {h2, h3}, b;"]
    else:
        lines += ["mov.b32 {h0, h1}, lo;", "mov.b32 {h2, h3}, hi;"]
    lines += [f"cvt.rn.f16x2.e4m3x2 f{k}, h{k};" for k in range(4)]
    lines += [f"mul.rn.f16x2 ${k}, f{k}, ${5 + k % 2};" for k in range(4)]
    return "\n".join(lines + ["}"])


_CVT_ASM = gl.constexpr(_cvt_asm(interleave=True))
# MODE_INT: codes k and k + 4 of the word sit 16 bits apart, so one shift-and-mask puts both in an f16x2 (sign ->
# bit 15 / 31, magnitude -> bits 9..11 / 25..27, valued E2M1 * 2^-14); registers hold elements (k, k + 4); the
# scale is S * 2^7. Values E2M1 * S * 2^-7.
def _int_asm() -> str:
    lines = ["{", ".reg .b32 a, b;"]
    for k in range(4):  # output k: codes k and k + 4
        mag, sign = 9 - 4 * k, 12 - 4 * k  # code bits 4k..4k+2 -> 9..11, bit 4k+3 -> 15 (and +16 for code k + 4)
        lines.append(f"shl.b32 a, $4, {mag};" if mag >= 0 else f"shr.b32 a, $4, {-mag};")
        lines.append("and.b32 a, a, 0x0E000E00;")
        lines.append(f"shl.b32 b, $4, {sign};" if sign else "mov.b32 b, $4;")
        lines += ["and.b32 b, b, 0x80008000;", "or.b32 a, a, b;", f"mul.rn.f16x2 ${k}, a, $5;"]
    return "\n".join(lines + ["}"])


_INT_ASM = gl.constexpr(_int_asm())
# decoded values are E2M1 * S / UNSCALE[mode] (exact in fp16: <= 6 significant bits, >= 2^-19, <= 42); the block
# scale S is multiplied by 2^7 first for MODE_INT (`prescale`)
UNSCALE = (64.0, 128.0)


@gluon.jit
def decode_rows(x, sc, R: gl.constexpr, MODE: gl.constexpr):
    """Packed NVFP4 bytes [R, D/16, 8] (16 contiguous bytes per thread, as KEY_BYTES) and their fp16 block scales
    [R, D/16] (as KEY_SCALES, from `prescale`) -> fp16 [R, D] in element order."""
    if MODE == CVT:
        o0, o1 = gl.inline_asm_elementwise(_CVT_ASM, "=r,=r,=r,=r,r,r,r", [x, gl.expand_dims(sc, 2)],
                                           dtype=(gl.float16, gl.float16), is_pure=True, pack=4)
        # o_k[r, g, 4 hi + i] = element 16 g + 8 hi + 4 k + i
        t = gl.reshape(gl.join(o0, o1), [R, D // 16, 2, 4, 2])  # (r, g, hi, i, k)
        t = gl.permute(t, [0, 1, 2, 4, 3])
    else:
        o0, o1 = gl.inline_asm_elementwise(_INT_ASM, "=r,=r,=r,=r,r,r,r", [x, gl.expand_dims(sc, 2)],
                                           dtype=(gl.float16, gl.float16), is_pure=True, pack=4)
        # o_k[r, g, 4 hi + 2 u + v] = element 16 g + 8 hi + 4 v + 2 k + u
        t = gl.reshape(gl.join(o0, o1), [R, D // 16, 2, 2, 2, 2])  # (r, g, hi, u, v, k)
        t = gl.permute(t, [0, 1, 2, 4, 5, 3])
    return gl.reshape(t, [R, D])


@gluon.jit
def logical_cols(f, R: gl.constexpr, MODE: gl.constexpr):
    """[R, D] in element order -> logical column order (see logical_to_element). With the rows as the mma wants
    them, that is the mma fragment as the registers stand: callers convert_layout(..., assert_trivial=True), so
    the compiler proves no instruction moves data."""
    if MODE == CVT:  # element 32 t + 4 s + 2 b + a
        f = gl.permute(gl.reshape(f, [R, 4, 8, 2, 2]), [0, 2, 3, 1, 4])
    else:  # element 32 t + 16 s2 + 8 s1 + 4 a + 2 s0 + b
        f = gl.permute(gl.reshape(f, [R, 4, 2, 2, 2, 2, 2]), [0, 2, 3, 5, 6, 1, 4])
    return gl.reshape(f, [R, D])


@gluon.jit
def load_key_page(kd_ptr, ks_ptr, page, boff, soff, ok, MODE: gl.constexpr):
    """Raw bytes (KEY_BYTES) and fp16 block scales (KEY_SCALES, see `prescale`) of one page of a
    contiguous pool (strides are compile-time constants: immediate address offsets)."""
    x = gl.load(kd_ptr + page * (ROWS * D // 2) + boff, mask=ok, other=0)
    x = gl.convert_layout(gl.reshape(x, [ROWS, D // 16, 8]), KEY_BYTES, assert_trivial=True)
    return x, prescale(gl.load(ks_ptr + page * (ROWS * D // 16) + soff, mask=ok, other=0.0), MODE)


@gluon.jit
def prescale(sc, MODE: gl.constexpr):
    """e4m3 block scales -> the fp16 multiplier of the decoder (S, or S * 2^7 for MODE_INT; exact)."""
    sc = sc.to(gl.float16)
    if MODE == INT:
        sc = sc * 128.0
    return sc


@gluon.jit(do_not_specialize=["blocks_per_prog", "nb"])
def _indexer_decode_kernel(
    iq_ptr, siq_s, siq_h,
    kd_ptr, ks_ptr,
    idx_scale,
    bt_ptr, sbt_s, seq_lens_ptr,
    out_ptr, so_t, so_h,
    blocks_per_prog, nb, H,
    LOCAL: gl.constexpr, FILL: gl.constexpr, MODE: gl.constexpr, UNROLL: gl.constexpr,
):
    """Block max scores ``out[s, h, blk]`` of one decoding sequence for the blocks [chunk * bpp, ...): the
    contract of ``indexer._indexer_scores_kernel`` (DECODE) for NVFP4 index keys with 128-token pages and D = 128.
    UNROLL pages are loaded before the first of them is decoded."""
    seq = gl.program_id(0)
    chunk = gl.program_id(1)
    qpos = gl.load(seq_lens_ptr + seq) - 1
    n_blk = qpos // ROWS + 1
    own = qpos // ROWS
    b_begin = chunk * blocks_per_prog
    b_end = gl.minimum(b_begin + blocks_per_prog, n_blk)
    # B operand: logical columns x index query heads (padded to 8)
    kc = gl.arange(0, D, layout=gl.SliceLayout(1, IDX_B))
    hn = gl.arange(0, IDX_N, layout=gl.SliceLayout(0, IDX_B))
    q = gl.load(iq_ptr + seq.to(gl.int64) * siq_s + hn[None, :] * siq_h + logical_to_element(kc, MODE)[:, None],
                mask=(hn < H)[None, :], other=0.0).to(gl.float16)
    brow = gl.arange(0, ROWS, layout=gl.SliceLayout(1, KEY_BYTES_2D))
    bcol = gl.arange(0, D // 2, layout=gl.SliceLayout(0, KEY_BYTES_2D))
    boff = brow[:, None] * (D // 2) + bcol[None, :]
    srow = gl.arange(0, ROWS, layout=gl.SliceLayout(1, KEY_SCALES))
    sgrp = gl.arange(0, D // 16, layout=gl.SliceLayout(0, KEY_SCALES))
    soff = srow[:, None] * (D // 16) + sgrp[None, :]
    krow = gl.arange(0, ROWS, layout=gl.SliceLayout(1, IDX_MMA))
    hh = gl.arange(0, IDX_N, layout=gl.SliceLayout(0, IDX_MMA))
    out_row = out_ptr + seq.to(gl.int64) * so_t + hh * so_h
    bt_row = bt_ptr + seq.to(gl.int64) * sbt_s
    for b0 in range(b_begin, b_end, UNROLL):  # UNROLL pages' loads in flight before the first is decoded
        xs = ()
        for u in gl.static_range(UNROLL):
            ok = b0 + u < b_end
            page = gl.load(bt_row + b0 + u, mask=ok, other=0).to(gl.int64)
            xs = xs + (load_key_page(kd_ptr, ks_ptr, page, boff, soff, ok, MODE),)
        for u in gl.static_range(UNROLL):
            blk = b0 + u
            k = gl.convert_layout(logical_cols(decode_rows(xs[u][0], xs[u][1], ROWS, MODE), ROWS, MODE), IDX_A,
                                  assert_trivial=True)
            s = mma_v2(k, q, gl.zeros([ROWS, IDX_N], gl.float32, layout=IDX_MMA))
            s = gl.where((blk * ROWS + krow <= qpos)[:, None], s, float("-inf"))
            best = gl.max(s, axis=0) * idx_scale
            if LOCAL > 0:
                best = gl.where((blk <= own) & (blk > own - LOCAL), float("inf"), best)
            gl.store(out_row + blk, best, mask=(hh < H) & (blk < b_end))
    if FILL:  # blocks of this chunk past the sequence's last block: not scored
        neg = gl.full([IDX_N], float("-inf"), gl.float32, layout=gl.SliceLayout(0, IDX_MMA))
        for blk in range(gl.maximum(b_begin, n_blk), gl.minimum(b_begin + blocks_per_prog, nb)):
            gl.store(out_row + blk, neg, mask=hh < H)


def indexer_decode_scores(iq, cache, block_tables, seq_lens, out, fill: bool, num_chunks: int, bpp: int,
                          local_blocks: int, mode: int, unroll: int):
    """Launch for ``indexer.indexer_block_scores`` (decode): same arguments, already resolved there (``cache``: the
    layer's index pages); ``mode`` the decoder, ``unroll`` pages in flight per program (`dispatch.Tuning`)."""
    S, H, _ = iq.shape
    _indexer_decode_kernel[(S, num_chunks)](
        iq, iq.stride(0), iq.stride(1),
        cache.index, cache.index_scale_blocks,
        float(cache.index_scale) * UNSCALE[mode],
        block_tables, block_tables.stride(0), seq_lens,
        out, out.stride(0), out.stride(1),
        bpp, block_tables.shape[1], H,
        LOCAL=int(local_blocks), FILL=fill, MODE=mode, UNROLL=unroll, num_warps=NUM_WARPS,
    )
    return out


# =============================================================================================== decode attention
# Program (sequence, KV head, split): the 16 query heads of the KV head against tiles of 64 tokens of the selected
# blocks; the 4 warps take 16 tokens each and keep their own online softmax (a batched mma over the warp dim), so
# nothing crosses warps until the end. K is the B operand of S = Q K^T, decoded like the index keys (tokens as
# the mma's n); V is the B operand of O = P V with the tokens as its reduction dim: each thread holds 4 tokens x
# one 16-element group of dims, decoded as f16x2 pairs of consecutive tokens (the pairs mma.sync wants), with the
# output dims permuted (logical n = g + 8 j <-> dim 16 g + j, g the lane's group id) and restored at the store.
ATT_SPLIT_UNIT = 128  # splits are made of whole blocks
ATT_MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1, 1],
                                                 instr_shape=[1, 16, 8]))
ATT_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=ATT_MMA.value, k_width=2))
ATT_B = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=ATT_MMA.value, k_width=2))
# K bytes [warp, token, 64]: as KEY_BYTES_2D with 16 tokens per warp (token bit 3 in registers)
ATT_K_BYTES = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 8, 0]],
    lane_bases=[[0, 0, 16], [0, 0, 32], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
    warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[NUM_WARPS, 16, 64]))
ATT_K_BYTES4 = gl.constexpr(gl.DistributedLinearLayout(  # the same viewed as [warp, token, group, byte]
    reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4], [0, 0, 1, 0], [0, 8, 0, 0]],
    lane_bases=[[0, 0, 2, 0], [0, 0, 4, 0], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]],
    warp_bases=[[1, 0, 0, 0], [2, 0, 0, 0]], block_bases=[], shape=[NUM_WARPS, 16, 8, 8]))
# V bytes [warp, token, group, byte]: lanes 0-1 = token pairs (2t, 2t + 1), lanes 2-4 = the dim group; registers
# = the 8 bytes of the group, token + 1 and token + 8. The load layout has the bytes fastest (8-byte loads); the
# decoder's has token + 1 fastest, so a 32-bit register holds bytes (t, b) (t + 1, b) (t, b + 1) (t + 1, b + 1).
ATT_V_LOAD = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4], [0, 1, 0, 0], [0, 8, 0, 0]],
    lane_bases=[[0, 2, 0, 0], [0, 4, 0, 0], [0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]],
    warp_bases=[[1, 0, 0, 0], [2, 0, 0, 0]], block_bases=[], shape=[NUM_WARPS, 16, 8, 8]))
ATT_V_BYTES = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4], [0, 8, 0, 0]],
    lane_bases=[[0, 2, 0, 0], [0, 4, 0, 0], [0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]],
    warp_bases=[[1, 0, 0, 0], [2, 0, 0, 0]], block_bases=[], shape=[NUM_WARPS, 16, 8, 8]))

_V_ASM = gl.constexpr(_cvt_asm(interleave=False))  # V: token pairs, low / high nibbles (MODE_CVT only)


@gluon.jit
def v_dim_of(n):
    """Head-dim index of logical output column n = 16 b + 8 k + g (g the group, byte b, nibble k)."""
    return 16 * (n & 7) + 2 * (n >> 4) + ((n >> 3) & 1)


@gluon.jit
def _att_block(bid_ptr, pg_ptr, bt_ptr, row, bt_row, i, ok, SPARSE: gl.constexpr):
    """Block id and page of the i-th block of a (sequence, KV head): selected (SPARSE) or in context order."""
    if SPARSE:
        blk = gl.load(bid_ptr + row + i, mask=ok, other=-1)
        page = gl.load(pg_ptr + row + i, mask=ok, other=0).to(gl.int64)
    else:
        blk = gl.where(ok, i, -1)
        page = gl.load(bt_ptr + bt_row + i, mask=ok, other=0).to(gl.int64)
    return blk, page


@gluon.jit
def _att_loads(k_ptr, v_ptr, ks_ptr, vs_ptr, page, h, sd_p, ss_p, t0: gl.constexpr, lim, ktok, kb, sktok, skg,
               vtok, vg, vb, svtok, svg):
    """Raw K / V bytes, K's e4m3 and V's fp16 block scales of the 64 tokens from t0 of a page (contiguous pool:
    [P, H_kv, 128, 64] codes, [P, H_kv, 128, 8] scales); tokens at or past ``lim`` load as zeros."""
    base = page * sd_p + h * (128 * 64) + t0 * 64
    sbase = page * ss_p + h * (128 * 8) + t0 * 8
    ok_k = (ktok < lim - t0)[:, :, None] & (kb >= 0)[None, None, :]
    kx = gl.load(k_ptr + base + ktok[:, :, None] * 64 + kb[None, None, :], mask=ok_k, other=0)
    ok_ks = (sktok < lim - t0)[:, :, None] & (skg >= 0)[None, None, :]
    ksc = gl.load(ks_ptr + sbase + sktok[:, :, None] * 8 + skg[None, None, :], mask=ok_ks, other=0.0)
    ok_v = ((vtok < lim - t0)[:, :, None] & (vg >= 0)[None, None, :])[:, :, :, None] & (vb >= 0)[None, None, None, :]
    voff = (vtok[:, :, None] * 64 + vg[None, None, :] * 8)[:, :, :, None] + vb[None, None, None, :]
    vx = gl.load(v_ptr + base + voff, mask=ok_v, other=0)
    ok_vs = (svtok < lim - t0)[:, :, None] & (svg >= 0)[None, None, :]
    vsc = gl.load(vs_ptr + sbase + svtok[:, :, None] * 8 + svg[None, None, :], mask=ok_vs, other=0.0)
    return kx, ksc, vx, vsc.to(gl.float16)


@gluon.jit
def _att_step(q, tile, lim, ctok, acc, m_i, l_i, qk_scale, KMODE: gl.constexpr):
    """Online softmax over one tile of 64 tokens (16 per warp): tokens at or past ``lim`` are masked.

    The softmax update is the same math as `msa_attention._online_softmax` (the portable kernels' one helper), written
    again in ``gl`` ops: a Gluon kernel can call only ``@gluon.jit`` functions, and its tensors carry explicit
    layouts (here the mma accumulator's) that a ``@triton.jit`` helper could not keep."""
    kx, ksc, vx, vsc = tile
    # S = Q K^T: K decoded as [warp * token, dims] rows, then transposed to the B operand [warp, dim, token]
    kx = gl.convert_layout(gl.reshape(kx, [64, 8, 8]), KEY_BYTES_64, assert_trivial=True)
    ksc = gl.convert_layout(gl.reshape(prescale(ksc, KMODE), [64, 8]), gl.SliceLayout(2, KEY_BYTES_64),
                            assert_trivial=True)
    kf = logical_cols(decode_rows(kx, ksc, 64, KMODE), 64, KMODE)
    kf = gl.convert_layout(gl.permute(gl.reshape(kf, [4, 16, 128]), [0, 2, 1]), ATT_B, assert_trivial=True)
    sc = mma_v2(q, kf, gl.zeros([4, 16, 16], gl.float32, layout=ATT_MMA)) * qk_scale
    sc = gl.where((ctok < lim)[:, None, :], sc, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(sc, axis=2))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(sc - m_use[:, :, None])
    l_i = l_i * alpha + gl.sum(p, axis=2)
    # O += P V: V decoded with token pairs in each f16x2 register, dims permuted (see v_dim_of)
    vx = gl.convert_layout(vx, ATT_V_BYTES)
    o0, o1 = gl.inline_asm_elementwise(_V_ASM, "=r,=r,=r,=r,r,r,r", [vx, gl.expand_dims(vsc, 3)],
                                       dtype=(gl.float16, gl.float16), is_pure=True, pack=4)
    v = gl.join(o0, o1)  # [warp, token, group g, byte b, nibble k]: dim 16 g + 2 b + k
    v = gl.reshape(gl.permute(v, [0, 1, 3, 4, 2]), [4, 16, 128])  # logical n = 16 b + 8 k + g
    v = gl.convert_layout(v, ATT_B)
    pa = gl.convert_layout(p.to(gl.float16), ATT_A)
    return mma_v2(pa, v, acc * alpha[:, :, None]), m_new, l_i


@gluon.jit(do_not_specialize=["blocks_per_split", "nsplit"])
def _msa_decode_kernel(
    q_ptr, sq_s, sq_h,
    k_ptr, v_ptr, sd_p, ks_ptr, vs_ptr, ss_p,
    bt_ptr, sbt_s, seq_lens_ptr,
    bid_ptr, pg_ptr, sbid_s, sbid_h,
    out_ptr, so_s, so_h,
    op_ptr, lse_ptr,
    qk_scale, v_scale, blocks_per_split, nsplit, n_kv,
    TOPK: gl.constexpr, SPARSE: gl.constexpr, SPLIT: gl.constexpr, KMODE: gl.constexpr,
):
    """``msa_attention._msa_decode_kernel`` for NVFP4 K/V, D = 128, 128-token pages, 16 query heads per KV head:
    the same contract (split partials + log2-sum-exp, merged by its merge kernel)."""
    s = gl.program_id(0)
    h = gl.program_id(1)
    sp = gl.program_id(2)
    seq_len = gl.load(seq_lens_ptr + s)
    if SPARSE:
        n_blocks = TOPK
    else:
        n_blocks = gl.cdiv(seq_len, 128)
    b_begin = sp * blocks_per_split
    b_end = gl.minimum(b_begin + blocks_per_split, n_blocks)
    # Q: A operand [warp, head, logical dim] (every warp the same 16 heads)
    qw = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, ATT_A)))
    qg = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, ATT_A)))
    qc = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, ATT_A)))
    q_off = (h * 16 + qg)[None, :, None] * sq_h + logical_to_element(qc, KMODE)[None, None, :] + qw[:, None, None] * 0
    q = gl.load(q_ptr + s.to(gl.int64) * sq_s + q_off).to(gl.float16)
    # K offsets [warp, token, byte] and scale offsets [warp, token, group]
    kw = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, ATT_K_BYTES)))
    kt = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, ATT_K_BYTES)))
    kb = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, ATT_K_BYTES)))
    ktok = kw[:, None] * 16 + kt[None, :]  # [4, 16] token in tile
    SK: gl.constexpr = gl.SliceLayout(3, ATT_K_BYTES4)
    skw = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, SK)))
    skt = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, SK)))
    skg = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, SK)))
    sktok = skw[:, None] * 16 + skt[None, :]
    # V offsets [warp, token, group, byte] and scale offsets [warp, token, group]
    vw = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, ATT_V_LOAD))))
    vt = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, ATT_V_LOAD))))
    vg = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, ATT_V_LOAD))))
    vb = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, ATT_V_LOAD))))
    vtok = vw[:, None] * 16 + vt[None, :]  # [4, 16]
    SV: gl.constexpr = gl.SliceLayout(3, ATT_V_BYTES)
    svw = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, SV)))
    svt = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, SV)))
    svg = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, SV)))
    svtok = svw[:, None] * 16 + svt[None, :]
    # token index of each S column [warp, 16 tokens], for the mask
    SL: gl.constexpr = gl.SliceLayout(1, ATT_MMA)
    cw = gl.arange(0, 4, layout=gl.SliceLayout(1, SL))
    ct = gl.arange(0, 16, layout=gl.SliceLayout(0, SL))
    ctok = cw[:, None] * 16 + ct[None, :]

    acc = gl.zeros([4, 16, 128], gl.float32, layout=ATT_MMA)
    m_i = gl.full([4, 16], float("-inf"), gl.float32, layout=gl.SliceLayout(2, ATT_MMA))
    l_i = gl.zeros([4, 16], gl.float32, layout=gl.SliceLayout(2, ATT_MMA))
    row = s.to(gl.int64) * sbid_s + h * sbid_h
    # one block (two tiles of 64 tokens) per iteration: both tiles' loads are issued before the first is used, and
    # the next block's id and page are loaded one iteration ahead
    blk, page = _att_block(bid_ptr, pg_ptr, bt_ptr, row, s.to(gl.int64) * sbt_s, b_begin, b_begin < b_end, SPARSE)
    for i in range(b_begin, b_end):
        blk_n, page_n = _att_block(bid_ptr, pg_ptr, bt_ptr, row, s.to(gl.int64) * sbt_s, i + 1, i + 1 < b_end, SPARSE)
        lim = gl.where(blk >= 0, seq_len - blk * 128, 0)  # tokens of this block that exist
        t0 = _att_loads(k_ptr, v_ptr, ks_ptr, vs_ptr, page, h, sd_p, ss_p, 0, lim, ktok, kb, sktok, skg, vtok, vg,
                        vb, svtok, svg)
        t1 = _att_loads(k_ptr, v_ptr, ks_ptr, vs_ptr, page, h, sd_p, ss_p, 64, lim, ktok, kb, sktok, skg, vtok, vg,
                        vb, svtok, svg)
        acc, m_i, l_i = _att_step(q, t0, lim, ctok, acc, m_i, l_i, qk_scale, KMODE)
        acc, m_i, l_i = _att_step(q, t1, lim - 64, ctok, acc, m_i, l_i, qk_scale, KMODE)
        blk, page = blk_n, page_n
    # merge the 4 warps' softmax states
    m_all = gl.max(m_i, axis=0)  # [16]
    m_safe = gl.where(m_all == float("-inf"), 0.0, m_all)
    wsc = gl.exp2(m_i - m_safe[None, :])  # [4, 16]
    l_all = gl.sum(l_i * wsc, axis=0)
    o = gl.sum(acc * wsc[:, :, None], axis=0)  # [16, 128] logical columns
    OL: gl.constexpr = gl.SliceLayout(0, ATT_MMA)
    lg = gl.convert_layout(l_all, gl.SliceLayout(1, OL))
    mg = gl.convert_layout(m_all, gl.SliceLayout(1, OL))
    l_safe = gl.where(lg == 0.0, 1.0, lg)
    o = o * (v_scale / l_safe)[:, None]
    og = gl.arange(0, 16, layout=gl.SliceLayout(1, OL))
    on = gl.arange(0, 128, layout=gl.SliceLayout(0, OL))
    hq = h * 16 + og
    if SPLIT:
        prow = (s.to(gl.int64) * (n_kv * 16) + hq) * nsplit + sp
        gl.store(lse_ptr + prow, gl.where(lg == 0.0, float("-inf"), mg + gl.log2(l_safe)))
        gl.store(op_ptr + prow[:, None] * 128 + v_dim_of(on)[None, :], o)
    else:
        gl.store(out_ptr + s.to(gl.int64) * so_s + hq[:, None] * so_h + v_dim_of(on)[None, :],
                 o.to(out_ptr.dtype.element_ty))


def msa_decode_launch(q, cache, qk_scale: float, block_tables, seq_lens, bid, pg, sparse: bool, topk: int,
                      num_splits: int, blocks_per_split: int, out, op, lse, kmode: int):
    """Launch for ``msa_attention.msa_decode`` (its arguments resolved there; splits of whole blocks). K's decoder:
    ``kmode`` (V always uses the convert). ``qk_scale`` = softmax scale * k_scale * log2(e); the V scale is the
    cache's."""
    S, _, _ = q.shape
    k_data = cache.k
    n_kv = k_data.shape[1]
    _msa_decode_kernel[(S, n_kv, num_splits)](
        q, q.stride(0), q.stride(1),
        k_data, cache.v, k_data.stride(0), cache.k_scale_blocks, cache.v_scale_blocks, cache.k_scale_blocks.stride(0),
        block_tables, block_tables.stride(0), seq_lens,
        bid, pg, bid.stride(0) if sparse else 0, bid.stride(1) if sparse else 0,
        out, out.stride(0), out.stride(1),
        op, lse,
        float(qk_scale) * UNSCALE[kmode], float(cache.v_scale) * UNSCALE[MODE_CVT], blocks_per_split, num_splits, n_kv,
        TOPK=topk, SPARSE=sparse, SPLIT=num_splits > 1, KMODE=kmode, num_warps=NUM_WARPS,
    )
    return out
