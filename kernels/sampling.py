"""The sampler's counter-based generator, and sampling a token per row in one pass over the logits.

`uniforms(seeds, positions, V)`: the uniform of (row, token) is a 32-bit hash of the request's seed, the position
being sampled and the token id (torch, int64 arithmetic that never overflows); the kernel computes the same hash
in uint32. `sample_simple*`: greedy rows take the argmax, the others the Gumbel-max of logits / temperature over
those uniforms; the raw logprob of the chosen token comes out of the same pass (online log-sum-exp).

`sample_simple_ref` is the torch statement of the same thing (what the sampler's torch path computes for rows with
no top-k / top-p / min-p / penalties); `sample_simple` is the Triton kernel: one program per row, the vocabulary in
chunks, no temporaries of size [rows, vocab].
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

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


@triton.jit
def _sample_kernel(logits_ptr, stride, temp_ptr, inv_t_ptr, seed_ptr, pos_ptr, tok_ptr, lp_ptr, V,
                   BLOCK: tl.constexpr, EPS: tl.constexpr):
    row = tl.program_id(0)
    greedy = tl.load(temp_ptr + row) < EPS
    inv_t = tl.load(inv_t_ptr + row)
    seed = tl.load(seed_ptr + row)
    pos = tl.load(pos_ptr + row)
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    key = _hash32(_hash32(_hash32(lo) ^ hi) ^ (pos & 0xFFFFFFFF).to(tl.uint32))
    base = logits_ptr + row.to(tl.int64) * stride
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: best score and its first index
    best_i = tl.full([BLOCK], 2147483647, tl.int32)
    m = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: running max and sum of exp (raw logits)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        idx = start + offs
        ok = idx < V
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
    tok = tl.min(tl.where(best == top, best_i, 2147483647), axis=0)  # the first index of the best score
    mm = tl.max(m, axis=0)
    lse = mm + tl.log(tl.sum(s * tl.exp(m - mm), axis=0))
    x_tok = tl.load(base + tok).to(tl.float32)
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(lp_ptr + row, x_tok - lse)


def sample_simple(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  block: int = 2048):
    """Triton version of :func:`sample_simple_ref` (logits fp32 [N, V], row-contiguous)."""
    n, v = logits.shape
    tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n:
        _sample_kernel[(n,)](logits, logits.stride(0), temperature, inverse_temperature(temperature), seeds,
                             positions, tokens, logprobs, v,
                             BLOCK=min(block, triton.next_power_of_2(v)), EPS=GREEDY_EPS, num_warps=4)
    return tokens, logprobs
