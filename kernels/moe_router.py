"""The MoE router on the device: sigmoid scores + correction bias, top-k, renormalised weights, and the grouping of
assignments by expert, in two launches and without a host synchronisation (CUDA-graph capturable).

* ``_router_logits_kernel``: fp32 partial logits ``x @ W^T`` per K slice (grid: token blocks x K slices, so a
  decode step's router weight, 3 MB at M3's 128 x 6144, is streamed by 48 programs at once, each with all its loads
  in flight); it also zeroes the per-expert counters and, for the mma expert kernels, writes the fp16 activation
  copy they read (``x16``, see `grouped_gemm_mma.py`).
* ``_router_topk_kernel``: the slices summed in a fixed order (deterministic), ``p = sigmoid(logits)``; the top-k
  of ``p + bias`` choose (the bias chooses, it does not weigh); the weights are ``p`` at those experts over their
  sum. Each assignment ``a = token * top_k + slot`` takes
  the next free slot of its expert's bucket with an atomic add: ``bucket[e, :counts[e]]`` lists the assignments of
  expert e (in no particular order: every row of the expert GEMMs is computed independently, so the order never
  changes a result).

The reference is `route_ref` (the model's `Router.forward`, plus the grouping).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import platform
from .codecs import to_e4m3

F16_MAX = tl.constexpr(65504.0)


@dataclass
class Routing:
    """Device-side routing of T tokens: ids / weights ``[T, top_k]``, ``counts [E]``, ``bucket [E, cap]``."""
    ids: torch.Tensor
    weights: torch.Tensor
    counts: torch.Tensor
    bucket: torch.Tensor
    top_k: int

    @property
    def cap(self) -> int:
        return self.bucket.shape[1]

    @property
    def assignments(self) -> int:
        return self.ids.numel()

    def local(self, first: int, n: int) -> "Routing":
        """The grouping of experts [first, first + n) alone, numbered from 0 (expert parallelism: the experts this
        rank holds); ``ids`` and ``weights`` stay global. Views: no launch, no copy."""
        return Routing(self.ids, self.weights, self.counts[first:first + n], self.bucket[first:first + n],
                       self.top_k)


@triton.jit
def wg16_position(k):
    """Position of element k in the portable kernel's wg16 activation order (`grouped_gemm.load_weight_tile_wg16`):
    inside each chunk of 128, element 8w + j + 4h (w = 4a + b a decoded word, j < 4 its code pair, h the pair's
    half) sits at 32b + 8j + 2a + h, so that the four words a thread of a Hopper wgmma loads (16 bytes of NVFP4)
    hold exactly the columns of its register fragment (2q, 2q + 1, 2q + 8, 2q + 9 of each 16, q = a)."""
    e = k & 127
    w = e >> 3
    return (k & ~127) + 32 * (w & 3) + 8 * (e & 3) + 2 * (w >> 2) + ((e >> 2) & 1)


@triton.jit
def x16_position(k):
    """Position of element k in the mma kernels' fp16 activation layout: inside each group of 8 the elements are
    stored in the order 0 4 1 5 2 6 3 7 (an f16x2 register then pairs elements j and j + 4, as the decoders do)."""
    return (k & ~7) + 2 * (k & 3) + ((k >> 2) & 1)


@triton.jit
def _to_x16_kernel(x_ptr, sx, out_ptr, so, K, K_PAD, BK: tl.constexpr, WG16: tl.constexpr):
    """One row of x -> fp16 (saturated at +-65504) in the x16 (WG16: wg16) order; zeros past K."""
    row = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    v = tl.load(x_ptr + row * sx + k, mask=k < K, other=0.0).to(tl.float32)
    v = tl.minimum(tl.maximum(v, -F16_MAX), F16_MAX).to(tl.float16)
    tl.store(out_ptr + row * so + (wg16_position(k) if WG16 else x16_position(k)), v, mask=k < K_PAD)


def to_x16(x: torch.Tensor, k_pad: int, wg16: bool = False) -> torch.Tensor:
    """x [M, K] -> fp16 [M, k_pad] (k_pad a multiple of 128) in the x16 order (`x16_position`: what the route writes
    beside the logits, the mma kernels' activations), or with ``wg16`` in the portable kernel's wg16 order
    (`wg16_position`)."""
    out = torch.empty(x.shape[0], k_pad, dtype=torch.float16, device=x.device)
    if x.shape[0]:
        _to_x16_kernel[(x.shape[0], triton.cdiv(k_pad, 1024))](x, x.stride(0), out, out.stride(0), x.shape[1], k_pad,
                                                              BK=1024, WG16=wg16, num_warps=4)
    return out


@triton.jit
def _to_x8_kernel(x_ptr, sx, out_ptr, so, xs_ptr, K, K_PAD, BK: tl.constexpr, WG16: tl.constexpr,
                  EXACT: tl.constexpr):
    """One row of x times 448 / its largest |value| -> e4m3 (``xs`` = that largest / 448; 0 for a zero row), in the
    wg16 order (WG16) or its own; zeros past K."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BK,), tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + row * sx + k, mask=k < K, other=0.0).to(tl.float32)))
    m = tl.max(amax, 0)
    tl.store(xs_ptr + row, tl.math.div_rn(m, 448.0))  # IEEE divisions: the bits of `to_x8_ref` on every backend
    inv = tl.where(m > 0, tl.math.div_rn(448.0, tl.where(m > 0, m, 1.0)), 0.0)
    for k0 in range(0, K_PAD, BK):
        k = k0 + tl.arange(0, BK)
        v = tl.load(x_ptr + row * sx + k, mask=k < K, other=0.0).to(tl.float32) * inv
        tl.store(out_ptr + row * so + (wg16_position(k) if WG16 else k), to_e4m3(v, EXACT), mask=k < K_PAD)


def to_x8(x: torch.Tensor, k_pad: int, wg16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, k_pad], fp32 [M]): the portable kernel's FP8 activations (its ``a8`` tiles), each row
    scaled by 448 / its largest |value| and rounded to nearest, with ``x ~ x8 * xs[:, None]``; in the wg16 order
    (`wg16_position`) or x's own (an intermediate gate_up already wrote in that order keeps it); zeros past K."""
    out = torch.empty(x.shape[0], k_pad, dtype=torch.float8_e4m3fn, device=x.device)
    xs = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    if x.shape[0]:
        _to_x8_kernel[(x.shape[0],)](x, x.stride(0), out, out.stride(0), xs, x.shape[1], k_pad, BK=1024, WG16=wg16,
                                     EXACT=platform.interpreting(), num_warps=4)
    return out, xs


def to_x8_ref(x: torch.Tensor, k_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`to_x8` in torch (x's own order): the same fp32 operations, so the same bits (``448 / m`` as a tensor
    division: torch computes a number over a tensor as the tensor's reciprocal times it, two roundings)."""
    xf = x.float()
    m = xf.abs().amax(1)
    inv = torch.where(m > 0, torch.full_like(m, 448.0) / m, torch.zeros_like(m))
    out = torch.zeros(x.shape[0], k_pad, dtype=torch.float8_e4m3fn, device=x.device)
    out[:, : x.shape[1]] = (xf * inv[:, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return out, m / torch.full_like(m, 448.0)


@triton.jit(do_not_specialize=["T"])
def _router_logits_kernel(
    x_ptr, sx, w_ptr, part_ptr, counts_ptr, x16_ptr, sx16,
    T, H, H_PAD, E, KSL,
    BT: tl.constexpr, BK: tl.constexpr, SUB: tl.constexpr, E_PAD: tl.constexpr, USE_DOT: tl.constexpr,
    WRITE_X16: tl.constexpr, PREC: tl.constexpr = "ieee",
):
    """Partial logits ``part[s, t, :]`` of K slice s (``KSL`` elements) for a block of tokens and every expert:
    many programs stream the router weight at once; the top-k kernel adds the slices in a fixed order."""
    pt = tl.program_id(0)
    ps = tl.program_id(1)
    t = pt * BT + tl.arange(0, BT)
    e = tl.arange(0, E_PAD)
    tm = t < T
    em = e < E
    if (pt == 0) & (ps == 0):
        tl.store(counts_ptr + e, tl.zeros((E_PAD,), tl.int32), mask=em)
    acc = tl.zeros((BT, E_PAD), tl.float32)
    for k0 in range(ps * KSL, ps * KSL + KSL, BK):
        if WRITE_X16:  # this slice of the fp16 activation copy (columns H <= k < H_PAD written as zeros)
            k = k0 + tl.arange(0, BK)
            xt = tl.load(x_ptr + t.to(tl.int64)[:, None] * sx + k[None, :], mask=tm[:, None] & (k < H)[None, :],
                         other=0.0).to(tl.float32)
            x16 = tl.minimum(tl.maximum(xt, -F16_MAX), F16_MAX).to(tl.float16)
            tl.store(x16_ptr + t.to(tl.int64)[:, None] * sx16 + x16_position(k)[None, :], x16,
                     mask=tm[:, None] & (k < H_PAD)[None, :])
        for s0 in tl.static_range(0, BK, SUB):
            k = k0 + s0 + tl.arange(0, SUB)
            km = k < H
            xf = tl.load(x_ptr + t.to(tl.int64)[:, None] * sx + k[None, :], mask=tm[:, None] & km[None, :],
                         other=0.0).to(tl.float32)
            wt = tl.load(w_ptr + e.to(tl.int64)[:, None] * H + k[None, :], mask=em[:, None] & km[None, :],
                         other=0.0).to(tl.float32)
            if USE_DOT:
                acc = tl.dot(xf, tl.trans(wt), acc, input_precision=PREC)
            else:
                acc += tl.sum(xf[:, None, :] * wt[None, :, :], axis=2)
    tl.store(part_ptr + (ps * T + t.to(tl.int64))[:, None] * E + e[None, :], acc, mask=tm[:, None] & em[None, :])


@triton.jit
def _select(sel, cols, j: tl.constexpr):
    """Index [BT] of the j-th largest of sel [BT, E_PAD] (earlier picks masked out), by repeated argmax."""
    for _ in tl.static_range(j):
        best = tl.argmax(sel, axis=1)
        sel = tl.where(cols[None, :] == best[:, None], float("-inf"), sel)
    return tl.argmax(sel, axis=1)


@triton.jit(do_not_specialize=["T", "cap"])
def _router_topk_kernel(
    part_ptr, KS, bias_ptr, ids_ptr, w_ptr, counts_ptr, bucket_ptr, cap, T, E,
    TOPK: tl.constexpr, BT: tl.constexpr, E_PAD: tl.constexpr, KS_PAD: tl.constexpr,
):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.arange(0, E_PAD)
    tm = t < T
    cm = cols < E
    ks = tl.arange(0, KS_PAD)
    m3 = (ks < KS)[:, None, None] & (tm[:, None] & cm[None, :])[None, :, :]
    off = (ks[:, None, None] * T + t.to(tl.int64)[None, :, None]) * E + cols[None, None, :]
    lg = tl.sum(tl.load(part_ptr + off, mask=m3, other=0.0), axis=0)
    p = tl.sigmoid(lg)
    bias = tl.load(bias_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    sel = tl.where(cm[None, :], p + bias[None, :], float("-inf"))
    total = tl.zeros((BT,), tl.float32)
    for j in tl.static_range(TOPK):
        idx = _select(sel, cols, j)
        total += tl.sum(tl.where(cols[None, :] == idx[:, None], p, 0.0), axis=1)
    for j in tl.static_range(TOPK):
        idx = _select(sel, cols, j)
        wj = tl.sum(tl.where(cols[None, :] == idx[:, None], p, 0.0), axis=1) / total
        a = t * TOPK + j
        tl.store(ids_ptr + a, idx.to(tl.int32), mask=tm)
        tl.store(w_ptr + a, wj, mask=tm)
        rank = tl.atomic_add(counts_ptr + idx, 1, mask=tm, sem="relaxed")
        tl.store(bucket_ptr + idx.to(tl.int64) * cap + rank, a.to(tl.int32), mask=tm)


# Launch shapes by token count (one place): tokens per logits program and K slices (every 128-element chunk its
# own program for decode steps), a broadcast-sum below 16 tokens (no padded dot rows), top-k block size. Past 64
# tokens, K slices until about 256 programs run (at least 8 slices): with 8 slices a step of 64 decodes and 64 prompt
# tokens ran 4 x 8 programs, and its router took 401 us over 4 layers against 81 for the 64 decodes alone (bench_itl
# --profile, H100, 2026-12-07).
def router_config(T: int, n_chunks: int) -> dict:
    if T <= 8:
        bt = triton.next_power_of_2(max(T, 1))
        return dict(BT=bt, KS=n_chunks, SUB=64 // bt, USE_DOT=False, warps=4)
    if T <= 64:
        return dict(BT=16, KS=n_chunks, SUB=32, USE_DOT=True, warps=4)
    most = max(8, 256 // triton.cdiv(T, 32))
    ks = max(d for d in range(1, min(most, n_chunks) + 1) if n_chunks % d == 0)
    return dict(BT=32, KS=ks, SUB=32, USE_DOT=True, warps=4)


def router_precision(device: torch.device) -> str:
    """The logits dot's precision: fp32 products either way (the reference's F.linear in fp32, no TF32). On NVIDIA,
    "tf32x3" (each fp32 operand split in a TF32 high and low part, three tensor-core products: the error of fp32
    products, about 2^-22 relative) where "ieee" ran on the FMA units: 1.2 ms for 8192 tokens of M3's router (6.4
    GFLOP, 5 TFLOP/s; H100, 2026-12-07, bench_prefill's profile); elsewhere "ieee"."""
    return "tf32x3" if platform.compiled_cuda(device) else "ieee"


def route(x: torch.Tensor, router_weight: torch.Tensor, correction_bias: torch.Tensor, top_k: int, *,
          x16: torch.Tensor | None = None, h_pad: int | None = None, config: dict | None = None) -> Routing:
    """x [T, H] -> `Routing`. ``router_weight`` [E, H] (fp32, as the model keeps it), ``correction_bias`` [E].
    With ``x16`` ([T, h_pad] fp16, h_pad a multiple of 128) the activations are also written there in the mma
    kernels' layout."""
    T, H = x.shape
    E = router_weight.shape[0]
    if router_weight.shape[1] != H:
        raise ValueError(f"router weight {tuple(router_weight.shape)} does not match hidden size {H}")
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k={top_k} outside [1, {E}]")
    dev = x.device
    hp = max(h_pad or 0, -(-H // 128) * 128)
    cfg = dict(router_config(T, hp // 128), **(config or {}))
    ks = cfg["KS"]
    part = torch.empty(ks, T, E, dtype=torch.float32, device=dev)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=dev)
    w = torch.empty(T, top_k, dtype=torch.float32, device=dev)
    counts = torch.empty(E, dtype=torch.int32, device=dev)
    bucket = torch.empty(E, max(T, 1), dtype=torch.int32, device=dev)
    if T == 0:
        counts.zero_()
        return Routing(ids, w, counts, bucket, top_k)
    e_pad = triton.next_power_of_2(E)
    _router_logits_kernel[(triton.cdiv(T, cfg["BT"]), ks)](
        x, x.stride(0), router_weight, part, counts, x16 if x16 is not None else part,
        x16.stride(0) if x16 is not None else 0, T, H, hp, E, hp // ks,
        BT=cfg["BT"], BK=128, SUB=cfg["SUB"], E_PAD=e_pad, USE_DOT=cfg["USE_DOT"], WRITE_X16=x16 is not None,
        PREC=router_precision(dev), num_warps=cfg["warps"])
    ks_pad = triton.next_power_of_2(ks)
    bt2 = max(1, min(16, 16384 // (ks_pad * e_pad)))
    _router_topk_kernel[(triton.cdiv(T, bt2),)](
        part, ks, correction_bias, ids, w, counts, bucket, bucket.shape[1], T, E,
        TOPK=top_k, BT=bt2, E_PAD=e_pad, KS_PAD=ks_pad, num_warps=8)
    return Routing(ids, w, counts, bucket, top_k)


def route_ref(x: torch.Tensor, router_weight: torch.Tensor, correction_bias: torch.Tensor, top_k: int):
    """Torch reference (= `Router.forward`): (weights [T, k] fp32, ids [T, k], logits [T, E] fp32)."""
    logits = torch.nn.functional.linear(x.float(), router_weight.float())
    probs = torch.sigmoid(logits)
    _, idx = torch.topk(probs + correction_bias.float(), top_k, dim=-1, sorted=False)
    w = probs.gather(1, idx)
    return w / w.sum(-1, keepdim=True), idx, logits


def grouping_ref(ids: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, list[list[int]]]:
    """counts [E] and, per expert, the sorted assignments (``token * top_k + slot``) routed to it."""
    flat = ids.reshape(-1).long().cpu()
    counts = torch.bincount(flat, minlength=n_experts)
    return counts, [torch.nonzero(flat == e).flatten().tolist() for e in range(n_experts)]
