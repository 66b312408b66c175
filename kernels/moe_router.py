"""The MoE router on the device: sigmoid scores + correction bias, top-k, renormalised weights, and the grouping of
assignments by expert, in two launches and without a host synchronisation (CUDA-graph capturable).

* ``_router_logits_kernel``: fp32 logits ``x @ W^T`` (grid: token blocks x expert blocks, so a decode step's router
  weight, 3 MB at M3's 128 x 6144, is read by many programs at once); it also zeroes the per-expert counters and,
  for the mma expert kernels, writes the fp16 activation copy they read (``x16``, see `grouped_gemm_mma.py`).
* ``_router_topk_kernel``: ``p = sigmoid(logits)``; the top-k of ``p + bias`` choose (the bias chooses, it does not
  weigh); the weights are ``p`` at those experts over their sum. Each assignment ``a = token * top_k + slot`` takes
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


@triton.jit
def x16_position(k):
    """Position of element k in the mma kernels' fp16 activation layout: inside each group of 8 the elements are
    stored in the order 0 4 1 5 2 6 3 7 (an f16x2 register then pairs elements j and j + 4, as the decoders do)."""
    return (k & ~7) + 2 * (k & 3) + ((k >> 2) & 1)


@triton.jit
def _router_logits_kernel(
    x_ptr, sx, w_ptr, logits_ptr, counts_ptr, x16_ptr, sx16,
    T, H, H_PAD, E,
    BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, E_PAD: tl.constexpr, USE_DOT: tl.constexpr,
    WRITE_X16: tl.constexpr,
):
    pt = tl.program_id(0)
    pe = tl.program_id(1)
    t = pt * BT + tl.arange(0, BT)
    e = pe * BE + tl.arange(0, BE)
    tm = t < T
    em = e < E
    if (pt == 0) & (pe == 0):
        ee = tl.arange(0, E_PAD)
        tl.store(counts_ptr + ee, tl.zeros((E_PAD,), tl.int32), mask=ee < E)
    acc = tl.zeros((BT, BE), tl.float32)
    for k0 in range(0, H_PAD, BK):
        k = k0 + tl.arange(0, BK)
        km = k < H
        xt = tl.load(x_ptr + t.to(tl.int64)[:, None] * sx + k[None, :], mask=tm[:, None] & km[None, :], other=0.0)
        xf = xt.to(tl.float32)
        wt = tl.load(w_ptr + e.to(tl.int64)[:, None] * H + k[None, :], mask=em[:, None] & km[None, :], other=0.0)
        if USE_DOT:
            acc = tl.dot(xf, tl.trans(wt.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc += tl.sum(xf[:, None, :] * wt.to(tl.float32)[None, :, :], axis=2)
        if WRITE_X16:
            if pe == 0:  # padding columns (H <= k < H_PAD) are written as zeros
                x16 = tl.minimum(tl.maximum(xf, -F16_MAX), F16_MAX).to(tl.float16)
                tl.store(x16_ptr + t.to(tl.int64)[:, None] * sx16 + x16_position(k)[None, :], x16,
                         mask=tm[:, None] & (k < H_PAD)[None, :])
    tl.store(logits_ptr + t.to(tl.int64)[:, None] * E + e[None, :], acc, mask=tm[:, None] & em[None, :])


@triton.jit
def _select(sel, cols, j: tl.constexpr):
    """Index [BT] of the j-th largest of sel [BT, E_PAD] (earlier picks masked out), by repeated argmax."""
    for _ in tl.static_range(j):
        best = tl.argmax(sel, axis=1)
        sel = tl.where(cols[None, :] == best[:, None], float("-inf"), sel)
    return tl.argmax(sel, axis=1)


@triton.jit
def _router_topk_kernel(
    logits_ptr, bias_ptr, ids_ptr, w_ptr, counts_ptr, bucket_ptr, cap, T, E,
    TOPK: tl.constexpr, BT: tl.constexpr, E_PAD: tl.constexpr,
):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.arange(0, E_PAD)
    tm = t < T
    cm = cols < E
    lg = tl.load(logits_ptr + t.to(tl.int64)[:, None] * E + cols[None, :], mask=tm[:, None] & cm[None, :], other=0.0)
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
        rank = tl.atomic_add(counts_ptr + idx, 1, mask=tm)
        tl.store(bucket_ptr + idx.to(tl.int64) * cap + rank, a.to(tl.int32), mask=tm)


# Launch shapes, chosen by the number of tokens (one place): logits block (tokens, experts), broadcast-sum below 16
# tokens (no padded dot rows), top-k block.
def router_config(T: int, E: int) -> dict:
    if T <= 8:
        return dict(BT=triton.next_power_of_2(max(T, 1)), BE=8, BK=128 if T <= 2 else 64, USE_DOT=False, BT2=16)
    if T <= 64:
        return dict(BT=16, BE=16, BK=64, USE_DOT=True, BT2=16)
    return dict(BT=32, BE=min(triton.next_power_of_2(E), 128), BK=32, USE_DOT=True, BT2=32)


def route(x: torch.Tensor, router_weight: torch.Tensor, correction_bias: torch.Tensor, top_k: int, *,
          x16: torch.Tensor | None = None, h_pad: int | None = None, config: dict | None = None) -> Routing:
    """x [T, H] -> `Routing`. ``router_weight`` [E, H] (fp32, as the model keeps it), ``correction_bias`` [E].
    With ``x16`` ([T, h_pad] fp16) the activations are also written there in the mma kernels' layout."""
    T, H = x.shape
    E = router_weight.shape[0]
    if router_weight.shape[1] != H:
        raise ValueError(f"router weight {tuple(router_weight.shape)} does not match hidden size {H}")
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k={top_k} outside [1, {E}]")
    dev = x.device
    cfg = dict(router_config(T, E), **(config or {}))
    logits = torch.empty(T, E, dtype=torch.float32, device=dev)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=dev)
    w = torch.empty(T, top_k, dtype=torch.float32, device=dev)
    counts = torch.empty(E, dtype=torch.int32, device=dev)
    bucket = torch.empty(E, max(T, 1), dtype=torch.int32, device=dev)
    if T == 0:
        counts.zero_()
        return Routing(ids, w, counts, bucket, top_k)
    e_pad = triton.next_power_of_2(E)
    hp = h_pad if h_pad is not None else H
    grid = (triton.cdiv(T, cfg["BT"]), triton.cdiv(E, cfg["BE"]))
    _router_logits_kernel[grid](
        x, x.stride(0), router_weight, logits, counts, x16 if x16 is not None else logits,
        x16.stride(0) if x16 is not None else 0, T, H, max(hp, H), E,
        BT=cfg["BT"], BE=cfg["BE"], BK=cfg["BK"], E_PAD=e_pad, USE_DOT=cfg["USE_DOT"], WRITE_X16=x16 is not None,
        num_warps=4)
    _router_topk_kernel[(triton.cdiv(T, cfg["BT2"]),)](
        logits, correction_bias, ids, w, counts, bucket, bucket.shape[1], T, E,
        TOPK=top_k, BT=cfg["BT2"], E_PAD=e_pad, num_warps=4)
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
