"""The sampler's counter-based generator, and sampling a token per row in one pass over the logits.

`uniforms(seeds, positions, V)`: the uniform of (row, token) is a 32-bit hash of the request's seed, the position
being sampled and the token id (torch, int64 arithmetic that never overflows); the kernel computes the same hash
in uint32. `sample_simple*`: greedy rows take the argmax, the others the Gumbel-max of logits / temperature over
those uniforms (the first index wins ties); the raw logprob of the chosen token comes out of the same pass (online
log-sum-exp).

`sample_simple_ref` is the torch statement of the same thing (what the sampler's torch path computes for rows with
no top-k / top-p / min-p / penalties); `sample_simple` is the Triton kernel, in two launches and no temporaries of
size [rows, vocab]: stage 1 splits each row's vocabulary across programs (grid rows x splits, `vocab_splits` picks
the count: one row fills the GPU) and writes each split's best score, its first index, max and sum of exp to
[rows, splits] partials; stage 2, one program per row, reduces them (the smallest index among the splits holding
the best score, so the tokens are those of one pass; the log-sum-exp combined from the (max, sum) pairs). Nothing
synchronises with the host and every shape comes from the logits' shape: it runs inside CUDA graphs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import platform

GREEDY_EPS = 1e-5  # engine.sampling_params.GREEDY_TEMPERATURE (kernels import nothing of the engine)

_M32 = 0xFFFFFFFF


def _mulmod32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 tensors holding values < 2^32, with no int64 overflow on the way."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (xorshift-multiply, "lowbias32" constants) of int64 tensors holding values < 2^32."""
    x = x ^ (x >> 16)
    x = _mulmod32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mulmod32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int64 [N] 32-bit keys of (64-bit seed, position): every bit of both reaches the key."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    return hash32(hash32(hash32(lo) ^ hi) ^ (positions & _M32))


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """fp32 [N, vocab] in (0, 1): the counter-based uniforms of each row's (seed, position) and token id."""
    keys = row_keys(seeds, positions)[:, None]
    h = hash32(keys ^ torch.arange(vocab, device=seeds.device, dtype=torch.int64)[None, :])
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))  # 23 bits: the largest is < 1 in fp32


def sample_simple_ref(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor):
    """fp32 logits [N, V] -> (token ids int64 [N], raw logprob of each fp32 [N])."""
    x = logits.float()
    greedy = temperature < GREEDY_EPS
    gumbel = -torch.log(-torch.log(uniforms(seeds, positions, x.shape[1])))
    drawn = (x * inverse_temperature(temperature)[:, None] + gumbel).argmax(-1)
    tokens = torch.where(greedy, x.argmax(-1), drawn)
    return tokens, torch.log_softmax(x, -1).gather(1, tokens[:, None])[:, 0]


def inverse_temperature(temperature: torch.Tensor) -> torch.Tensor:
    """1 / temperature, and 1 for greedy rows (the scale of the logits before the draw: one multiply, computed
    once in torch so the kernel and the torch path scale by the same bits)."""
    return 1.0 / torch.where(temperature < GREEDY_EPS, 1.0, temperature)


@triton.jit
def _hash32(x):
    """The lowbias32 hash of `executor.sampler.hash32` on uint32 (multiplications wrap mod 2^32)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


def vocab_splits(rows: int, vocab: int, device: torch.device, splits: int | None = None) -> tuple[int, int]:
    """(splits, logits per split) of the sampling kernel's stage 1, ``splits`` forcing the count (tests).

    Why: one program per row left a batch-1 decode step streaming 200K logits through one SM (147 us on the H200).
    The vocabulary is split until about 4 programs per SM run (rows x splits), so one row fills the GPU and a
    large batch keeps whole rows per program; but no split goes below 1024 logits, since each program pays a fixed
    cost (the row's key hash, the lane reductions, four stores) and stage 2 reduces one entry per split. The split
    length is a multiple of 16 so that each split's loads start aligned (Triton sees the divisibility). Every split
    is non-empty. H200 (132 SMs), vocab 200,064: batch 1 -> 196 splits of 1024; 64 -> 9 splits; >= 528 -> 1."""
    if splits is None:
        splits = min(-(-4 * platform.num_sms(device) // rows), -(-vocab // 1024))
    chunk = -(-vocab // max(1, splits) // 16) * 16
    return -(-vocab // chunk), chunk


@triton.jit
def _sample_split_kernel(logits_ptr, stride, temp_ptr, inv_t_ptr, seed_ptr, pos_ptr, part_ptr, part_i_ptr, V, CHUNK,
                         BLOCK: tl.constexpr, EPS: tl.constexpr):
    """Stage 1, program (row, split): the split's best score and its first index, the max and the sum of exp of
    its raw logits, stored at part[0..2][row, split] and part_i[row, split]."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    greedy = tl.load(temp_ptr + row) < EPS
    inv_t = tl.load(inv_t_ptr + row)
    seed = tl.load(seed_ptr + row)
    pos = tl.load(pos_ptr + row)
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    key = _hash32(_hash32(_hash32(lo) ^ hi) ^ (pos & 0xFFFFFFFF).to(tl.uint32))
    base = logits_ptr + row.to(tl.int64) * stride
    first = split * CHUNK
    end = tl.minimum(first + CHUNK, V)
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: best score and its first index
    best_i = tl.full([BLOCK], 2147483647, tl.int32)
    m = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: running max and sum of exp (raw logits)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(first, end, BLOCK):
        idx = start + offs
        ok = idx < end
        x = tl.load(base + idx, mask=ok, other=float("-inf")).to(tl.float32)
        h = _hash32(key ^ idx.to(tl.uint32))
        u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        g = -tl.log(-tl.log(u))
        score = tl.where(greedy, x, x * inv_t + g)
        score = tl.where(ok, score, float("-inf"))
        take = score > best  # strict: the earlier index wins ties within a lane
        best = tl.where(take, score, best)
        best_i = tl.where(take, idx, best_i)
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.where(ok, tl.exp(x - m_new), 0.0)
        s = tl.where(m_new == float("-inf"), 0.0, s)
        m = m_new
    top = tl.max(best, axis=0)
    out = row * tl.num_programs(1) + split
    n_part = tl.num_programs(0) * tl.num_programs(1)
    tl.store(part_ptr + out, top)
    tl.store(part_i_ptr + out, tl.min(tl.where(best == top, best_i, 2147483647), axis=0))
    mm = tl.max(m, axis=0)
    tl.store(part_ptr + n_part + out, mm)
    tl.store(part_ptr + 2 * n_part + out, tl.sum(s * tl.exp(m - mm), axis=0))  # NaN when mm = -inf: stage 2 drops it


@triton.jit(do_not_specialize=["SPLITS"])
def _sample_reduce_kernel(logits_ptr, stride, part_ptr, part_i_ptr, tok_ptr, lp_ptr, SPLITS, BLOCK_S: tl.constexpr):
    """Stage 2, program (row): the token is the smallest index among the splits holding the best score (the global
    first index), 0 on a row of -inf only (as torch's argmax); lse combines the splits' (max, sum)."""
    row = tl.program_id(0)
    n_part = tl.num_programs(0) * SPLITS
    offs = tl.arange(0, BLOCK_S)
    ok = offs < SPLITS
    at = row * SPLITS + offs
    best = tl.load(part_ptr + at, mask=ok, other=float("-inf"))
    best_i = tl.load(part_i_ptr + at, mask=ok, other=2147483647)
    m = tl.load(part_ptr + n_part + at, mask=ok, other=float("-inf"))
    s = tl.load(part_ptr + 2 * n_part + at, mask=ok, other=0.0)
    top = tl.max(best, axis=0)
    tok = tl.min(tl.where(best == top, best_i, 2147483647), axis=0)
    tok = tl.where(tok == 2147483647, 0, tok)
    mm = tl.max(m, axis=0)
    lse = mm + tl.log(tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - mm)), axis=0))
    x_tok = tl.load(logits_ptr + row.to(tl.int64) * stride + tok).to(tl.float32)
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(lp_ptr + row, x_tok - lse)


def sample_simple(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  block: int = 2048, splits: int | None = None):
    """Triton version of :func:`sample_simple_ref` (logits fp32 [N, V], row-contiguous); ``block``: the most logits
    a program loads at once, ``splits``: forces the vocabulary splits (default: `vocab_splits`'s rule)."""
    n, v = logits.shape
    dev = logits.device
    tokens = torch.empty(n, dtype=torch.int64, device=dev)
    logprobs = torch.empty(n, dtype=torch.float32, device=dev)
    if n:
        splits, chunk = vocab_splits(n, v, dev, splits)
        part = torch.empty(3, n, splits, dtype=torch.float32, device=dev)  # best score, max, sum of exp
        part_i = torch.empty(n, splits, dtype=torch.int32, device=dev)  # index of the best score
        _sample_split_kernel[(n, splits)](logits, logits.stride(0), temperature, inverse_temperature(temperature),
                                          seeds, positions, part, part_i, v, chunk,
                                          BLOCK=min(block, triton.next_power_of_2(chunk)), EPS=GREEDY_EPS,
                                          num_warps=4)
        _sample_reduce_kernel[(n,)](logits, logits.stride(0), part, part_i, tokens, logprobs, splits,
                                    BLOCK_S=triton.next_power_of_2(splits), num_warps=1)
    return tokens, logprobs
