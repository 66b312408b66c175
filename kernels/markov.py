"""DSpark's greedy Markov phase (design/dspark.md 1.5, the vanilla head): K draft positions, one after the other.

Per sequence s and position k: e = W1[prev] (prev: the anchor, then position k-1's draft, a vocabulary id),
bias = W2 e in W2's dtype (fp32 sums of the exact products, rounded once, as nn.Linear returns it), z = U[s, k] +
bias in fp32, x = argmax z (the lowest column among equal maxima; a NaN wins, the first NaN, as torch.argmax),
handed on as vocab_ids[x] with a reduced draft vocabulary. W1 [V, r] is indexed by vocabulary id; W2 [N, r] and U
[S, K, N] by the draft vocabulary's column (model/dspark_vocab.py: `use_draft_vocab` takes W2's subset rows, W1
stays whole); without one N = V and the column is the id.

`markov_greedy_ref` is the torch statement (the math of executor/speculative/proposer.py's loop: about six launches
per position); `markov_greedy` the Triton kernels, two launches per position:
stage 1 (grid: sequence groups x column tiles): a program loads its tile of W2 once for a group of up to 64
  sequences (so W2 is read once per position at any batch up to 64), gathers the group's W1 rows itself (prev read
  on the device, where stage 2 of position k-1 wrote it), takes the bias of its columns with tl.dot (bf16 / fp16
  operands on compiled GPUs; fp32 operands in "ieee" precision in the interpreter, where a bf16 dot is wrong, and
  for fp32 weights: either way exact products summed in fp32), adds U's columns and writes each sequence's best z
  in the tile and its first column to [S, tiles] partials;
stage 2 (grid: sequences): the best of the partials (the smallest column among the tiles holding it; NaN first),
  mapped to its vocabulary id, stored at tokens[s, k].
Nothing synchronises with the host and every shape comes from the tensors': it runs inside CUDA graphs.
Equal tokens: the bias is the same bf16 number as the reference's whenever the fp32 sums agree; summed in another
order they can differ by one rounding, which moves a draft only where two columns' z are that close (tests use
weights whose sums are exact in any order, so the tokens must be equal).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import platform

_NONE = 2147483647  # "no column" (int32 max): loses every min


def markov_greedy_ref(w1: torch.Tensor, w2: torch.Tensor, base_logits: torch.Tensor, anchors: torch.Tensor,
                      vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
    """W1 [V, r], W2 [N, r], U fp32 [S, K, N], anchors [S] (ids), vocab_ids [N] or None -> drafts int64 [S, K]."""
    prev, out = anchors.long(), []
    for k in range(base_logits.shape[1]):
        x = (base_logits[:, k] + F.linear(F.embedding(prev, w1), w2).float()).argmax(-1)
        prev = x if vocab_ids is None else vocab_ids[x]
        out.append(prev)
    return torch.stack(out, 1)


@triton.jit
def _first_max(z, col, valid):
    """Row-wise over axis 1 of [M, B]: (the largest z, its smallest column), a NaN (the smallest NaN column) winning
    as in torch.argmax; entries not `valid` take no part (a row of none gives (-inf, _NONE))."""
    nan_col = tl.min(tl.where(valid & (z != z), col, 2147483647), axis=1)
    zz = tl.where(valid & (z == z), z, float("-inf"))
    top = tl.max(zz, axis=1)
    top_col = tl.min(tl.where((zz == top[:, None]) & valid, col, 2147483647), axis=1)
    has_nan = nan_col < 2147483647
    return tl.where(has_nan, float("nan"), top), tl.where(has_nan, nan_col, top_col)


@triton.jit
def _markov_tile_kernel(prev_ptr, prev_stride, w1_ptr, w1_stride, w2_ptr, w2_stride, u_ptr, u_stride, part_ptr,
                        part_i_ptr, S, N, T, R: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr,
                        DOT_T: tl.constexpr, PREC: tl.constexpr):
    """Stage 1, program (group, tile): z = U + W2 W1[prev] of BS sequences on BN columns -> part[s, tile] (best z)
    and part_i[s, tile] (its first column)."""
    seq = tl.program_id(0) * BS + tl.arange(0, BS)
    tile = tl.program_id(1)
    sm = seq < S
    col = tile * BN + tl.arange(0, BN)
    cm = col < N
    prev = tl.load(prev_ptr + seq * prev_stride, mask=sm, other=0).to(tl.int64)
    acc = tl.zeros((BS, BN), tl.float32)
    for r0 in range(0, R, BR):
        rr = r0 + tl.arange(0, BR)
        rm = rr < R
        e = tl.load(w1_ptr + prev[:, None] * w1_stride + rr[None, :], mask=sm[:, None] & rm[None, :], other=0.0)
        w = tl.load(w2_ptr + col.to(tl.int64)[:, None] * w2_stride + rr[None, :], mask=cm[:, None] & rm[None, :],
                    other=0.0)
        acc = tl.dot(e.to(DOT_T), tl.trans(w.to(DOT_T)), acc, input_precision=PREC)
    bias = acc.to(w2_ptr.dtype.element_ty).to(tl.float32)  # nn.Linear's output dtype, then .float()
    ok = sm[:, None] & cm[None, :]
    u = tl.load(u_ptr + seq.to(tl.int64)[:, None] * u_stride + col[None, :], mask=ok, other=0.0).to(tl.float32)
    best, best_i = _first_max(u + bias, col[None, :] + tl.zeros((BS, BN), tl.int32), ok)
    tl.store(part_ptr + seq * T + tile, best, mask=sm)
    tl.store(part_i_ptr + seq * T + tile, best_i, mask=sm)


@triton.jit(do_not_specialize=["T"])
def _markov_pick_kernel(part_ptr, part_i_ptr, ids_ptr, tok_ptr, tok_stride, T, HAS_IDS: tl.constexpr,
                        BLOCK_T: tl.constexpr):
    """Stage 2, program (sequence): the draft of the position from the tiles' partials -> tok[s] (a vocabulary id)."""
    s = tl.program_id(0)
    offs = tl.arange(0, BLOCK_T)[None, :]
    ok = offs < T
    best = tl.load(part_ptr + s * T + offs, mask=ok, other=float("-inf"))
    best_i = tl.load(part_i_ptr + s * T + offs, mask=ok, other=2147483647)
    _, col = _first_max(best, best_i, ok)
    tok = col.to(tl.int64)
    if HAS_IDS:
        tok = tl.load(ids_ptr + col).to(tl.int64)
    tl.store(tok_ptr + s * tok_stride + tl.arange(0, 1), tok)


def _dot_type(w1: torch.Tensor, w2: torch.Tensor):
    """tl.dot's operand type: the weights' own half type on a compiled GPU, else fp32 (exact products either way)."""
    half = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    if w1.dtype == w2.dtype and w2.dtype in half and not platform.interpreting():
        return half[w2.dtype]
    return tl.float32


def markov_greedy(w1: torch.Tensor, w2: torch.Tensor, base_logits: torch.Tensor, anchors: torch.Tensor,
                  vocab_ids: torch.Tensor | None = None, block_n: int = 64) -> torch.Tensor:
    """Triton version of :func:`markov_greedy_ref` (same arguments); ``block_n``: the columns of a stage-1 tile."""
    s, k, n = base_logits.shape
    r = w1.shape[1]
    if w2.shape != (n, r):
        raise ValueError(f"markov_greedy: W2 {list(w2.shape)} does not match U's {n} columns and W1's rank {r}")
    dev = base_logits.device
    tokens = torch.empty(s, k, dtype=torch.int64, device=dev)
    if s == 0 or k == 0:
        return tokens
    w1, w2 = w1.contiguous(), w2.contiguous()
    u = base_logits if base_logits.stride(2) == 1 else base_logits.contiguous()
    bs = min(64, max(16, triton.next_power_of_2(s)))  # tl.dot takes 16 rows at least
    tiles = triton.cdiv(n, block_n)
    part = torch.empty(s, tiles, dtype=torch.float32, device=dev)
    part_i = torch.empty(s, tiles, dtype=torch.int32, device=dev)
    dot_t = _dot_type(w1, w2)
    prec = "ieee" if dot_t == tl.float32 else None  # fp32 operands: no tf32 rounding; half ones: the default
    for i in range(k):
        prev = anchors if i == 0 else tokens[:, i - 1]
        _markov_tile_kernel[(triton.cdiv(s, bs), tiles)](
            prev, prev.stride(0), w1, w1.stride(0), w2, w2.stride(0), u[:, i], u.stride(0), part, part_i, s, n, tiles,
            R=r, BS=bs, BN=block_n, BR=min(64, max(16, triton.next_power_of_2(r))), DOT_T=dot_t, PREC=prec,
            num_warps=4)
        _markov_pick_kernel[(s,)](part, part_i, part_i if vocab_ids is None else vocab_ids, tokens[:, i], k, tiles,
                                  HAS_IDS=vocab_ids is not None, BLOCK_T=triton.next_power_of_2(tiles), num_warps=4)
    return tokens
