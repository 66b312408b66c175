"""Lightning indexer: which 128-token KV blocks each query attends to (MSA sparse layers).

`indexer_topk_ref` is the readable reference (transformers 5.25 `MiniMaxM3VLIndexer.forward`, for one
sequence): score every cached index key with each index head (fp32, no softmax), mask future keys,
max-pool per block, force the query's own (local) blocks, keep the top-k blocks per head, -1 for
slots whose score is -inf. Output `int32 [H_idx, T_q, topk]`: valid block ids left-packed in
descending score order, -1 right-padded, no duplicates.
"""
from __future__ import annotations

import torch


def indexer_topk_ref(
    iq: torch.Tensor,  # [T_q, H_idx, D_idx]  index queries (normed, RoPE applied)
    ik: torch.Tensor,  # [L, D_idx]           every index key of the sequence so far (normed, RoPE)
    q_pos: torch.Tensor,  # [T_q]             absolute positions of the queries
    block_size: int,
    topk: int,
    local_blocks: int = 1,
) -> torch.Tensor:
    t_q, n_heads, _ = iq.shape
    k_len = ik.shape[0]
    n_blocks = -(-k_len // block_size)
    scores = torch.einsum("qhd,kd->hqk", iq.float(), ik.float())
    future = torch.arange(k_len, device=iq.device)[None, :] > q_pos[:, None]  # [T_q, L]
    scores = scores.masked_fill(future[None], float("-inf"))
    pad = n_blocks * block_size - k_len
    if pad:
        scores = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
    block_scores = scores.view(n_heads, t_q, n_blocks, block_size).amax(-1)  # [H, T_q, n_blocks]
    if local_blocks > 0:
        own = q_pos // block_size
        local = (own[:, None] - torch.arange(local_blocks, device=iq.device)[None, :]).clamp(min=0)
        block_scores.scatter_(-1, local[None].expand(n_heads, -1, -1), float("inf"))
    k = min(topk, n_blocks)
    top_scores, top_idx = block_scores.topk(k, dim=-1)
    top_idx = top_idx.masked_fill(top_scores == float("-inf"), -1).to(torch.int32)
    if k < topk:
        top_idx = torch.nn.functional.pad(top_idx, (0, topk - k), value=-1)
    return top_idx


# =============================================================================================== paged cache
# Index keys live in the layer's index pages (one head; `cache.LayerCache`): page = index block. Outputs are
# token-major: ``int32 [T, H_idx, topk]`` (decode: T = S), same -1-padded contract as above; the order of ids
# inside one selection may differ from the reference only between equal scores.
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from . import dispatch  # noqa: E402
from .cache import LayerCache, gather_part_ref  # noqa: E402
from .codecs import (FMT_NVFP4, FMT_PLAIN, NVFP4, NVFP4_UNSCALE, cache_format, dot_dtype, joined_cols,  # noqa: E402
                     nvfp4_joined_tile)


def indexer_decode_ref(iq, cache: LayerCache, block_tables, seq_lens, topk: int, local_blocks: int = 1) -> torch.Tensor:
    """One decoding query per sequence: iq ``[S, H, D]`` at position ``seq_lens - 1``; -> ``int32 [S, H, topk]``."""
    B = cache.index.shape[1]
    out = []
    for s in range(iq.shape[0]):
        n = int(seq_lens[s])
        keys = gather_part_ref(cache, "index", block_tables[s], n)
        pos = torch.tensor([n - 1], device=iq.device)
        out.append(indexer_topk_ref(iq[s:s + 1], keys, pos, B, topk, local_blocks)[:, 0])
    return torch.stack(out) if out else torch.empty(0, iq.shape[1], topk, dtype=torch.int32, device=iq.device)


def indexer_prefill_ref(iq, cache: LayerCache, block_tables, query_start_loc, positions, topk: int,
                        local_blocks: int = 1) -> torch.Tensor:
    """Many queries per sequence (chunked prefill): iq ``[T, H, D]``, sequence s owns tokens
    ``query_start_loc[s]:query_start_loc[s+1]`` at ``positions``; keys = the sequence's pages up to its
    last position (context + this chunk, already inserted). -> ``int32 [T, H, topk]``."""
    B = cache.index.shape[1]
    qsl = [int(x) for x in query_start_loc]
    out = torch.full((iq.shape[0], iq.shape[1], topk), -1, dtype=torch.int32, device=iq.device)
    for s in range(len(qsl) - 1):
        a, b = qsl[s], qsl[s + 1]
        if a == b:
            continue
        pos = positions[a:b]
        keys = gather_part_ref(cache, "index", block_tables[s], int(pos.max()) + 1)
        out[a:b] = indexer_topk_ref(iq[a:b], keys, pos, B, topk, local_blocks).permute(1, 0, 2)
    return out


@triton.jit(do_not_specialize=["blocks_per_prog", "nb"])
def _indexer_scores_kernel(
    iq_ptr, siq_t, siq_h,
    kd_ptr, skd_p, skd_t,
    ks_ptr, sks_p, sks_t,
    idx_scale,
    bt_ptr, sbt_s,
    tiles_ptr, pos_ptr,
    out_ptr, so_t, so_h,
    blocks_per_prog, nb,
    H,
    H_PAD: tl.constexpr, BLOCK_T: tl.constexpr, D: tl.constexpr, B_C: tl.constexpr,
    FMT: tl.constexpr, DOT_DT: tl.constexpr, LOCAL: tl.constexpr, DECODE: tl.constexpr, FILL: tl.constexpr,
    ASM: tl.constexpr,
):
    """Block max scores ``out[t, h, blk]`` for the blocks [chunk * bpp, ...) of one token tile."""
    tile = tl.program_id(0)
    chunk = tl.program_id(1)
    R: tl.constexpr = BLOCK_T * H_PAD
    r = tl.arange(0, R)
    hh = r % H_PAD
    if DECODE:
        seq = tile
        tok = tile + r // H_PAD
        row_ok = hh < H
        qpos = tl.load(pos_ptr + tile + 0 * r) - 1  # pos_ptr = seq_lens
    else:
        seq = tl.load(tiles_ptr + tile * 3)
        t0 = tl.load(tiles_ptr + tile * 3 + 1)
        t1 = tl.load(tiles_ptr + tile * 3 + 2)
        tok = t0 + r // H_PAD
        row_ok = (tok < t1) & (hh < H)
        qpos = tl.load(pos_ptr + tok, mask=row_ok, other=-1)
    max_pos = tl.max(qpos, axis=0)
    n_blk = max_pos // B_C + 1
    b_begin = chunk * blocks_per_prog
    b_end = tl.minimum(b_begin + blocks_per_prog, n_blk)
    own = qpos // B_C
    q_base = iq_ptr + tok.to(tl.int64)[:, None] * siq_t + hh[:, None] * siq_h
    if FMT == NVFP4:  # keys decoded from int32 words into joined tiles: load the query in the same column order
        q = tl.load(q_base + joined_cols(D)[None, :], mask=row_ok[:, None], other=0.0).to(DOT_DT)
        j = tl.arange(0, D // 8)
        wp = kd_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    else:
        d = tl.arange(0, D)
        q = tl.load(q_base + d[None, :], mask=row_ok[:, None], other=0.0).to(DOT_DT)
    n = tl.arange(0, B_C)
    for blk in range(b_begin, b_end):  # one whole page per iteration: a flat loop the pipeliner can prefetch
        page = tl.load(bt_ptr + seq.to(tl.int64) * sbt_s + blk).to(tl.int64)
        kpos = blk * B_C + n
        if FMT == NVFP4:
            w = tl.load(wp + page * (skd_p // 4) + n[:, None] * (skd_t // 4) + j[None, :])
            sc = tl.load(ks_ptr + page * sks_p + n[:, None] * sks_t + tl.arange(0, D // 16)[None, :])
            s = tl.dot(q, tl.trans(nvfp4_joined_tile(w, sc, B_C, D, ASM).to(DOT_DT)))
        else:
            kk = tl.load(kd_ptr + page * skd_p + n[:, None] * skd_t + d[None, :]).to(DOT_DT)
            s = tl.dot(q, tl.trans(kk))
        s = tl.where(kpos[None, :] <= qpos[:, None], s, float("-inf"))
        best = tl.max(s, axis=1) * idx_scale
        if LOCAL > 0:
            best = tl.where((blk <= own) & (blk > own - LOCAL), float("inf"), best)
        tl.store(out_ptr + tok.to(tl.int64) * so_t + hh * so_h + blk, best, mask=row_ok)
    if FILL:  # blocks of this chunk past the tile's last query block: not scored
        neg = tl.full([R], float("-inf"), tl.float32)
        for blk in range(tl.maximum(b_begin, n_blk), tl.minimum(b_begin + blocks_per_prog, nb)):
            tl.store(out_ptr + tok.to(tl.int64) * so_t + hh * so_h + blk, neg, mask=row_ok)


@triton.jit(do_not_specialize=["nb"])
def _topk_kernel(sc_ptr, nb, H, bt_ptr, sbt_s, ids_ptr, pg_ptr, TOPK: tl.constexpr, NB_PAD: tl.constexpr,
                 PAGES: tl.constexpr):
    """One (token, head) row of block scores: the top-k block ids, descending, -1 for -inf (ties: lowest id
    first), and the page of each (block_tables[seq, id]; for decode the token is the sequence)."""
    row = tl.program_id(0)
    i = tl.arange(0, NB_PAD)
    x = tl.load(sc_ptr + row.to(tl.int64) * nb + i, mask=i < nb, other=float("-inf"))
    seq = row // H
    for k in tl.static_range(TOPK):
        m = tl.max(x, axis=0)
        idx = tl.argmax(x, axis=0)
        ok = m > float("-inf")
        tl.store(ids_ptr + row * TOPK + k, tl.where(ok, idx, -1))
        if PAGES:
            page = tl.load(bt_ptr + seq.to(tl.int64) * sbt_s + idx, mask=ok, other=-1)
            tl.store(pg_ptr + row * TOPK + k, tl.where(ok, page, -1))
        x = tl.where(i == idx, float("-inf"), x)


def indexer_block_scores(iq, cache: LayerCache, block_tables, *, seq_lens=None, query_start_loc=None, positions=None,
                         local_blocks: int = 1, tiles=None, out=None) -> torch.Tensor:
    """Stage 1: fp32 ``[T, H, max_pages]`` block max scores (-inf where not scored, +inf local blocks).

    Decode (``seq_lens`` given): one token per sequence at ``seq_lens - 1``. Prefill: ``query_start_loc`` and
    ``positions`` (tiles of `dispatch.index_block_t` consecutive tokens share each loaded key page; ``tiles``: the
    step's tile map, made under the same tuning). NVFP4 decode at M3's shapes on sm_89/sm_90 runs `nvfp4_mma`'s
    kernel (`dispatch.use_mma_index_scan`). ``out``: scores written in place (blocks past a tile's last query
    block left alone; without ``out`` they are -inf).
    """
    T, H, D = iq.shape
    idx_data = cache.index
    B = idx_data.shape[1]
    nb = block_tables.shape[1]
    fmt = cache_format(idx_data)
    fill = out is None  # the kernel also writes -inf to the blocks past each tile's last query block
    if out is None:
        out = torch.empty((T, H, nb), dtype=torch.float32, device=iq.device)
    if T == 0 or nb == 0:
        return out.fill_(float("-inf")) if fill else out
    decode = seq_lens is not None
    h_pad = dispatch.next_pow2(H)
    if decode:  # one token per program: pad the head rows to the 16 that tl.dot needs
        h_pad = max(16, h_pad)
        block_t, n_tiles, tiles, pos = 1, T, seq_lens, seq_lens
    else:
        block_t = dispatch.index_block_t(H)
        if tiles is None:
            tiles = dispatch.prefill_tiles(query_start_loc, block_t, iq.device)
        n_tiles = tiles.shape[0]
        pos = positions
        if n_tiles == 0:
            return out.fill_(float("-inf")) if fill else out
    num_chunks, bpp = dispatch.index_chunks(nb, n_tiles, iq.device)
    t = dispatch.tuning()
    if decode and dispatch.use_mma_index_scan(iq, cache):
        return dispatch.mma_kernels().indexer_decode_scores(iq, cache, block_tables, seq_lens, out, fill, num_chunks,
                                                            bpp, local_blocks, t.index_mma_mode, t.index_mma_unroll)
    kd = idx_data
    ks = cache.index_scale_blocks if fmt == FMT_NVFP4 else idx_data
    i_scale = 1.0 if fmt == FMT_PLAIN else float(cache.index_scale) * (NVFP4_UNSCALE if fmt == FMT_NVFP4 else 1.0)
    _indexer_scores_kernel[(n_tiles, num_chunks)](
        iq, iq.stride(0), iq.stride(1),
        kd, kd.stride(0), kd.stride(1),
        ks, ks.stride(0), ks.stride(1),
        i_scale,
        block_tables, block_tables.stride(0),
        tiles, pos,
        out, out.stride(0), out.stride(1),
        bpp, nb, H,
        H_PAD=h_pad, BLOCK_T=block_t, D=D, B_C=B, FMT=fmt, DOT_DT=dot_dtype(fmt, idx_data.dtype),
        LOCAL=int(local_blocks), DECODE=decode, FILL=fill,
        ASM=fmt == FMT_NVFP4 and dispatch.asm(iq.device),
        num_warps=dispatch.index_num_warps(fmt), num_stages=t.index_num_stages,
    )
    return out


def select_topk_blocks_ref(block_scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Stage 2 in torch: ``[T, H, nb]`` scores -> ``int32 [T, H, topk]``, descending, -inf -> -1, -1 padded."""
    T, H, nb = block_scores.shape
    k = min(topk, nb)
    vals, idx = block_scores.topk(k, dim=-1)
    idx = idx.to(torch.int32).masked_fill(vals == float("-inf"), -1)
    if k < topk:
        idx = torch.nn.functional.pad(idx, (0, topk - k), value=-1)
    return idx


def select_topk_blocks(block_scores: torch.Tensor, topk: int, block_tables: torch.Tensor | None = None):
    """Stage 2 (Triton): the contract of :func:`select_topk_blocks_ref`. With ``block_tables`` (decode: row
    t = sequence t) also returns the page of every selected block (-1 where none): ``(ids, pages)``."""
    T, H, nb = block_scores.shape
    ids = torch.empty(T, H, topk, dtype=torch.int32, device=block_scores.device)
    if T == 0:
        return (ids, ids.clone()) if block_tables is not None else ids
    pages = torch.empty_like(ids) if block_tables is not None else ids
    bt = block_tables if block_tables is not None else ids
    _topk_kernel[(T * H,)](block_scores.contiguous(), nb, H, bt, bt.stride(0) if block_tables is not None else 0,
                           ids, pages, TOPK=topk, NB_PAD=max(16, dispatch.next_pow2(nb)),
                           PAGES=block_tables is not None, num_warps=dispatch.topk_num_warps(nb))
    return (ids, pages) if block_tables is not None else ids


def indexer_decode(iq, cache: LayerCache, block_tables, seq_lens, topk: int, local_blocks: int = 1,
                   return_pages: bool = False):
    """Triton version of :func:`indexer_decode_ref`: block scores split over (sequence, block chunk), then a
    top-k kernel. ``return_pages``: also the selected pages ``[S, H, topk]`` (what msa_decode reads)."""
    scores = indexer_block_scores(iq, cache, block_tables, seq_lens=seq_lens, local_blocks=local_blocks)
    if return_pages:
        return select_topk_blocks(scores, topk, block_tables)
    return select_topk_blocks(scores, topk)


def indexer_prefill(iq, cache: LayerCache, block_tables, query_start_loc, positions, topk: int,
                    local_blocks: int = 1, tiles=None) -> torch.Tensor:
    """Triton version of :func:`indexer_prefill_ref` (``tiles``: see `indexer_block_scores`)."""
    scores = indexer_block_scores(iq, cache, block_tables, query_start_loc=query_start_loc, positions=positions,
                                  local_blocks=local_blocks, tiles=tiles)
    return select_topk_blocks(scores, topk)
