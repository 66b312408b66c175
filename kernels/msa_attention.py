"""MSA block-sparse attention: each query attends only to the keys of its KV head's selected blocks.

`msa_attention_ref` is the readable reference for one sequence: GQA (query head h uses KV head
h // (H_q / H_kv)), causal inside blocks, blocks given by the indexer's `[H_kv, T_q, topk]` contract
(-1 = unused slot). `block_ids=None` is dense causal attention (the `full_attention` layers).
Softmax in fp32.
"""
from __future__ import annotations

import functools

import torch


def msa_attention_ref(
    q: torch.Tensor,  # [T_q, H_q, D]
    k: torch.Tensor,  # [L, H_kv, D]
    v: torch.Tensor,  # [L, H_kv, D]
    q_pos: torch.Tensor,  # [T_q]
    scale: float,
    block_ids: torch.Tensor | None = None,  # [H_kv, T_q, topk] int, -1 padded
    block_size: int = 128,
) -> torch.Tensor:
    t_q, h_q, d = q.shape
    k_len, h_kv, _ = k.shape
    group = h_q // h_kv
    keep = torch.arange(k_len, device=q.device)[None, :] <= q_pos[:, None]  # [T_q, L]
    keep = keep[None].expand(h_kv, -1, -1)  # [H_kv, T_q, L]
    if block_ids is not None:
        n_blocks = -(-k_len // block_size)
        safe = block_ids.long().masked_fill(block_ids < 0, n_blocks)
        chosen = torch.zeros(h_kv, t_q, n_blocks + 1, dtype=torch.bool, device=q.device)
        chosen.scatter_(-1, safe, True)
        chosen = chosen[..., :n_blocks].repeat_interleave(block_size, dim=-1)[..., :k_len]
        keep = keep & chosen
    keep = keep.repeat_interleave(group, dim=0)  # [H_q, T_q, L]
    kf = k.float().repeat_interleave(group, dim=1)  # [L, H_q, D]
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs, vf)
    return out.to(q.dtype)


# =============================================================================================== paged cache
# K/V in the layer's pages (`cache.LayerCache`); ``block_ids`` are token-major ``[T, H_kv, topk]`` (the indexer's
# paged output), logical block numbers of the sequence.
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from . import dispatch  # noqa: E402
from .cache import LayerCache, cache_part, dequant_pages_ref, gather_pages_ref, gather_part_ref  # noqa: E402
from .codecs import (FMT_FP8, FMT_NVFP4, FMT_PLAIN, FP8, FP8_WORDS_UNSCALE, NVFP4, NVFP4_UNSCALE,  # noqa: E402
                     cache_format, cast_to, dot_dtype, e2m1_to_f16, e4m3_bits_to_f32, fp8_words_f16, joined_cols,
                     nvfp4_joined_tile, nvfp4_tile_f16, nvfp4_words_f16)


def _gather_kv_ref(cache: LayerCache, block_table_row, n: int):
    return gather_part_ref(cache, "k", block_table_row, n), gather_part_ref(cache, "v", block_table_row, n)


def msa_decode_ref(q, cache: LayerCache, block_tables, seq_lens, scale: float, block_ids=None) -> torch.Tensor:
    """One query per sequence at position ``seq_lens - 1``: q ``[S, H_q, D]`` -> ``[S, H_q, D]`` (q.dtype)."""
    B = cache.k.shape[2]
    out = torch.empty_like(q)
    for s in range(q.shape[0]):
        n = int(seq_lens[s])
        keys, vals = _gather_kv_ref(cache, block_tables[s], n)
        pos = torch.tensor([n - 1], device=q.device)
        bids = None if block_ids is None else block_ids[s][:, None, :]
        out[s] = msa_attention_ref(q[s:s + 1], keys, vals, pos, scale, bids, B)[0]
    return out


def msa_prefill_ref(q, cache: LayerCache, block_tables, query_start_loc, positions, scale: float,
                    block_ids=None) -> torch.Tensor:
    """Many queries per sequence (chunked prefill), causal by ``positions``; keys/values from the pages
    (context + this chunk, already inserted). q ``[T, H_q, D]`` -> ``[T, H_q, D]``."""
    B = cache.k.shape[2]
    qsl = [int(x) for x in query_start_loc]
    out = torch.empty_like(q)
    for s in range(len(qsl) - 1):
        a, b = qsl[s], qsl[s + 1]
        if a == b:
            continue
        pos = positions[a:b]
        keys, vals = _gather_kv_ref(cache, block_tables[s], int(pos.max()) + 1)
        bids = None if block_ids is None else block_ids[a:b].permute(1, 0, 2)
        out[a:b] = msa_attention_ref(q[a:b], keys, vals, pos, scale, bids, B)
    return out


# ----------------------------------------------------------------------------------------------- Triton
LOG2E = 1.4426950408889634


@triton.jit
def _online_softmax(sc, m_i, l_i):
    """One key tile of the streaming softmax (base 2), shared by every attention kernel here: ``sc [R, N]`` the
    tile's scores in log2 units (scaled by softmax scale x log2(e) x the decoders' unscale; -inf where masked), the
    running row max ``m_i`` and sum ``l_i`` updated. Returns ``(p, alpha, m_i, l_i)``: the tile's unnormalized
    probabilities and the factor by which the caller rescales its accumulators before adding ``p @ V``. A row with
    nothing kept so far stays at m = -inf, l = 0 (no NaN)."""
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(sc - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@triton.jit
def _slot_cols(k: tl.constexpr, NS: tl.constexpr, D: tl.constexpr, PERM: tl.constexpr):
    """Element index of each column of slot k: j * NS + k, or (PERM, the joined nvfp4 word tile) the
    column order that tl.join produces: column 8w + 4x + 2y + z holds element 8w + 4z + 2y + x."""
    if PERM:
        return joined_cols(D)
    else:
        return tl.arange(0, D // NS) * NS + k


@triton.jit
def _q_slot(qrow, k: tl.constexpr, NS: tl.constexpr, D: tl.constexpr, gm, DOT_DT: tl.constexpr,
            PERM: tl.constexpr = False):
    """The query columns that multiply sub-tile k of a decoded K tile."""
    cols = _slot_cols(k, NS, D, PERM)
    return tl.load(qrow + cols[None, :], mask=gm[:, None], other=0.0).to(DOT_DT)


@triton.jit
def _tile_slots(d_ptr, s_ptr, page, h, t_off, mask, sd_p, sd_h, sd_t, ss_p, ss_h, ss_t,
                BN: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr, NS: tl.constexpr, DOT_DT: tl.constexpr,
                ASM: tl.constexpr = False):
    """One [BN, D] K or V tile as NS sub-tiles [BN, D / NS]; sub-tile k holds elements j * NS + k.

    NS = 1: plain / fp8 (native cast); nvfp4: int32 words re-joined into one tile (columns permuted, see
    _slot_cols). fp8 NS = 4: int32 words, values e4m3 * 2^-8. nvfp4 NS = 2: bytes (low / high nibble), NS = 8:
    int32 words; nvfp4 values are E2M1 * S * 2^-7. Unused slots repeat slot 0.
    """
    base = d_ptr + page * sd_p + h * sd_h
    if FMT == NVFP4:
        if NS == 1:  # int32 words, the 8 codes of each word re-joined into one tile (columns permuted)
            wp1 = base.to(tl.pointer_type(tl.int32), bitcast=True)
            w1 = tl.load(wp1 + t_off[:, None] * (sd_t // 4) + tl.arange(0, D // 8)[None, :], mask=mask[:, None],
                         other=0)
            sc1 = tl.load(s_ptr + page * ss_p + h * ss_h + t_off[:, None] * ss_t + tl.arange(0, D // 16)[None, :],
                          mask=mask[:, None], other=0.0)
            t = nvfp4_joined_tile(w1, sc1, BN, D, ASM).to(DOT_DT)
            return t, t, t, t, t, t, t, t
        elif NS == 8:
            W: tl.constexpr = D // 8
            j = tl.arange(0, W)
            wp = base.to(tl.pointer_type(tl.int32), bitcast=True)
            w = tl.load(wp + t_off[:, None] * (sd_t // 4) + j[None, :], mask=mask[:, None], other=0)
            sc = tl.load(s_ptr + page * ss_p + h * ss_h + t_off[:, None] * ss_t + tl.arange(0, D // 16)[None, :],
                         mask=mask[:, None], other=0.0).to(tl.float16) * 128.0
            s_w = tl.reshape(tl.broadcast_to(sc[:, :, None], (BN, D // 16, 2)), (BN, W))
            e0, e1, e2, e3, e4, e5, e6, e7 = nvfp4_words_f16(w)
            return ((e0 * s_w).to(DOT_DT), (e1 * s_w).to(DOT_DT), (e2 * s_w).to(DOT_DT), (e3 * s_w).to(DOT_DT),
                    (e4 * s_w).to(DOT_DT), (e5 * s_w).to(DOT_DT), (e6 * s_w).to(DOT_DT), (e7 * s_w).to(DOT_DT))
        else:
            c = tl.arange(0, D // 2)
            kb = tl.load(base + t_off[:, None] * sd_t + c[None, :], mask=mask[:, None], other=0)
            sc = tl.load(s_ptr + page * ss_p + h * ss_h + t_off[:, None] * ss_t + tl.arange(0, D // 16)[None, :],
                         mask=mask[:, None], other=0.0)
            lo, hi = nvfp4_tile_f16(kb, sc, BN, D // 2)
            lo = lo.to(DOT_DT)
            hi = hi.to(DOT_DT)
            return lo, hi, lo, lo, lo, lo, lo, lo
    elif FMT == FP8 and NS == 4:
        j = tl.arange(0, D // 4)
        wp = base.to(tl.pointer_type(tl.int32), bitcast=True)
        w = tl.load(wp + t_off[:, None] * (sd_t // 4) + j[None, :], mask=mask[:, None], other=0)
        b0, b1, b2, b3 = fp8_words_f16(w)
        return b0, b1, b2, b3, b0, b0, b0, b0
    else:
        d = tl.arange(0, D)
        x = tl.load(base + t_off[:, None] * sd_t + d[None, :], mask=mask[:, None], other=0.0).to(DOT_DT)
        return x, x, x, x, x, x, x, x


@triton.jit
def _q_slots(qrow, NS: tl.constexpr, D: tl.constexpr, gm, DOT_DT: tl.constexpr, PERM: tl.constexpr = False):
    """The query as the NS column sets that multiply the NS sub-tiles of a decoded K tile (a tuple of NS)."""
    qs = ()
    for k in tl.static_range(NS):
        qs = qs + (_q_slot(qrow, k, NS, D, gm, DOT_DT, PERM),)
    return qs


@triton.jit
def _zero_slots(R: tl.constexpr, D: tl.constexpr, NS: tl.constexpr):
    """NS fp32 accumulators [R, D / NS], one per V sub-tile."""
    acc = ()
    for k in tl.static_range(NS):
        acc = acc + (tl.zeros([R, D // NS], tl.float32),)
    return acc


@triton.jit
def _tile_block(j, tpb, s, h, bt_row, bid_ptr, pg_ptr, sbid_s, sbid_h, SPARSE: tl.constexpr):
    """Block selection: the block id and page of key tile j (tpb tiles per block) of sequence s, KV head h. SPARSE:
    its (j // tpb)-th selected block, id and page read from the indexer's ``[S, H_kv, topk]`` output (-1 = unused
    slot); else block j // tpb of the context, its page from the block-table row ``bt_row``."""
    item = j // tpb
    if SPARSE:
        blk = tl.load(bid_ptr + s.to(tl.int64) * sbid_s + h * sbid_h + item)
        page = tl.load(pg_ptr + s.to(tl.int64) * sbid_s + h * sbid_h + item).to(tl.int64)
    else:
        blk = item
        page = tl.load(bt_row + blk).to(tl.int64)
    return blk, page


@triton.jit
def _tile_scores(qs, k_ptr, ks_ptr, page, h, t_off, kv_ok, sd_p, sd_h, sd_t, ss_p, ss_h, ss_t,
                 BN: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr, NS: tl.constexpr, DOT_DT: tl.constexpr,
                 ASM: tl.constexpr = False):
    """First half of one key tile in every attention kernel here (the inner loop of Triton's tutorial 06): K
    decoded from rows ``t_off`` of the page (zeros where not ``kv_ok``; `_tile_slots`, any cache format) and
    S = Q K^T summed over its NS sub-tiles (``qs`` from `_q_slots`): fp32 [rows, BN], not yet scaled. The kernel
    scales and masks it (its own causal / selection mask), then calls `_tile_accumulate`."""
    kt = _tile_slots(k_ptr, ks_ptr, page, h, t_off, kv_ok, sd_p, sd_h, sd_t, ss_p, ss_h, ss_t,
                     BN, D, FMT, NS, DOT_DT, ASM)
    sc = tl.dot(qs[0], tl.trans(kt[0]))
    for k in tl.static_range(1, NS):
        sc = tl.dot(qs[k], tl.trans(kt[k]), sc)
    return sc


@triton.jit
def _tile_accumulate(sc, acc, m_i, l_i, v_ptr, vs_ptr, page, h, t_off, kv_ok, sd_p, sd_h, sd_t, ss_p, ss_h, ss_t,
                     BN: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr, NS: tl.constexpr, DOT_DT: tl.constexpr,
                     ASM: tl.constexpr = False):
    """Second half of one key tile, given its scaled, masked scores ``sc``: the online-softmax update
    (`_online_softmax`), V decoded like K, and the NS sub-tile accumulators ``acc`` rescaled and increased by P V.
    Returns ``(acc, m_i, l_i)``."""
    p, alpha, m_i, l_i = _online_softmax(sc, m_i, l_i)
    vt = _tile_slots(v_ptr, vs_ptr, page, h, t_off, kv_ok, sd_p, sd_h, sd_t, ss_p, ss_h, ss_t,
                     BN, D, FMT, NS, DOT_DT, ASM)
    pd = p.to(vt[0].dtype)
    new = ()
    for k in tl.static_range(NS):
        new = new + (tl.dot(pd, vt[k], acc[k] * alpha[:, None]),)
    return new, m_i, l_i


@triton.jit
def _store_slot(orow, x, k: tl.constexpr, NS: tl.constexpr, D: tl.constexpr, gm, RAW: tl.constexpr,
                PERM: tl.constexpr = False):
    cols = _slot_cols(k, NS, D, PERM)
    if RAW:
        tl.store(orow + cols[None, :], x, mask=gm[:, None])
    else:
        tl.store(orow + cols[None, :], cast_to(x, orow.dtype.element_ty), mask=gm[:, None])


@triton.jit
def _store_slots(orow, acc, scale, NS: tl.constexpr, D: tl.constexpr, gm, RAW: tl.constexpr,
                 PERM: tl.constexpr = False):
    """Store the NS accumulators times ``scale`` ([rows, 1]) into their columns of the output rows ``orow``."""
    for k in tl.static_range(NS):
        _store_slot(orow, acc[k] * scale, k, NS, D, gm, RAW, PERM)


# sbt_s: the block table's width, which eager steps (mixed, the draft's context) size to their longest sequence
@triton.jit(do_not_specialize=["tiles_per_split", "nsplit", "sbt_s"])
def _msa_decode_kernel(
    q_ptr, sq_s, sq_h,
    k_ptr, v_ptr, sd_p, sd_h, sd_t,
    ks_ptr, vs_ptr, ss_p, ss_h, ss_t,
    bt_ptr, sbt_s, seq_lens_ptr,
    bid_ptr, pg_ptr, sbid_s, sbid_h,
    out_ptr, so_s, so_h,
    op_ptr, lse_ptr,
    qk_scale, v_scale, tiles_per_split, nsplit,
    G, B,
    G_PAD: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, TOPK: tl.constexpr, SPARSE: tl.constexpr,
    FMT: tl.constexpr, NS_K: tl.constexpr, NS_V: tl.constexpr, DOT_DT: tl.constexpr, SPLIT: tl.constexpr,
    PERM: tl.constexpr, ASM: tl.constexpr,
):
    """Program (sequence, KV head, split): the G query heads of the KV head against tiles
    [split * tiles_per_split, ...) of its selected blocks (SPARSE; block id and page precomputed per slot)
    or of its whole context, online softmax; writes the output or (SPLIT) a normalized partial + its lse.
    The work is the helpers': `_tile_block` (block selection), `_tile_scores` and `_tile_accumulate` (one
    K/V tile: decode, scores, `_online_softmax`, P V), `_store_slots`."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + s)
    tpb = B // BN
    if SPARSE:
        n_tiles = TOPK * tpb
    else:
        n_tiles = tl.cdiv(seq_len, BN)
    t_begin = sp * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, n_tiles)
    g = tl.arange(0, G_PAD)
    gm = g < G
    qs = _q_slots(q_ptr + s.to(tl.int64) * sq_s + (h * G + g)[:, None] * sq_h, NS_K, D, gm, DOT_DT, PERM)
    acc = _zero_slots(G_PAD, D, NS_V)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    n = tl.arange(0, BN)
    bt_row = bt_ptr + s.to(tl.int64) * sbt_s
    for j in range(t_begin, t_end):
        blk, page = _tile_block(j, tpb, s, h, bt_row, bid_ptr, pg_ptr, sbid_s, sbid_h, SPARSE)
        t_off = (j % tpb) * BN + n
        valid = (blk * B + t_off < seq_len) & (blk >= 0)
        sc = _tile_scores(qs, k_ptr, ks_ptr, page, h, t_off, valid, sd_p, sd_h, sd_t, ss_p, ss_h, ss_t,
                          BN, D, FMT, NS_K, DOT_DT, ASM)
        sc = tl.where(valid[None, :], sc * qk_scale, float("-inf"))
        acc, m_i, l_i = _tile_accumulate(sc, acc, m_i, l_i, v_ptr, vs_ptr, page, h, t_off, valid, sd_p, sd_h, sd_t,
                                         ss_p, ss_h, ss_t, BN, D, FMT, NS_V, DOT_DT, ASM)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    inv = (v_scale / l_safe)[:, None]
    hq = h * G + g
    if SPLIT:
        prow = (s.to(tl.int64) * (tl.num_programs(1) * G) + hq) * nsplit + sp  # [G_PAD]
        tl.store(lse_ptr + prow, tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe)), mask=gm)
        orow = op_ptr + prow[:, None] * D
    else:
        orow = out_ptr + s.to(tl.int64) * so_s + hq[:, None] * so_h
    _store_slots(orow, acc, inv, NS_V, D, gm, SPLIT, PERM)


@triton.jit(do_not_specialize=["nsplit"])
def _merge_splits_kernel(op_ptr, lse_ptr, out_ptr, so_s, so_h, H_q, nsplit, NS_PAD: tl.constexpr,
                         D: tl.constexpr):
    """Log-sum-exp merge of the split-K partials of one (sequence, query head)."""
    s = tl.program_id(0)
    hq = tl.program_id(1)
    row = s.to(tl.int64) * H_q + hq
    i = tl.arange(0, NS_PAD)
    im = i < nsplit
    lse = tl.load(lse_ptr + row * nsplit + i, mask=im, other=float("-inf"))
    mx = tl.max(lse, axis=0)
    w = tl.where(im, tl.exp2(lse - mx), 0.0)
    d = tl.arange(0, D)
    o = tl.load(op_ptr + (row * nsplit + i)[:, None] * D + d[None, :], mask=im[:, None], other=0.0)
    res = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + s.to(tl.int64) * so_s + hq * so_h + d, cast_to(res, out_ptr.dtype.element_ty))


def _slots(fmt: int, D: int, words):
    """(K sub-tiles, V sub-tiles, qk unscale, v unscale, permuted columns) of the decode kernel.

    nvfp4: words=True (default) int32 words re-joined into one tile with permuted columns; "split": 8
    sub-tiles; False: bytes, 2 sub-tiles (even / odd). fp8: words -> V (the transposed operand) from
    int32 words in 4 sub-tiles, K by the native cast."""
    if fmt == FMT_NVFP4:
        if words == "split" and D // 8 >= 16:
            return 8, 8, NVFP4_UNSCALE, NVFP4_UNSCALE, False
        # the joined-word tile is right only for D // 8 >= 16 (the dot's K dim): measured on the H200,
        # D = 32 / 64 gave errors of order 1 (D = 128, M3's head dim, matches the byte path)
        if words and D % 8 == 0 and D // 8 >= 16:
            return 1, 1, NVFP4_UNSCALE, NVFP4_UNSCALE, True
        return 2, 2, NVFP4_UNSCALE, NVFP4_UNSCALE, False
    if fmt == FMT_FP8 and words and D // 4 >= 16:
        return 1, 4, 1.0, FP8_WORDS_UNSCALE, False
    return 1, 1, 1.0, 1.0, False


def _kv_operands(cache: LayerCache):
    """(format, K and V block scales, k_scale, v_scale) as the kernels take them: the data again as unused
    placeholders where a format has no block scales; the per-layer scales apply to quantized caches only."""
    fmt = cache_format(cache.k)
    ks, vs = (cache.k_scale_blocks, cache.v_scale_blocks) if fmt == FMT_NVFP4 else (cache.k, cache.v)
    k_scale, v_scale = (1.0, 1.0) if fmt == FMT_PLAIN else (cache.k_scale, cache.v_scale)
    return fmt, ks, vs, k_scale, v_scale


def msa_decode(q, cache: LayerCache, block_tables, seq_lens, scale: float, block_ids=None, block_pages=None,
               out=None) -> torch.Tensor:
    """Triton version of :func:`msa_decode_ref`: grid (sequence, KV head, split); the G = H_q / H_kv query
    heads of a KV head share each loaded tile; split-K over the selected blocks (or, ``block_ids=None``, over
    the whole context) with a log-sum-exp merge. ``block_pages``: the page of every selected block (the
    indexer's, else looked up here). NVFP4 at M3's shapes on sm_89/sm_90 runs `nvfp4_mma`'s kernel
    (`dispatch.use_mma_decode_attention`); tile sizes, splits and decoders: `dispatch.Tuning`."""
    S, H_q, D = q.shape
    _, H_kv, B, _ = cache.k.shape
    out = torch.empty_like(q) if out is None else out
    if S == 0:
        return out
    fmt, _, _, k_scale, _ = _kv_operands(cache)
    sparse = block_ids is not None
    on_mma = dispatch.use_mma_decode_attention(q, cache)
    block_n = dispatch.decode_block_n(fmt, sparse, on_mma, B)
    tpb = B // block_n
    topk = block_ids.shape[-1] if sparse else 1
    max_tiles = topk * tpb if sparse else block_tables.shape[1] * tpb
    num_splits, tiles_per_split = dispatch.decode_splits(max_tiles, S * H_kv, sparse, on_mma, q.device)
    if num_splits > 1:
        op = torch.empty(S, H_q, num_splits, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(S, H_q, num_splits, dtype=torch.float32, device=q.device)
    else:
        op = lse = out
    if sparse:  # page of every selected block, so the kernel's two loads per tile are independent
        if block_pages is None:
            safe = block_ids.clamp(min=0).to(torch.int64).flatten(1)
            block_pages = torch.where(block_ids >= 0, block_tables.gather(1, safe).view_as(block_ids), -1)
        bid, pg = block_ids.contiguous(), block_pages.to(torch.int32).contiguous()
    else:
        bid = pg = seq_lens
    t = dispatch.tuning()
    if on_mma:
        dispatch.mma_kernels().msa_decode_launch(q, cache, scale * k_scale * LOG2E, block_tables, seq_lens, bid, pg,
                                                 sparse, topk, num_splits, tiles_per_split, out, op, lse,
                                                 t.decode_mma_kmode)
        return _merge(out, op, lse, num_splits)
    _decode_launch(q, cache, block_tables, seq_lens, bid, pg, sparse, topk, block_n, num_splits, tiles_per_split,
                   out, op, lse, scale)
    return _merge(out, op, lse, num_splits)


def _decode_launch(q, cache: LayerCache, block_tables, seq_lens, bid, pg, sparse: bool, topk: int, block_n: int,
                   num_splits: int, tiles_per_split: int, out, op, lse, scale: float, split: bool | None = None):
    """The portable decode kernel's launch: grid (row, KV head, split); ``split`` (default: more than one split)
    writes the partials ``op`` / ``lse`` instead of ``out``."""
    S, H_q, D = q.shape
    k_data = cache.k
    _, H_kv, B, _ = k_data.shape
    G = H_q // H_kv
    fmt, ks, vs, k_scale, v_scale = _kv_operands(cache)
    t = dispatch.tuning()
    ns_k, ns_v, qk_s, v_s, perm = _slots(fmt, D, dispatch.decode_words(fmt, sparse))
    kwargs = {} if t.decode_num_stages is None else {"num_stages": t.decode_num_stages}
    _msa_decode_kernel[(S, H_kv, num_splits)](
        q, q.stride(0), q.stride(1),
        k_data, cache.v, k_data.stride(0), k_data.stride(1), k_data.stride(2),
        ks, vs, ks.stride(0), ks.stride(1), ks.stride(2),
        block_tables, block_tables.stride(0), seq_lens,
        bid, pg, bid.stride(0) if sparse else 0, bid.stride(1) if sparse else 0,
        out, out.stride(0) if out.dim() == 3 else 0, out.stride(1) if out.dim() == 3 else 0,
        op, lse,
        float(scale * k_scale * LOG2E * qk_s), float(v_scale * v_s), tiles_per_split, num_splits,
        G, B,
        G_PAD=max(16, dispatch.next_pow2(G)), D=D, BN=block_n, TOPK=topk, SPARSE=sparse, FMT=fmt, NS_K=ns_k, NS_V=ns_v,
        DOT_DT=dot_dtype(fmt, k_data.dtype), SPLIT=num_splits > 1 if split is None else split, PERM=perm,
        ASM=perm and dispatch.asm(q.device),
        num_warps=t.decode_num_warps, **kwargs,
    )


def context_partials(q, cache: LayerCache, block_tables, ctx_lens, scale: float):
    """Dense attention of one query (H heads) per row over the row's first ``ctx_lens[s]`` cached tokens (keys
    0..ctx_len-1, whatever the query's position), as split-K partials for the caller to merge with keys of its own
    (the DSpark draft's block rows: each a row, its sequence's table repeated): q ``[S, H, D]`` (query head h reads
    KV head h // (H / H_kv)) -> (``op`` fp32 ``[S, H, n_splits, D]``: each split's normalized output,
    ``lse`` fp32 ``[S, H, n_splits]``: its log-sum-exp in log2 units of the scaled scores, -inf where the split saw
    no key). The decode kernel with its split-K outputs; the number of splits depends on the table's width only
    (static in a CUDA graph). `context_partials_ref` is the torch reference."""
    S, H, D = q.shape
    _, H_kv, B, _ = cache.k.shape
    block_n = dispatch.decode_block_n(cache_format(cache.k), False, False, B)
    max_tiles = block_tables.shape[1] * (B // block_n)
    num_splits, tiles_per_split = dispatch.decode_splits(max_tiles, S * H_kv, False, False, q.device)
    op = torch.empty(S, H, num_splits, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(S, H, num_splits, dtype=torch.float32, device=q.device)
    if S == 0:
        return op, lse
    lens = ctx_lens.to(torch.int32).contiguous()
    _decode_launch(q, cache, block_tables, lens, lens, lens, False, 1, block_n, num_splits, tiles_per_split, op, op,
                   lse, scale, split=True)
    return op, lse


def context_partials_ref(q, cache: LayerCache, block_tables, ctx_lens, scale: float):
    """`context_partials` in torch, as one split: every page of the table gathered (the reference path)."""
    S, H, D = q.shape
    B = cache.k.shape[2]
    tables = block_tables.long()

    def rows(part: str) -> torch.Tensor:  # [S, W * B, H_kv, D]
        data, blocks, sc = cache_part(cache, part)
        x = dequant_pages_ref(data[tables], None if blocks is None else blocks[tables], sc)  # [S, W, H_kv, B, D]
        return x.transpose(2, 3).reshape(S, -1, x.shape[2], x.shape[-1])

    keys, vals = rows("k"), rows("v")
    g = H // keys.shape[2]
    sc = torch.einsum("shd,sjhd->shj", q.float(), keys.float().repeat_interleave(g, 2)) * scale
    keep = torch.arange(tables.shape[1] * B, device=q.device)[None, None, :] < ctx_lens[:, None, None]
    sc = sc.masked_fill(~keep, float("-inf"))
    m = sc.amax(-1, keepdim=True)
    p = torch.exp(sc - torch.where(m == float("-inf"), 0.0, m))
    l_ = p.sum(-1, keepdim=True)
    out = torch.einsum("shj,sjhd->shd", p, vals.float().repeat_interleave(g, 2)) / torch.where(l_ == 0, 1.0, l_)
    lse = torch.where(l_[..., 0] == 0, float("-inf"), (m[..., 0] + torch.log(l_[..., 0].clamp_min(1e-30))) * LOG2E)
    return out[:, :, None], lse[:, :, None]


def _merge(out, op, lse, num_splits: int):
    """Merge the split-K partials ``op`` / ``lse`` into ``out`` (nothing to do for one split)."""
    if num_splits > 1:
        S, H_q, D = out.shape
        _merge_splits_kernel[(S, H_q)](op, lse, out, out.stride(0), out.stride(1), H_q, num_splits,
                                       NS_PAD=max(8, dispatch.next_pow2(num_splits)), D=D,
                                       num_warps=dispatch.tuning().merge_num_warps)
    return out


@triton.jit
def _msa_prefill_kernel(
    q_ptr, sq_t, sq_h,
    k_ptr, v_ptr, sd_p, sd_h, sd_t,
    ks_ptr, vs_ptr, ss_p, ss_h, ss_t,
    bt_ptr, sbt_s,
    tiles_ptr, pos_ptr,
    bid_ptr, sbid_t, sbid_h,
    out_ptr, so_t, so_h,
    qk_scale, v_scale,
    G, B,
    G_PAD: tl.constexpr, BLOCK_T: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, TOPK: tl.constexpr,
    SPARSE: tl.constexpr, FMT: tl.constexpr, NS_K: tl.constexpr, NS_V: tl.constexpr, DOT_DT: tl.constexpr,
    PERM: tl.constexpr, ASM: tl.constexpr, SORTED: tl.constexpr = False,
):
    """One tile of BLOCK_T consecutive query tokens of one sequence x the G query heads of one KV head
    (rows = token-major (token, head)); causal by position; sparse: a key block counts for the rows whose
    token selected it (blocks nobody in the tile selected are skipped: found by a scan of the context's blocks, or,
    SORTED, by walking the tile's selections sorted). K / V decoded as NS_K / NS_V sub-tiles
    (PERM: the joined nvfp4 word tile's column order), as in the decode kernel (`_slots`)."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    R: tl.constexpr = BLOCK_T * G_PAD
    seq = tl.load(tiles_ptr + tile * 3)
    t0 = tl.load(tiles_ptr + tile * 3 + 1)
    t1 = tl.load(tiles_ptr + tile * 3 + 2)
    r = tl.arange(0, R)
    g = r % G_PAD
    tok = t0 + r // G_PAD
    row_ok = (tok < t1) & (g < G)
    qpos = tl.load(pos_ptr + tok, mask=row_ok, other=-1)
    n_blk = tl.max(qpos, axis=0) // B + 1
    qrow = q_ptr + tok.to(tl.int64)[:, None] * sq_t + (h * G + g)[:, None] * sq_h
    qs = _q_slots(qrow, NS_K, D, row_ok, DOT_DT, PERM)
    acc = _zero_slots(R, D, NS_V)
    SEL: tl.constexpr = BLOCK_T * TOPK
    if SPARSE:
        tt = t0 + tl.arange(0, BLOCK_T)
        kk = tl.arange(0, TOPK)
        sel_ids = tl.load(bid_ptr + tt.to(tl.int64)[:, None] * sbid_t + h * sbid_h + kk[None, :],
                          mask=(tt < t1)[:, None], other=-1)  # [BLOCK_T, TOPK]
    if SPARSE and SORTED:
        # the tile's selections in ascending order (-1, unused, first): the loop visits each selected block once,
        # BLOCK_T x TOPK steps whatever the context, where the scan takes one step per block of the context
        order = tl.sort(tl.reshape(sel_ids, (SEL,)))
        slot = tl.arange(0, SEL)
        n_visit = SEL
    else:
        n_visit = n_blk
    m_i = tl.full([R], float("-inf"), tl.float32)
    l_i = tl.zeros([R], tl.float32)
    n = tl.arange(0, BN)
    bt_row = bt_ptr + seq.to(tl.int64) * sbt_s
    for j in range(0, n_visit):
        if SPARSE:
            if SORTED:
                blk = tl.max(tl.where(slot == j, order, -2), axis=0)
                prev = tl.max(tl.where(slot == j - 1, order, -2), axis=0)  # -2 before the first
                any_hit = (blk >= 0) & (blk != prev)
            else:
                blk = j
            hit = tl.max((sel_ids == blk).to(tl.int32), axis=1)  # [BLOCK_T]
            if not SORTED:
                any_hit = tl.max(hit, axis=0) > 0
            row_sel = tl.reshape(tl.broadcast_to(hit[:, None], (BLOCK_T, G_PAD)), (R,)) > 0
        else:
            blk = j
            any_hit = blk >= 0
            row_sel = row_ok
        if any_hit:
            page = tl.load(bt_row + blk).to(tl.int64)
            for sub in range(0, B // BN):
                t_off = sub * BN + n
                kpos = blk * B + t_off
                kv_ok = kpos <= tl.max(qpos, axis=0)
                sc = _tile_scores(qs, k_ptr, ks_ptr, page, h, t_off, kv_ok, sd_p, sd_h, sd_t, ss_p, ss_h, ss_t,
                                  BN, D, FMT, NS_K, DOT_DT, ASM)
                keep = (kpos[None, :] <= qpos[:, None]) & row_sel[:, None]
                sc = tl.where(keep, sc * qk_scale, float("-inf"))
                acc, m_i, l_i = _tile_accumulate(sc, acc, m_i, l_i, v_ptr, vs_ptr, page, h, t_off, kv_ok, sd_p, sd_h,
                                                 sd_t, ss_p, ss_h, ss_t, BN, D, FMT, NS_V, DOT_DT, ASM)
    inv = v_scale / tl.where(l_i == 0.0, 1.0, l_i)
    orow = out_ptr + tok.to(tl.int64)[:, None] * so_t + (h * G + g)[:, None] * so_h
    _store_slots(orow, acc, inv[:, None], NS_V, D, row_ok, False, PERM)


@functools.lru_cache(maxsize=None)
def _sdpa_fused(device: torch.device, dtype: torch.dtype, h_q: int, h_kv: int, d: int) -> bool:
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention
    q = torch.zeros(1, h_q, 16, d, dtype=dtype, device=device)
    kv = torch.zeros(1, h_kv, 32, d, dtype=dtype, device=device)
    params = SDPAParams(q, kv, kv, None, 0.0, False, True)
    return bool(can_use_flash_attention(params) or can_use_efficient_attention(params))


def sdpa_fused_ok(q: torch.Tensor, h_kv: int) -> bool:
    """Does torch's SDPA run the lower-right causal GQA attention of `dense_prefill_sdpa` in a fused kernel here
    (flash or memory-efficient; else it would build the [H, n, seq_len] mask and scores: gigabytes at 32K)? The CPU
    (the tests' short chunks) always may."""
    return q.device.type != "cuda" or _sdpa_fused(q.device, q.dtype, q.shape[1], h_kv, q.shape[2])


def dense_prefill_sdpa(q, cache: LayerCache, block_table_row, seq_len: int, scale: float, out) -> None:
    """Dense causal attention of one sequence's chunk, q ``[n, H_q, D]`` at positions ``seq_len - n .. seq_len - 1``,
    by torch's SDPA over its pages dequantized once: nvfp4 / fp8 codes times block scales are exact in bf16, so only
    the per-layer scales are left, and they fold into the softmax scale and the output. Into ``out [n, H_q, D]``."""
    from torch.nn.attention.bias import causal_lower_right
    n = q.shape[0]
    kv = [gather_pages_ref(*cache_part(cache, part)[:2], 1.0, block_table_row, seq_len, q.dtype)  # [seq_len, H, D]
          .transpose(0, 1)[None] for part in ("k", "v")]  # the per-layer scales left out
    k_scale, v_scale = _kv_operands(cache)[3:]
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], kv[0], kv[1], attn_mask=causal_lower_right(n, seq_len), scale=scale * k_scale,
        enable_gqa=True)
    out.copy_((o[0].transpose(0, 1) * v_scale) if v_scale != 1.0 else o[0].transpose(0, 1))


@triton.jit
def _plain_pages_kernel(d_ptr, s_ptr, pages_ptr, out_ptr, sd_p, sd_h, sd_t, ss_p, ss_h, ss_t, H,
                        B: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr):
    """Page ``pages[i]``, KV head h of an NVFP4 (bytes + e4m3 block-scale bits) or FP8 (e4m3 bits) cache part ->
    ``out[i, h]``, fp16 ``[B, D]`` (contiguous ``[n, H, B, D]``), exact, the per-layer scale left out."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    page = tl.load(pages_ptr + i).to(tl.int64)
    t = tl.arange(0, B)[:, None]
    c = tl.arange(0, D)[None, :]
    row = page * sd_p + h * sd_h + t * sd_t
    if FMT == NVFP4:
        byte = tl.load(d_ptr + row + c // 2)
        code = tl.where(c % 2 == 0, byte & 15, byte >> 4)
        x = e2m1_to_f16(code).to(tl.float32) * e4m3_bits_to_f32(
            tl.load(s_ptr + page * ss_p + h * ss_h + t * ss_t + c // 16))
    else:
        x = e4m3_bits_to_f32(tl.load(d_ptr + row + c))
    tl.store(out_ptr + ((i * H + h) * B + t).to(tl.int64) * D + c, x.to(tl.float16))


def _decode_pages(data, blocks, pages):
    """`_plain_pages_kernel` over the pages ``pages`` (int64 [n]) of one cache part: fp16 ``[n, H, B, D]``."""
    fmt = cache_format(data)
    bits = data.view(torch.uint8)
    sb = bits if blocks is None else blocks.view(torch.uint8)
    n, (_, H, B, _) = pages.shape[0], data.shape
    D = data.shape[-1] * (2 if fmt == FMT_NVFP4 else 1)
    out = torch.empty(n, H, B, D, dtype=torch.float16, device=data.device)
    if n:
        _plain_pages_kernel[(n, H)](bits, sb, pages, out, bits.stride(0), bits.stride(1), bits.stride(2),
                                    sb.stride(0), sb.stride(1), sb.stride(2), H, B=B, D=D, FMT=fmt)
    return out


def plain_pages(cache: LayerCache, block_tables, seqs: list[int], seq_lens_cpu):
    """fp16 copies of the pages that sequences ``seqs`` fill (their first ``seq_lens_cpu[s]`` tokens) of a
    quantized cache: NVFP4 / FP8 codes times block scales are exact in fp16, the per-layer scales are left out.
    (K, V ``[n, H_kv, B, D]``, block tables into them: the rows of ``seqs``, 0 elsewhere)."""
    B = cache.k.shape[2]
    rows = [block_tables[s, :-(-int(seq_lens_cpu[s]) // B)] for s in seqs]
    pages = torch.cat(rows).long()
    k, v = (_decode_pages(data, blocks, pages) for data, blocks, _ in (cache_part(cache, "k"), cache_part(cache, "v")))
    tables = torch.zeros_like(block_tables)
    first = 0
    for s, r in zip(seqs, rows):
        tables[s, :len(r)] = torch.arange(first, first + len(r), device=tables.device, dtype=tables.dtype)
        first += len(r)
    return k, v, tables


def msa_prefill(q, cache: LayerCache, block_tables, query_start_loc, positions, scale: float, block_ids=None,
                tiles=None, out=None, seq_lens_cpu=None) -> torch.Tensor:
    """Triton version of :func:`msa_prefill_ref`: grid (token tile, KV head), keys from pages. ``tiles``: the step's
    tile map (`dispatch.prefill_tiles` of `dispatch.attention_block_t` for this mode, made under the same tuning),
    else made here. With ``seq_lens_cpu`` (the sequences' lengths after the step, on the host): in dense mode (no
    ``block_ids``) the sequences `dispatch.sdpa_prefill_sequences` names run `dense_prefill_sdpa`; those
    `dispatch.plain_prefill_sequences` names run the kernel over `plain_pages`; the kernel runs the rest."""
    T, H_q, D = q.shape
    H_kv = cache.k.shape[1]
    out = torch.empty_like(q) if out is None else out
    if T == 0:
        return out
    sparse = block_ids is not None
    block_t = dispatch.attention_block_t(H_q // H_kv, sparse=sparse)
    fmt, ks, vs, k_scale, v_scale = _kv_operands(cache)
    apart = (dispatch.sdpa_prefill_sequences(query_start_loc, sparse)
             if seq_lens_cpu is not None and sdpa_fused_ok(q, H_kv) else [])
    for s in apart:
        a, b = int(query_start_loc[s]), int(query_start_loc[s + 1])
        dense_prefill_sdpa(q[a:b], cache, block_tables[s], int(seq_lens_cpu[s]), scale, out[a:b])
    B = cache.k.shape[2]  # the copy holds whole pages: K and V, fp16
    plain = (dispatch.plain_prefill_sequences(query_start_loc, fmt, [-(-int(n) // B) * B for n in seq_lens_cpu],
                                              4 * H_kv * D, skip=set(apart))
             if seq_lens_cpu is not None else [])
    if plain:
        k, v, tables = plain_pages(cache, block_tables, plain, seq_lens_cpu)
        others = set(range(len(query_start_loc) - 1)) - set(plain)
        _prefill_launch(q, (FMT_PLAIN, k, v, k, v, k_scale, v_scale), tables, positions, scale, block_ids,
                        dispatch.prefill_tiles(query_start_loc, block_t, q.device, skip=others), block_t, out)
    if apart or plain:  # the kernel's tiles for the rest
        tiles = dispatch.prefill_tiles(query_start_loc, block_t, q.device, skip=set(apart) | set(plain))
    if tiles is None:
        tiles = dispatch.prefill_tiles(query_start_loc, block_t, q.device)
    _prefill_launch(q, (fmt, cache.k, cache.v, ks, vs, k_scale, v_scale), block_tables, positions, scale, block_ids,
                    tiles, block_t, out)
    return out


def _prefill_launch(q, operands, block_tables, positions, scale: float, block_ids, tiles, block_t: int,
                    out) -> None:
    """`_msa_prefill_kernel` over ``tiles`` of ``block_t`` tokens; ``operands``: (format, K, V, K and V block
    scales, k_scale, v_scale)."""
    if tiles.shape[0] == 0:
        return
    fmt, k_data, v_data, ks, vs, k_scale, v_scale = operands
    H_q, D = q.shape[1:]
    _, H_kv, B, _ = k_data.shape
    sparse = block_ids is not None
    bid = block_ids if sparse else positions
    ns_k, ns_v, qk_s, v_s, perm = _slots(fmt, D, dispatch.prefill_words(fmt))
    _msa_prefill_kernel[(tiles.shape[0], H_kv)](
        q, q.stride(0), q.stride(1),
        k_data, v_data, k_data.stride(0), k_data.stride(1), k_data.stride(2),
        ks, vs, ks.stride(0), ks.stride(1), ks.stride(2),
        block_tables, block_tables.stride(0),
        tiles, positions,
        bid, bid.stride(0) if sparse else 0, bid.stride(1) if sparse else 0,
        out, out.stride(0), out.stride(1),
        float(scale * k_scale * LOG2E * qk_s), float(v_scale * v_s),
        H_q // H_kv, B,
        G_PAD=dispatch.next_pow2(H_q // H_kv), BLOCK_T=block_t, D=D, BN=dispatch.prefill_block_n(B),
        TOPK=block_ids.shape[-1] if sparse else 1, SPARSE=sparse, FMT=fmt, NS_K=ns_k, NS_V=ns_v,
        DOT_DT=dot_dtype(fmt, k_data.dtype), PERM=perm, ASM=perm and dispatch.asm(q.device),
        SORTED=sparse and dispatch.tuning().prefill_sorted_blocks, num_warps=dispatch.tuning().prefill_num_warps,
    )
