"""DSpark's greedy Markov phase (design/dspark.md 1.5, the vanilla head): K draft positions, one after the other.

Per sequence s and position k: e = W1[prev] (prev: the anchor, then position k-1's draft, a vocabulary id),
bias = W2 e in W2's dtype (fp32 sums of the exact products, rounded once, as nn.Linear returns it), z = U[s, k] +
bias in fp32, x = argmax z (the lowest column among equal maxima; a NaN wins, the first NaN, as torch.argmax),
handed on as vocab_ids[x] with a reduced draft vocabulary. W1 [V, r] is indexed by vocabulary id; W2 [N, r] and U
[S, K, N] by the draft vocabulary's column (model/dspark_vocab.py: `use_draft_vocab` takes W2's subset rows, W1
stays whole); without one N = V and the column is the id.

`markov_greedy_ref` is the torch statement (the math of executor/speculative/proposer.py's loop: about six launches
per position); `markov_greedy` the Triton kernels:
stage 1 (grid: sequence groups x column splits): a program takes its split's columns BN at a time, loads each tile
  of W2 once for a group of up to 64 sequences (so W2 is read once per position at any batch up to 64), gathers the
  group's W1 rows itself, takes the bias with tl.dot (bf16 / fp16 operands on compiled GPUs; fp32 operands in
  "ieee" precision in the interpreter, where a bf16 dot is wrong, and for fp32 weights: either way exact products
  summed in fp32), adds U's columns and writes each sequence's best z over its split and the first column holding
  it to [S, splits] partials;
stage 2: the best of a sequence's partials (the smallest column among the splits holding it; NaN first), mapped to
  its vocabulary id, stored at tokens[s, k].
Two modes (`splits`): one BN tile per program and stage 2 launched after each position (2K launches; prev read
where stage 2 wrote it), or a few programs per SM, each looping over its columns, and stage 2 run by every stage-1
program of the next position for its own sequences before it starts (K + 1 launches: one stage 2 at the end; each
program reads its group's [BS, splits] partials, cheap while they are few). Partials alternate between two buffers.
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
def _combine(best, best_i, cb, ci):
    """The running (best, first column) of the columns so far and a later chunk's: the chunk's NaN or a strictly
    larger value replaces it (an earlier column keeps a tie), and anything replaces none; a NaN stays."""
    take = (best == best) & ((cb != cb) | (cb > best) | (best_i == 2147483647))
    return tl.where(take, cb, best), tl.where(take, ci, best_i)


@triton.jit
def _drafts(part_ptr, part_i_ptr, ids_ptr, seq, sm, T, M: tl.constexpr, CT: tl.constexpr, HAS_IDS: tl.constexpr):
    """The drafts (vocabulary ids, int64 [M]) of sequences `seq` from their partials [S, T], CT at a time."""
    best = tl.full((M,), float("-inf"), tl.float32)
    best_i = tl.full((M,), 2147483647, tl.int32)
    for t0 in range(0, T, CT):
        tt = t0 + tl.arange(0, CT)
        ok = sm[:, None] & (tt < T)[None, :]
        at = seq[:, None] * T + tt[None, :]
        cb, ci = _first_max(tl.load(part_ptr + at, mask=ok, other=float("-inf")),
                            tl.load(part_i_ptr + at, mask=ok, other=2147483647), ok)
        best, best_i = _combine(best, best_i, cb, ci)
    col = tl.where(best_i == 2147483647, 0, best_i)  # (sequences past S only)
    tok = col.to(tl.int64)
    if HAS_IDS:
        tok = tl.load(ids_ptr + col, mask=sm, other=0).to(tl.int64)
    return tok


# the row count and the drafts' row strides change from step to step (speculating sequences, drafts near the end):
# left unspecialized so that each is one compile, not one per class of 1 / multiple of 16 / other
@triton.jit(do_not_specialize=["prev_stride", "tok_stride", "S"])
def _markov_tile_kernel(prev_ptr, prev_stride, prev_part_ptr, prev_part_i_ptr, ids_ptr, tok_ptr, tok_stride,
                        w1_ptr, w1_stride, w2_ptr, w2_stride, u_ptr, u_stride, part_ptr, part_i_ptr, S, N, T, CHUNK,
                        R: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, CT: tl.constexpr,
                        DOT_T: tl.constexpr, PREC: tl.constexpr, PICK_PREV: tl.constexpr, HAS_IDS: tl.constexpr):
    """Stage 1, program (group, split): z = U + W2 W1[prev] of BS sequences on the split's CHUNK columns, BN at a
    time -> part[s, split] (best z) and part_i[s, split] (its first column). PICK_PREV: prev is the previous
    position's draft, picked here from its partials (prev_part*), and split 0 stores it at tok[s]; else prev is
    read at prev_ptr."""
    seq = tl.program_id(0) * BS + tl.arange(0, BS)
    split = tl.program_id(1)
    sm = seq < S
    if PICK_PREV:
        prev = _drafts(prev_part_ptr, prev_part_i_ptr, ids_ptr, seq, sm, T, BS, CT, HAS_IDS)
        tl.store(tok_ptr + seq * tok_stride, prev, mask=sm & (split == 0))
    else:
        prev = tl.load(prev_ptr + seq * prev_stride, mask=sm, other=0).to(tl.int64)
    best = tl.full((BS,), float("-inf"), tl.float32)
    best_i = tl.full((BS,), 2147483647, tl.int32)
    first = split * CHUNK
    end = tl.minimum(first + CHUNK, N)
    for c0 in range(first, end, BN):
        col = c0 + tl.arange(0, BN)
        cm = col < end
        acc = tl.zeros((BS, BN), tl.float32)
        for r0 in range(0, R, BR):
            rr = r0 + tl.arange(0, BR)
            rm = rr < R
            e = tl.load(w1_ptr + prev[:, None] * w1_stride + rr[None, :], mask=sm[:, None] & rm[None, :], other=0.0)
            w = tl.load(w2_ptr + col.to(tl.int64)[:, None] * w2_stride + rr[None, :],
                        mask=cm[:, None] & rm[None, :], other=0.0)
            acc = tl.dot(e.to(DOT_T), tl.trans(w.to(DOT_T)), acc, input_precision=PREC)
        bias = acc.to(w2_ptr.dtype.element_ty).to(tl.float32)  # nn.Linear's output dtype, then .float()
        ok = sm[:, None] & cm[None, :]
        u = tl.load(u_ptr + seq.to(tl.int64)[:, None] * u_stride + col[None, :], mask=ok, other=0.0).to(tl.float32)
        cb, ci = _first_max(u + bias, col[None, :] + tl.zeros((BS, BN), tl.int32), ok)
        best, best_i = _combine(best, best_i, cb, ci)
    tl.store(part_ptr + seq * T + split, best, mask=sm)
    tl.store(part_i_ptr + seq * T + split, best_i, mask=sm)


@triton.jit(do_not_specialize=["tok_stride", "T"])
def _markov_pick_kernel(part_ptr, part_i_ptr, ids_ptr, tok_ptr, tok_stride, T, CT: tl.constexpr,
                        HAS_IDS: tl.constexpr):
    """Stage 2, program (sequence): the position's draft from its partials -> tok[s] (a vocabulary id)."""
    seq = tl.program_id(0) + tl.arange(0, 1)
    tl.store(tok_ptr + seq * tok_stride, _drafts(part_ptr, part_i_ptr, ids_ptr, seq, seq >= 0, T, 1, CT, HAS_IDS))


def _dot_type(w1: torch.Tensor, w2: torch.Tensor):
    """tl.dot's operand type: the weights' own half type on a compiled GPU, else fp32 (exact products either way)."""
    half = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    if w1.dtype == w2.dtype and w2.dtype in half and not platform.interpreting():
        return half[w2.dtype]
    return tl.float32


def markov_greedy(w1: torch.Tensor, w2: torch.Tensor, base_logits: torch.Tensor, anchors: torch.Tensor,
                  vocab_ids: torch.Tensor | None = None, block_n: int = 64, splits: int | None = None) -> torch.Tensor:
    """Triton version of :func:`markov_greedy_ref` (same arguments). ``block_n``: the columns a stage-1 program
    takes at once. ``splits``: None: one block_n tile per program and stage 2 launched per position (2K launches);
    P: P programs per sequence group, each looping over N / P columns, and each position's programs pick the
    previous draft from its P partials themselves (K + 1 launches; each program reads its sequences' P partials)."""
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
    # warps (sm_90 builds, cuobjdump's resource usage): with 4, a 16 x 64 or 32 x 64 tile takes 80-104 registers a
    # thread and 4096-element tiles reach the 255 cap (spilling from 8192); with 8, up to 64 x 128 fits in 215
    # without spills. Which width runs fastest: benchmarks/bench_markov.py.
    warps = 4 if bs * block_n < 4096 else 8
    chunk = block_n if splits is None else triton.cdiv(triton.cdiv(n, max(1, splits)), block_n) * block_n
    t = triton.cdiv(n, chunk)
    part = torch.empty(2, s, t, dtype=torch.float32, device=dev)  # this position's partials and the previous one's
    part_i = torch.empty(2, s, t, dtype=torch.int32, device=dev)
    ids = part_i if vocab_ids is None else vocab_ids
    dot_t = _dot_type(w1, w2)
    prec = "ieee" if dot_t == tl.float32 else None  # fp32 operands: no tf32 rounding; half ones: the default
    tile = dict(R=r, BS=bs, BN=block_n, BR=min(64, max(16, triton.next_power_of_2(r))),
                CT=min(64, triton.next_power_of_2(t)), DOT_T=dot_t, PREC=prec, HAS_IDS=vocab_ids is not None,
                num_warps=warps)
    pick = dict(CT=min(1024, triton.next_power_of_2(t)), HAS_IDS=vocab_ids is not None, num_warps=warps)
    for i in range(k):
        cur, pick_prev = i % 2, splits is not None and i > 0
        prev = anchors if i == 0 else tokens[:, i - 1]
        _markov_tile_kernel[(triton.cdiv(s, bs), t)](
            prev, prev.stride(0), part[1 - cur], part_i[1 - cur], ids, prev, k, w1, w1.stride(0), w2, w2.stride(0),
            u[:, i], u.stride(0), part[cur], part_i[cur], s, n, t, chunk, PICK_PREV=pick_prev, **tile)
        if splits is None or i == k - 1:
            _markov_pick_kernel[(s,)](part[cur], part_i[cur], ids, tokens[:, i], k, t, **pick)
    return tokens
