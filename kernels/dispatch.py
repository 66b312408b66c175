"""Which kernel runs each op, and with which launch parameters: the one table.

* **Portable or mma.** NVFP4 decode at M3's shapes (128-token pages, head dim 128; 16 query heads per KV head for
  attention, <= 8 index heads for the scan) on sm_89 / sm_90 runs the Gluon ``mma.sync`` kernels of `nvfp4_mma`
  (`use_mma_index_scan`, `use_mma_decode_attention`); every other op, format, shape and device runs the portable
  ``tl`` kernels (`indexer`, `msa_attention`), which serve NVIDIA, AMD and the interpreter alike. The MoE expert
  GEMMs and the quantized linears choose between `grouped_gemm_mma` (sm_89 / sm_90, decode-sized steps), the
  portable `grouped_gemm` and, at prefill-sized steps, `dequant_gemm` (weights decoded once, then cuBLAS) by token
  count: `moe_config` and `linear_config` read the tables `MOE_TABLE` and `LINEAR_TABLE`.
* **Tuning.** `Tuning` holds every launch choice that was measured or can be varied: tile sizes, warps, stages,
  split-K targets, the decoders, the MoE / linear tables. Its defaults are the ones measured on the H200
  (docs/performance.md: the decoder, tune and NVFP4 variant tables, the MoE section); ``None`` means the rule
  written beside the field. The kernels' public functions take no such switches: a benchmark or a test selects a
  variant for a block of calls::

      with tuned(decode_words=False, decode_block_n=128):
          msa_decode(q, cache, block_tables, seq_lens, scale, block_ids)
      with tuned(moe_table=((None, "tl", dict(bm=32, bn=64, num_warps=4, num_stages=3), dict(...)),)):
          fused_moe(x, router_weight, correction_bias, weights, ...)

  (`tuned` sets a context variable, so it holds for the calls of this thread / task only.)
* **Launch geometry** shared by the wrappers and the step planner: `next_pow2`, `prefill_tiles` and the query
  tokens per prefill tile (`attention_block_t`, `index_block_t`). A step's tile maps must be made under the same
  tuning as the kernels that read them.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass, replace

import torch

from . import codecs, platform
from .codecs import FMT_DENSE, FMT_NVFP4, FMT_PLAIN, MODE_INT, cache_format
from .dequant_gemm import dense_path_ok
from .weight_layout import CHUNK_K, PackedWeight

# The MoE expert GEMMs (`moe_config`), measured on the H200 and the H100 (docs/performance.md,
# benchmarks/NOTES-moe.md; the tl rows from bench_prefill on the H100, 2026-12-07): rows
# (most tokens or None, path, gate_up config, down config), the first row that fits the step wins (an "mma" row
# fits where the mma kernels run and the shapes divide; a "tl" row anywhere but compiled NVIDIA CUDA (the
# interpreter, ROCm, whose devices also report type "cuda") takes `PORTABLE_GEMM`).
# mma: p = 16-row tiles per program, nt = rows (assignments) per tile, unroll = K chunks in flight per warp;
# tl: bm x bn output tiles of the portable kernels (swap: the transposed product, the decoded weights as the dot's
# register operand; wg16: fp16 activations in the order of the wgmma register fragments, the weights decoded into
# it by the words decoders, dropped for dense weights; split (linears): K shared out over that many programs per
# tile; a8: FP8 dots, the activations e4m3 with a scale per row and the decoded weights rounded to e4m3 (lossy,
# `grouped_gemm`; in no default row: not yet timed); a row whose tiles need more shared memory than the device has
# is skipped, `_tl_fits`: bf16 experts take the 64 x 64 row beyond 1,024 tokens on Hopper);
# dense: the weights decoded once to bf16, then cuBLAS (`dequant_gemm`; scratch_mb bounds the decoded experts held
# at once), from MOE_DENSE_FROM tokens where `Tuning.dense_prefill` turns it on: off on CUDA by default, where it
# was slower than the kernels at every count measured (20.5 / 26.7 ms at 4096 / 8192 tokens vs the wg16 tiles'
# 8.2 / 15.5; H100, 2026-12-07).
MOE_MMA_MAX_TOKENS = 128  # the last mma row
MOE_DENSE_FROM = 4096
_MOE_TL_16 = dict(bm=16, bn=64, num_warps=4, num_stages=3, swap=True, wg16=True)  # 256 tokens: 2.02 ms vs mma 2.31
#   (64 tokens: 1.48 vs mma 1.35; H100, 2026-12-07; 65-255 not measured: the mma row to 128)
_MOE_TL_FEW = dict(bm=32, bn=64, num_warps=4, num_stages=3, swap=True, wg16=True)  # 512 / 1024 tokens: 2.33 / 3.56 ms
#   vs mma 3.24 at 512
_MOE_TL = dict(bm=128, bn=128, num_warps=8, num_stages=3, swap=True, wg16=True)  # 2048 / 4096 / 8192: 4.98 / 8.48 /
#   15.18 ms (12.71 / 22.53 at 4096 / 8192 without wg16)
_TL_SMALL_SMEM = dict(bm=64, bn=64, num_warps=4, num_stages=3)  # where the tiles above do not fit (sm_89: 99 KB)
MOE_TABLE = (
    (MOE_MMA_MAX_TOKENS, "mma", dict(p=1, nt=8, unroll=2), dict(p=1, nt=8, unroll=2)),
    (256, "tl", _MOE_TL_16, _MOE_TL_16),
    (1024, "tl", _MOE_TL_FEW, _MOE_TL_FEW),
    (MOE_DENSE_FROM - 1, "tl", _MOE_TL, _MOE_TL),
    (None, "dense", dict(scratch_mb=2048), dict(scratch_mb=2048)),
    (None, "tl", _MOE_TL, _MOE_TL),
    (None, "tl", _TL_SMALL_SMEM, _TL_SMALL_SMEM),
)
# The quantized linears (`linear_config`): rows (most rows M or None, path, config), read as `MOE_TABLE`. Measured
# on the H100 (bench_prefill, 2026-12-07, x [M, 8192] -> [M, 6144], NVFP4 / MXFP8 / FP8 alike): the mma rows to
# 8 rows (level with the wg16 tiles there: 0.027-0.035 ms); the swapped wg16 tiles with K split 4 ways to 128 rows
# (64 rows: 0.033-0.038 ms, 1.3-1.5x bf16; 0.057-0.070 ms without wg16 and split), whole-K 128 x 128 wg16 tiles at
# 256 rows (0.076-0.083 ms vs the dense path's 0.104-0.111); the decode-once-then-cuBLAS path from
# LINEAR_DENSE_FROM rows (512: 0.125-0.131 ms vs the tiles' 0.145-0.159; on by default, `Tuning.dense_prefill`).
# A "dense" row is skipped where that path cannot run (`dequant_gemm.dense_path_ok`: ROCm), so each "dense" row is
# followed by the row to use then. A "dense8" row (`dequant_gemm.fp8_linear`: the weights decoded straight to e4m3 as
# the a8 tiles round them, x to e4m3 per row, cuBLAS's FP8 GEMM; lossy, the a8 tiles' arithmetic) is in no default
# row: not yet timed; bench_prefill times it from 256 rows (`fp8_gemm_ok` says where it runs).
LINEAR_MMA_MAX_ROWS = 8
LINEAR_DENSE_FROM = 512


def _lin_wg16(bm: int, bn: int, split: int) -> dict:
    """Swapped wg16 tiles of a linear: bm rows x bn weight rows (a warp group per 64), K shared ``split`` ways."""
    return dict(bm=bm, bn=bn, num_warps=bn // 16, num_stages=3, swap=True, wg16=True, split=split)


LINEAR_TABLE = (
    (LINEAR_MMA_MAX_ROWS, "mma", dict(p=1, nt=8, unroll=2)),
    (16, "tl", _lin_wg16(16, 64, 4)),
    (32, "tl", _lin_wg16(32, 64, 4)),
    (64, "tl", _lin_wg16(64, 64, 4)),
    (128, "tl", _lin_wg16(128, 128, 4)),
    (LINEAR_DENSE_FROM - 1, "tl", _lin_wg16(128, 128, 1)),
    (None, "dense", dict()),
    (None, "tl", _lin_wg16(128, 128, 1)),
    (None, "tl", _TL_SMALL_SMEM),
)
PORTABLE_GEMM = dict(bm=16, bn=64, num_warps=4, num_stages=2)  # interpreter / ROCm / formats without an mma decoder


@dataclass(frozen=True)
class Tuning:
    """Launch choices of the kernels (``None``: the rule in the comment)."""

    # which kernels
    mma: bool = True  # the Gluon mma.sync kernels where they apply (False: the portable kernels everywhere)
    dense_prefill: bool | None = None  # the tables' "dense" rows (decode once, then cuBLAS); None: the linears' on,
    #   the MoE's off on CUDA (slower there, as measured by benchmarks/bench_prefill.py) and on elsewhere (the paths
    #   CI checks)
    asm: bool | None = None  # the inline-PTX NVFP4 word decoder in the portable kernels (None: where it self-checks)
    a8: bool = False  # the tables' tl rows with FP8 dots for quantized weights (`grouped_gemm`'s a8 tiles: e4m3
    #   activations with a scale per row, the decoded weights rounded to e4m3; lossy); off: not yet timed, nor judged
    #   by the learned model's accuracy table (`m3serve eval-tasks --paths nvfp4-a8`)
    fused_norm: bool = False  # the model's RMSNorm on a GPU in one launch (`rms_norm.rms_norm`) instead of about eight
    #   torch kernels; not yet timed
    # MSA decode attention (msa_decode)
    decode_words: bool | str | None = None  # portable decoder: True int32 words (nvfp4: one joined tile), "split"
    #   (nvfp4: 8 sub-tiles), False bytes / native cast; None: nvfp4 sparse -> bytes, else words
    decode_block_n: int | None = None  # tokens per key tile; None: 128 nvfp4 dense-mode, else 64 (interpreter 32);
    #   the mma kernel always takes whole 128-token blocks
    decode_splits: int | None = None  # split-K partitions; None: from decode_split_target
    decode_split_target: int | None = None  # programs per SM; None: portable 2, mma 1 sparse / 8 dense-mode
    decode_num_warps: int = 4
    decode_num_stages: int | None = None  # None: Triton's default
    decode_mma_kmode: int = MODE_INT  # K decoder of the mma attention (V always uses the convert)
    # MSA prefill attention (msa_prefill)
    prefill_block_t: int | None = None  # query tokens per tile; None: 64 rows (interpreter 32) / next_pow2(G)
    prefill_sparse_block_t: int | None = None  # the same on block-sparse layers (None: prefill_block_t's); a sparse
    #   tile visits the union of its tokens' blocks (docs/performance.md: 2.17 per block needed at 4 tokens)
    prefill_block_n: int | None = None  # tokens per key tile; None: 64 (interpreter 32)
    prefill_num_warps: int = 4
    prefill_words: bool | str | None = None  # the prefill attention's decoder, as `decode_words`; None:
    #   `prefill_words`
    prefill_sorted_blocks: bool = False  # block-sparse tiles walk their selections sorted (BLOCK_T x TOPK steps) where
    #   they scan every block of the context (32K: 256 steps; 128K: 1024); not yet timed
    prefill_sdpa_from: int | None = None  # full-attention layers: a sequence with at least this many query tokens in
    #   the step (at least 128) dequantizes its pages once and runs torch's SDPA instead of the kernel, which decodes
    #   every key tile again for each 4 query tokens (`msa_attention.dense_prefill_sdpa`); None: off (not yet timed)
    prefill_plain_from: int | None = 1024  # NVFP4 / FP8 caches: a sequence with at least this many query tokens in
    #   the step (at least 128) runs the kernel on an fp16 copy of its pages, decoded once (exact: the dots are fp16
    #   either way), where the kernel decodes each key tile again for every query tile; up to PLAIN_PAGES_MAX_BYTES
    #   a call; None: off. TTFT 8K / 32K -8% / -11%, the same outputs (H100, docs/performance.md, 2026-12-07)
    # indexer block scores (indexer_block_scores, indexer_decode, indexer_prefill)
    index_chunks: int | None = None  # block chunks per query tile; None: 4 programs per SM
    index_block_t: int | None = None  # prefill query tokens per tile; None: 64 rows (interpreter 16) / next_pow2(H)
    index_num_warps: int | None = None  # None: 8 for plain keys, 4 for fp8 / nvfp4
    index_num_stages: int = 3
    index_mma_mode: int = MODE_INT  # decoder of the mma scan
    index_mma_unroll: int = 3  # pages in flight per program of the mma scan
    # inserts (kv_insert, qkv_insert; not tuned)
    insert_rows: int | None = None  # kv_insert (token, head) rows per program; None: 16 (interpreter 64)
    qkv_insert_tokens: int = 16  # tokens per qkv_insert program
    insert_num_warps: int = 4
    # the small kernels (not tuned)
    merge_num_warps: int = 2  # split-K merge
    # MoE experts (fused_moe) and quantized linears (quant_linear)
    moe_table: tuple = MOE_TABLE  # path and configs by token count (`moe_config`)
    moe_overlap: bool = False  # the shared expert on a side stream (`moe.MoEStep`); on once measured on the H200
    linear_table: tuple = LINEAR_TABLE  # path and config by rows (`linear_config`)


_TUNING: contextvars.ContextVar[Tuning] = contextvars.ContextVar("m3serve_kernel_tuning", default=Tuning())


def tuning() -> Tuning:
    """The launch choices in force (`Tuning()` unless a `tuned` block says otherwise)."""
    return _TUNING.get()


@contextlib.contextmanager
def tuned(base: Tuning | None = None, **changes):
    """Run a block's kernel calls with other launch choices: ``base`` (default: those in force) with ``changes``
    (`Tuning` field names; a wrong name raises TypeError). Yields the `Tuning` in force inside."""
    t = replace(base or _TUNING.get(), **changes)
    token = _TUNING.set(t)
    try:
        yield t
    finally:
        _TUNING.reset(token)


# ----------------------------------------------------------------------------------------------- launch geometry
def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def prefill_tiles(query_start_loc, block_t: int, device, skip=()) -> torch.Tensor:
    """int32 [n_tiles, 3] = (sequence, first token, end token): <= block_t consecutive tokens of one sequence (none
    of the sequences in ``skip``). Read-only: the same arguments give the same tensor (every layer of a step asks
    for the split maps of the fp16-pages and SDPA paths again; a long chunk has thousands of tiles)."""
    return _prefill_tiles(tuple(int(x) for x in query_start_loc), block_t, torch.device(device), frozenset(skip))


@functools.lru_cache(maxsize=32)
def _prefill_tiles(qsl: tuple, block_t: int, device: torch.device, skip: frozenset) -> torch.Tensor:
    rows = [(s, t, min(t + block_t, qsl[s + 1])) for s in range(len(qsl) - 1) if s not in skip
            for t in range(qsl[s], qsl[s + 1], block_t)]
    tiles = torch.tensor(rows, dtype=torch.int32).reshape(-1, 3)
    if device.type == "cuda":  # from page-locked memory: the copy does not wait for the device
        return tiles.pin_memory().to(device, non_blocking=True)
    return tiles.to(device)


SDPA_MIN_TOKENS = 128  # `Tuning.prefill_sdpa_from`'s floor: speculative and decode rows never take the SDPA path


def _long_sequences(query_start_loc, start: int | None) -> list[int]:
    """The sequences with at least ``start`` (and `SDPA_MIN_TOKENS`) query tokens in the step; none for None."""
    if start is None:
        return []
    qsl = [int(x) for x in query_start_loc]
    return [s for s in range(len(qsl) - 1) if qsl[s + 1] - qsl[s] >= max(start, SDPA_MIN_TOKENS)]


def sdpa_prefill_sequences(query_start_loc, sparse: bool) -> list[int]:
    """The sequences of a prefill step whose full-attention rows run torch's SDPA (`Tuning.prefill_sdpa_from`)."""
    return [] if sparse else _long_sequences(query_start_loc, tuning().prefill_sdpa_from)


PLAIN_PAGES_MAX_BYTES = 512 << 20  # the fp16 pages one attention call copies at most (a 128K context: 268 MB)


def plain_prefill_sequences(query_start_loc, fmt: int, seq_lens, token_bytes: int, skip=()) -> list[int]:
    """The sequences of a prefill step (none of ``skip``) whose attention reads an fp16 copy of their quantized pages
    (`Tuning.prefill_plain_from`), in order while the copy stays within PLAIN_PAGES_MAX_BYTES; ``seq_lens`` (host):
    the tokens copied, ``token_bytes``: one token's K and V in fp16."""
    if fmt == FMT_PLAIN:
        return []
    out, room = [], PLAIN_PAGES_MAX_BYTES
    for s in _long_sequences(query_start_loc, tuning().prefill_plain_from):
        if s not in skip and int(seq_lens[s]) * token_bytes <= room:
            out.append(s)
            room -= int(seq_lens[s]) * token_bytes
    return out


def plain_pages_reserve_bytes(kv_quantized: bool) -> int:
    """Memory the worker keeps free for `plain_prefill_sequences`' copies."""
    return PLAIN_PAGES_MAX_BYTES if kv_quantized and tuning().prefill_plain_from is not None else 0


def _rows_per_tile(rows: int, pad: int) -> int:
    """Query tokens per tile: ~``rows`` rows of ``pad`` heads each, at least the 16 rows that tl.dot needs."""
    return max(1, rows // pad, 16 // pad)


def attention_block_t(group: int, sparse: bool = False) -> int:
    """Query tokens per MSA prefill tile for ``group`` query heads per KV head (``sparse``: on block-sparse layers)."""
    t = tuning().prefill_sparse_block_t if sparse else None
    t = t if t is not None else tuning().prefill_block_t
    return t if t is not None else _rows_per_tile(32 if platform.interpreting() else 64, next_pow2(group))


def index_block_t(heads: int) -> int:
    """Query tokens per indexer prefill tile for ``heads`` index heads."""
    t = tuning().index_block_t
    return t if t is not None else _rows_per_tile(16 if platform.interpreting() else 64, next_pow2(heads))


# ----------------------------------------------------------------------------------------------- portable or mma
@functools.lru_cache(maxsize=None)
def mma_kernels():
    """The module `nvfp4_mma` (Gluon kernels), or None where this Triton has no Gluon: the portable kernels serve."""
    if not platform.gluon_present():
        return None
    from . import nvfp4_mma
    return nvfp4_mma


@functools.lru_cache(maxsize=None)
def gemm_mma_kernels():
    """The module `grouped_gemm_mma` (Gluon MoE / linear GEMMs, sm_89 / sm_90), or None where this Triton has no
    Gluon."""
    if not platform.gluon_present():
        return None
    from . import grouped_gemm_mma
    return grouped_gemm_mma


def _contiguous_pool(data: torch.Tensor, scales: torch.Tensor | None) -> bool:
    """Pages of codes and of block scales contiguous, codes 16-byte aligned (16-byte loads, constant strides)."""
    return (scales is not None and data.is_contiguous() and scales.is_contiguous() and data.data_ptr() % 16 == 0
            and scales.shape[:-1] == data.shape[:-1] and scales.shape[-1] * 8 == data.shape[-1])


def mma_index_shapes_ok(iq: torch.Tensor, cache) -> bool:
    """Shapes the mma index scan handles: NVFP4 index keys, D = 128, 128-token pages, <= 8 heads."""
    mma = mma_kernels()
    data = cache.index
    return (mma is not None and data is not None and data.dtype == torch.uint8
            and tuple(data.shape[1:]) == (mma.PAGE, mma.HEAD_DIM // 2) and iq.shape[-1] == mma.HEAD_DIM
            and iq.shape[1] <= mma.MAX_INDEX_HEADS and _contiguous_pool(data, cache.index_scale_blocks))


def mma_attention_shapes_ok(q: torch.Tensor, cache) -> bool:
    """Shapes the mma decode attention handles: NVFP4 K/V pages [P, H_kv, 128, 64], D = 128, 16 query heads per
    KV head."""
    mma = mma_kernels()
    k, v = cache.k, cache.v
    return (mma is not None and k.dtype == torch.uint8 and tuple(k.shape[2:]) == (mma.PAGE, mma.HEAD_DIM // 2)
            and q.shape[-1] == mma.HEAD_DIM and q.shape[1] == mma.ATT_GROUP * k.shape[1] and v.shape == k.shape
            and _contiguous_pool(k, cache.k_scale_blocks) and _contiguous_pool(v, cache.v_scale_blocks))


def use_mma_index_scan(iq: torch.Tensor, cache) -> bool:
    """The decode index scan on the mma kernel? (Prefill scans are always portable.)"""
    return (tuning().mma and cache_format(cache.index) == FMT_NVFP4 and mma_index_shapes_ok(iq, cache)
            and platform.nvfp4_mma_ok(iq.device))


def use_mma_decode_attention(q: torch.Tensor, cache) -> bool:
    return (tuning().mma and cache_format(cache.k) == FMT_NVFP4 and mma_attention_shapes_ok(q, cache)
            and platform.nvfp4_mma_ok(q.device))


def asm(device: torch.device) -> bool:
    """The portable kernels' NVFP4 word decoder in inline PTX (vs plain tl ops)?"""
    t = tuning().asm
    return t if t is not None else codecs.nvfp4_asm_ok(device)


# ----------------------------------------------------------------------------------------------- decode attention
def decode_block_n(fmt: int, sparse: bool, on_mma: bool, block_size: int) -> int:
    """Tokens per key tile of the decode attention (a split is made of whole tiles)."""
    t = tuning().decode_block_n
    if on_mma:
        bn = mma_kernels().ATT_SPLIT_UNIT
    elif t is not None:
        bn = t
    elif platform.interpreting():
        bn = 32
    else:  # docs/performance.md, tune rows (H200): 128 for nvfp4 dense-mode, 64 else; ROCm keeps the portable 64
        bn = 128 if fmt == FMT_NVFP4 and not sparse and not platform.rocm() else 64
    return min(block_size, bn)


def decode_words(fmt: int, sparse: bool):
    """The portable decode attention's decoder (see `Tuning.decode_words`); measured on the H200
    (docs/performance.md, decoder rows): nvfp4 sparse -> bytes, nvfp4 dense-mode and fp8 (V) -> int32 words."""
    t = tuning().decode_words
    return t if t is not None else (fmt != FMT_NVFP4 or not sparse)


def fused_norm(x: torch.Tensor) -> bool:
    """Does the model's RMSNorm of ``x`` run `rms_norm.rms_norm` (`Tuning.fused_norm`; GPUs only: the CPU keeps
    torch's form, which the transformers parity tests compare)?"""
    return tuning().fused_norm and x.device.type == "cuda" and x.stride(-1) == 1


def prefill_words(fmt: int):
    """The MSA prefill attention's decoder (see `Tuning.prefill_words`): nvfp4 -> int32 words, 11% / 9% faster than
    bytes (sparse / dense-mode, 8K context, 2048-token chunk, H100, 2026-12-07, bench_msa --prefill-variants words);
    fp8 keeps the native cast (words there not timed)."""
    t = tuning().prefill_words
    return t if t is not None else fmt == FMT_NVFP4


def decode_splits(max_tiles: int, programs: int, sparse: bool, on_mma: bool, device: torch.device) -> tuple[int, int]:
    """(splits, tiles per split) of the decode attention: split-K until about split_target programs per SM run
    (``programs`` = sequences x KV heads), every split non-empty."""
    t = tuning()
    num_splits = t.decode_splits
    if num_splits is None:
        target = t.decode_split_target
        if target is None:  # programs per SM, measured on the H200 (docs/performance.md, decoder rows)
            target = (1 if sparse else 8) if on_mma else 2
        want = -(-target * platform.num_sms(device) // programs)
        num_splits = max(1, min(max_tiles, want))
    tiles_per_split = -(-max_tiles // num_splits)
    return -(-max_tiles // tiles_per_split), tiles_per_split


# ----------------------------------------------------------------------------------------------- the others
def prefill_block_n(block_size: int) -> int:
    t = tuning().prefill_block_n
    return min(block_size, t if t is not None else (32 if platform.interpreting() else 64))


def index_chunks(num_blocks: int, tiles: int, device: torch.device) -> tuple[int, int]:
    """(chunks, blocks per chunk) of the index scan: the blocks of each query tile split until about 4 programs
    per SM run."""
    n = tuning().index_chunks
    if n is None:
        n = max(1, min(num_blocks, -(-4 * platform.num_sms(device) // tiles)))
    per_chunk = -(-num_blocks // n)
    return -(-num_blocks // per_chunk), per_chunk


def index_num_warps(fmt: int) -> int:
    t = tuning().index_num_warps  # measured on the H200 (docs/performance.md, tune rows)
    return t if t is not None else (8 if fmt == FMT_PLAIN else 4)


def insert_tokens(heads_pad: int) -> int:
    """Tokens per kv_insert program (rows = tokens x padded heads)."""
    rows = tuning().insert_rows
    rows = rows if rows is not None else (64 if platform.interpreting() else 16)
    return max(1, rows // heads_pad)


def topk_num_warps(num_blocks: int) -> int:
    return 4 if num_blocks > 512 else 1


# ----------------------------------------------------------------------------------------------- MoE and linears
def _mma_gemm_fits(cfg: dict, rows: tuple[int, ...], k_pads: tuple[int, ...]) -> bool:
    """The mma grouped GEMM's tiles divide the weights: output rows by 16 p, K chunks by warps x unroll."""
    r, per = 16 * cfg["p"], gemm_mma_kernels().NUM_WARPS * cfg["unroll"]
    return all(n % r == 0 for n in rows) and all((k // CHUNK_K) % per == 0 for k in k_pads)


def fp8_gemm_ok(device: torch.device) -> bool:
    """``torch._scaled_mm`` with a scale per row here (a "dense8" row of `LINEAR_TABLE`, `dequant_gemm.fp8_linear`):
    NVIDIA sm_89+ (FP8 tensor cores; not ROCm's fnuz types) or the CPU (the same product in fp32: the tests)."""
    if device.type != "cuda":
        return device.type == "cpu"
    return (torch.cuda.is_available() and not platform.rocm() and not platform.interpreting()
            and torch.cuda.get_device_capability(device) >= (8, 9))


def _tl_fits(cfgs, weights: tuple[PackedWeight, ...], tiles: tuple[int, ...], device: torch.device) -> bool:
    """Do a tl row's tiles fit the device's shared memory (`tl_shared_bytes`)? Config i serves weights i,
    i + len(cfgs) ... (the MoE's routed, then its shared expert's) with ``tiles[i]`` weight tiles per K chunk."""
    limit = _shared_memory(device.index)
    return limit is None or all(tl_shared_bytes(c, weights[i::len(cfgs)], tiles[i]) <= limit
                                for i, c in enumerate(cfgs))


def tl_shared_bytes(cfg: dict, weights: tuple[PackedWeight, ...], tiles: int) -> int:
    """Shared memory of a tl config's pipelined loads, as Triton 3.6 lays them out for sm_90: ``num_stages``
    buffers of the [bm, CHUNK_K] 16-bit activation tile, and of the ``tiles`` [bn, CHUNK_K] weight tiles (gate_up
    loads a gate and an up tile, one with ``fuse``) as stored: ``num_stages`` buffers of dense weights (2 bytes a
    value; they feed the dot as loaded), one fewer of quantized ones (decoded in registers first), codes and block
    scales (NVFP4 0.5625 bytes a value, MXFP8 1.0625). The MoE's gate_up at 128 x 128 in 3 stages: 294,912 bytes
    with bf16 experts (the learned model's warm-up on the H100, 2026-12-07, counted one byte a value and one tile,
    passed the row, and the launch failed: Hopper's limit is 232,448), 135,168 with NVFP4, 167,936 with MXFP8, as
    the compiler counts (tests/kernels/test_grouped_gemm_compile.py)."""
    value = max((p.data.numel() * p.data.element_size() + (p.scale.numel() * p.scale.element_size()
                                                            if p.scale is not None else 0))
                / (p.groups * p.n_pad * p.k_pad) for p in weights)
    dense = any(p.fmt == FMT_DENSE for p in weights)
    stages, tiles = cfg["num_stages"], 1 if cfg.get("fuse") else tiles  # fuse: gate and up rows in one tile
    x_bytes = 1 if cfg.get("a8") else 2  # a8: e4m3 activations
    return int(stages * cfg["bm"] * CHUNK_K * x_bytes
               + (stages - (0 if dense else 1)) * tiles * cfg["bn"] * CHUNK_K * value)


@functools.lru_cache(maxsize=None)
def _shared_memory(index: int | None) -> int | None:
    if not torch.cuda.is_available():  # tests that make a device of type cuda stand for one
        return None
    index = torch.cuda.current_device() if index is None else index
    return getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", None)


def _gemm_config(table: tuple, T: int, device: torch.device, weights: tuple[PackedWeight, ...],
                 rows: tuple[int, ...], k_pads: tuple[int, ...], host_sync: bool, dense_on_cuda: bool,
                 tiles: tuple[int, ...]) -> tuple:
    """(path, configs...) of the first row of ``table`` that fits T tokens of these weights on this device
    (``host_sync``: the op's dense path synchronises with the host, see `dequant_gemm.dense_path_ok`;
    ``dense_on_cuda``: its dense rows' default on CUDA, `Tuning.dense_prefill`; ``tiles``: weight tiles a stage
    loads, per config, `_tl_fits`)."""
    mma = gemm_mma_kernels()
    fast = (tuning().mma and mma is not None and mma.available(device)
            and all(mma.supported(p) for p in weights))
    portable = ("tl",) + (PORTABLE_GEMM,) * (len(table[0]) - 2)
    for limit, path, *cfgs in table:
        if limit is not None and T > limit:
            continue
        if path == "mma" and not (fast and all(_mma_gemm_fits(c, rows, k_pads) for c in cfgs)):
            continue
        if path == "dense8" and not fp8_gemm_ok(device):
            continue
        if path == "dense":
            on = tuning().dense_prefill
            if ((device.type != "cuda" or dense_on_cuda) if on is None else on) and dense_path_ok(device, host_sync):
                return (path, *cfgs)
            continue
        if path == "tl":
            if not platform.compiled_cuda(device):  # the tl rows' tiles were measured on Hopper
                return portable
            if not _tl_fits(cfgs, weights, tiles, device):
                continue
            if tuning().a8:
                cfgs = [dict(c, a8=True) for c in cfgs]
            # wg16 would gather dense weights' columns, a8 serves quantized weights on FP8 tensor cores (sm_89+)
            off = ("wg16", "a8") if any(p.fmt == FMT_DENSE for p in weights) else ()
            if any(c.get("a8") for c in cfgs) and platform.capability(device) < (8, 9):
                off += ("a8",)
            cfgs = [dict(c, **{k: False for k in off if c.get(k)}) for c in cfgs]
        return (path, *cfgs)
    return portable


def moe_config(T: int, w, device: torch.device) -> tuple[str, dict, dict]:
    """(path, gate_up config, down config) of the MoE expert GEMMs for T tokens of `moe.MoEWeights` ``w`` on this
    device (`Tuning.moe_table`): the routed experts', with the shared expert's tiles when they ride along."""
    shared = (w.shared_gate_up, w.shared_down) if w.shared_rides else ()
    return _gemm_config(tuning().moe_table, T, device, (w.gate_up, w.down) + shared, (w.inter_pad, w.hidden),
                        (w.gate_up.k_pad, w.down.k_pad), host_sync=True, dense_on_cuda=False,
                        tiles=(2, 1))


def moe_shared_config(T: int, w, device: torch.device) -> tuple[str, dict, dict]:
    """As `moe_config`, for the shared expert's own launches (`moe.MoEStep.shared_expert`)."""
    return _gemm_config(tuning().moe_table, T, device, (w.shared_gate_up, w.shared_down),
                        (w.shared_inter_pad, w.hidden), (w.shared_gate_up.k_pad, w.shared_down.k_pad), host_sync=True,
                        dense_on_cuda=False, tiles=(2, 1))


def linear_config(M: int, w: PackedWeight, device: torch.device) -> tuple[str, dict]:
    """(path, config) of a quantized linear for M rows of ``w`` on this device (`Tuning.linear_table`)."""
    return _gemm_config(tuning().linear_table, M, device, (w,), (w.n_pad,), (w.k_pad,), host_sync=False,
                        dense_on_cuda=True, tiles=(1,))
