"""The large-M path of the expert GEMMs and the quantized linears: decode the weights once per call, then cuBLAS.

At prefill-sized steps every weight tile is used by many token rows, so decoding NVFP4 / MXFP8 / FP8 in the GEMM's
registers (`grouped_gemm`, `grouped_gemm_mma`) repeats the decode for every row tile and keeps the tensor cores
waiting on integer ops. Here one launch (`dequant`) decodes the weights into a bf16 scratch buffer (the layout of
`weight_layout.unpack`: ``[G, N_pad, K_pad]`` row-major, rowscale applied) and cuBLAS does the GEMM:

* linears (``MODE_LINEAR``): ``torch.mm`` on the decoded ``[N, K]``;
* MoE experts (``MODE_GATE_UP`` / ``MODE_DOWN``): the routed rows sorted by expert (the router's buckets, in bucket
  order), then ``torch._grouped_mm`` with per-expert row offsets; the shared expert (the plain rows) by ``torch.mm``.

`dense_grouped_gemm` keeps the contract of `grouped_gemm.grouped_gemm` (which rows are read and written, the
SwiGLU-OAI epilogue times the routing weight, padded columns), so `moe.MoEStep` and `quant_linear` only switch the
call. The decoded weights are never kept: the scratch is allocated per call (torch's caching allocator reuses it)
and holds at most ``scratch_mb`` of experts at a time (the experts are decoded in chunks; only the experts the step
routes rows to are decoded). The chunking reads the routing's counts on the host: one synchronisation per MoE
launch, so `dispatch` never picks this path while a CUDA graph is being captured.

Which path runs at which token count: `dispatch.MOE_TABLE` / `dispatch.LINEAR_TABLE` ("dense" rows).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .codecs import MXFP8, cast_to, to_e4m3
from .grouped_gemm import MODE_GATE_UP, MODE_LINEAR, load_weight_tile
from .moe_router import to_x8
from .platform import interpreting, rocm
from .weight_layout import A8_UNIT, CHUNK_K, FMT_DENSE, TILE_N, PackedWeight

SCRATCH_MB = 2048  # default bound of the decoded experts held at once (dispatch's "dense" rows may say otherwise)


@triton.jit
def _dequant_kernel(data, scale, rowscale, groups_ptr, out_ptr, NT16, KC, N_PAD, K_PAD, FMT: tl.constexpr,
                    BN: tl.constexpr, WDT: tl.constexpr, E8: tl.constexpr = False, A8U: tl.constexpr = 1.0,
                    EXACT: tl.constexpr = False):
    """One [BN rows, 128] tile of group groups[program 0] -> out[program 0, rows, chunk] (rowscale applied; E8: e4m3
    in the a8 tiles' units, A8U = `weight_layout.A8_UNIT` of FMT, the rowscale left to the caller; EXACT: the
    interpreter's codec, `codecs.to_e4m3`)."""
    j = tl.program_id(0)
    g = tl.load(groups_ptr + j)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    c = tl.program_id(2)
    rmask = rows < N_PAD
    r = tl.minimum(rows, N_PAD - 1)  # BN may reach past N_PAD (a multiple of 16 only): read a valid row, store none
    w = load_weight_tile(data, scale, g, r, c, NT16, KC, N_PAD, K_PAD, FMT, BN, WDT).to(tl.float32)
    UNS: tl.constexpr = 256.0 if (FMT == MXFP8) and (WDT != tl.float32) else 1.0
    k = c * 128 + tl.arange(0, 128)
    dst = out_ptr + (j * N_PAD + rows.to(tl.int64))[:, None] * K_PAD + k[None, :]
    if E8:
        tl.store(dst, to_e4m3(w * (UNS / A8U), EXACT), mask=rmask[:, None])
    else:
        w = w * (tl.load(rowscale + g * N_PAD + r) * UNS)[:, None]
        tl.store(dst, cast_to(w, out_ptr.dtype.element_ty), mask=rmask[:, None])


def _all_groups(pw: PackedWeight, groups: torch.Tensor | list[int] | None) -> torch.Tensor:
    """int32 group indices on pw's device: all of them by default (a list: a host-to-device copy, not while a CUDA
    graph is being captured)."""
    if groups is None:
        return torch.arange(pw.groups, dtype=torch.int32, device=pw.data.device)
    if isinstance(groups, list):
        return torch.tensor(groups, dtype=torch.int32, device=pw.data.device)
    return groups


def _decode(pw: PackedWeight, groups: torch.Tensor, out: torch.Tensor, wdt, e8: bool = False) -> torch.Tensor:
    """One `_dequant_kernel` launch over ``groups`` of quantized ``pw`` into ``out``; ``wdt``: the decode dtype (exact
    fp16 ops on the GPU, fp32 under the interpreter, as `grouped_gemm`)."""
    n, bn = groups.numel(), 64
    if n:
        grid = (n, triton.cdiv(pw.n_pad, bn), pw.k_pad // CHUNK_K)
        _dequant_kernel[grid](pw.data, pw.scale if pw.scale is not None else pw.data, pw.rowscale, groups, out,
                              pw.n_pad // TILE_N, pw.k_pad // CHUNK_K, pw.n_pad, pw.k_pad, FMT=pw.fmt, BN=bn,
                              WDT=wdt, E8=e8, A8U=A8_UNIT[pw.fmt] if e8 else 1.0, EXACT=e8 and interpreting(),
                              num_warps=4)
    return out


def dequant(pw: PackedWeight, groups: torch.Tensor | list[int] | None = None, dtype: torch.dtype = torch.bfloat16,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """Groups ``groups`` (default: all) of ``pw`` decoded -> ``[len(groups), N_pad, K_pad]`` in ``dtype`` (padding
    zero): `weight_layout.unpack` in one launch. Dense weights are returned as they are (a view, no copy) when
    they already have ``dtype``."""
    groups = _all_groups(pw, groups)
    n = groups.numel()
    if pw.fmt == FMT_DENSE:
        sel = pw.data.index_select(0, groups.long()) if n != pw.groups else pw.data
        return sel if sel.dtype == dtype else sel.to(dtype)
    out = torch.empty(n, pw.n_pad, pw.k_pad, dtype=dtype, device=pw.data.device) if out is None else out
    return _decode(pw, groups, out, tl.float32 if interpreting() or dtype == torch.float32 else tl.float16)


def dequant_e4m3(pw: PackedWeight, groups: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups ``groups`` (default: all) of quantized ``pw`` as the ``a8`` tiles round them, in one launch: (e4m3
    ``[n, N_pad, K_pad]``, fp32 row scales ``[n, N_pad]``), their product `weight_layout.unpack(..., e4m3=True)`."""
    if pw.fmt == FMT_DENSE:
        raise ValueError("dequant_e4m3 serves quantized weights only")
    groups = _all_groups(pw, groups)
    out = torch.empty(groups.numel(), pw.n_pad, pw.k_pad, dtype=torch.float8_e4m3fn, device=pw.data.device)
    _decode(pw, groups, out, tl.float32 if interpreting() else tl.float16, e8=True)
    return out, pw.rowscale.index_select(0, groups.long()) * A8_UNIT[pw.fmt]


def bf16_bytes_per_group(pw: PackedWeight, dtype: torch.dtype = torch.bfloat16) -> int:
    return pw.n_pad * pw.k_pad * torch.finfo(dtype).bits // 8


def _swiglu(h: torch.Tensor, ng: int, alpha: float, limit: float) -> torch.Tensor:
    """SwiGLU-OAI of gate columns [0, ng) and up columns [ng, 2 ng) in fp32 (as `grouped_gemm.swiglu_oai_f32`)."""
    g = h[:, :ng].float().clamp(max=limit)
    u = h[:, ng: 2 * ng].float().clamp(-limit, limit)
    return (u + 1.0) * (g * torch.sigmoid(g * alpha))


def _epilogue(h: torch.Tensor, mode: int, ng: int, n_out: int, wt, alpha: float, limit: float) -> torch.Tensor:
    if mode == MODE_GATE_UP:
        y = _swiglu(h, ng, alpha, limit)
        return y * wt[:, None] if wt is not None else y
    return h[:, :n_out]


def _plain(x: torch.Tensor, out: torch.Tensor, mode: int, w: PackedWeight, T: int, x_off: int, out_off: int,
           ng: int, alpha: float, limit: float):
    """Rows t of all T tokens (the shared expert, or a linear): x[t + x_off] -> out[t + out_off]."""
    k = x.shape[1]
    group0 = torch.zeros(1, dtype=torch.int32, device=x.device)  # a launch, not a host copy: capturable
    wd = dequant(w, group0, x.dtype)[0, :, :k]
    xs = x[x_off: x_off + T]
    n_out = ng if mode == MODE_GATE_UP else w.n
    dst = out[out_off: out_off + T, :n_out]
    if mode != MODE_GATE_UP and dst.dtype == x.dtype and dst.is_contiguous():
        torch.mm(xs, wd[:n_out].t(), out=dst)
        return
    h = torch.mm(xs, wd[: 2 * ng if mode == MODE_GATE_UP else n_out].t())
    dst.copy_(_epilogue(h, mode, ng, n_out, None, alpha, limit))


def sorted_rows(routing) -> tuple[torch.Tensor, list[int]]:
    """(assignment ids sorted by expert, in bucket order, int64 [rows]; rows per expert on the host [E]): one
    synchronisation (the counts)."""
    counts = routing.counts.tolist()
    cap = routing.cap
    keep = torch.arange(cap, device=routing.bucket.device)[None, :] < routing.counts[:, None].to(torch.int64)
    return routing.bucket[keep].long(), counts


def _routed(x: torch.Tensor, out: torch.Tensor, mode: int, w: PackedWeight, routing, x_div: int, ng: int,
            scaling: float, alpha: float, limit: float, scratch_mb: int):
    """Routed rows: assignment a reads x[a // x_div], writes out[a]; experts decoded ``scratch_mb`` at a time."""
    order, counts = sorted_rows(routing)
    if order.numel() == 0:
        return
    k = x.shape[1]
    # cuBLAS's grouped GEMM wants 16-byte aligned rows: K padded to the weight's K_pad where x's rows are not,
    # and all N_pad columns computed (the logical ones kept)
    kk = k if (k * x.element_size()) % 16 == 0 else w.k_pad
    n_out = ng if mode == MODE_GATE_UP else w.n
    n_w = 2 * ng if mode == MODE_GATE_UP else w.n_pad
    per_chunk = max(1, (scratch_mb << 20) // bf16_bytes_per_group(w, x.dtype))
    touched = [e for e, c in enumerate(counts) if c]
    wt_all = routing.weights.reshape(-1).float() * scaling if mode == MODE_GATE_UP else None
    r0 = 0
    for i in range(0, len(touched), per_chunk):
        experts = touched[i: i + per_chunk]
        cnt = [counts[e] for e in experts]
        r1 = r0 + sum(cnt)
        wd = dequant(w, experts, x.dtype)[:, :n_w, :kk]  # [C, N, K]
        a = order[r0:r1]
        offs = torch.tensor(cnt, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(x.device, non_blocking=True)
        xs = x.index_select(0, a // x_div)
        if kk != k:
            xs = F.pad(xs, (0, kk - k))
        h = torch._grouped_mm(xs, wd.transpose(1, 2), offs=offs)
        y = _epilogue(h, mode, ng, n_out, wt_all[a] if wt_all is not None else None, alpha, limit)
        out[:, :n_out].index_copy_(0, a, y.to(out.dtype))
        r0 = r1


def dense_grouped_gemm(x: torch.Tensor, out: torch.Tensor, mode: int, *, routed: PackedWeight | None = None,
                       plain: PackedWeight | None = None, routing=None, T: int, x_div: int = 1, x_off: int = 0,
                       out_off: int = 0, ng: int = 0, scaling: float = 1.0, alpha: float = 1.702, limit: float = 7.0,
                       scratch_mb: int = SCRATCH_MB) -> torch.Tensor:
    """`grouped_gemm.grouped_gemm` (same arguments, same rows and columns written) on decoded weights and cuBLAS."""
    if x.stride(1) != 1:
        x = x.contiguous()
    if plain is not None and T:
        _plain(x, out, mode, plain, T, x_off, out_off, ng, alpha, limit)
    if routed is not None:
        _routed(x, out, mode, routed, routing, x_div, ng, scaling, alpha, limit, scratch_mb)
    return out


def dense_linear(x2: torch.Tensor, pw: PackedWeight, out: torch.Tensor) -> torch.Tensor:
    """x2 [M, K] @ W^T -> out [M, N]: the weight decoded once to x's dtype, then ``torch.mm`` (cuBLAS)."""
    return dense_grouped_gemm(x2, out, MODE_LINEAR, plain=pw, T=x2.shape[0])


def fp8_linear(x2: torch.Tensor, pw: PackedWeight, out: torch.Tensor) -> torch.Tensor:
    """x2 [M, K] @ W^T -> out [M, N] on FP8 tensor cores (path "dense8"): the weight decoded once straight to e4m3 with
    a scale per row (`dequant_e4m3`: 1 byte a value written where `dequant` writes 2), x to e4m3 with a scale per row
    (`moe_router.to_x8`), then ``torch._scaled_mm`` (twice bf16's rate on Hopper). The arithmetic of the ``a8``
    tiles (`grouped_gemm`): lossy, e4m3 keeps 4 significant bits where an NVFP4 value times its block scale can
    need 6."""
    n = out.shape[1]
    w8, sw = dequant_e4m3(pw, torch.zeros(1, dtype=torch.int32, device=x2.device))
    x8, sx = to_x8(x2, pw.k_pad)
    if x2.is_cuda:
        y = torch._scaled_mm(x8, w8[0].t(), scale_a=sx[:, None], scale_b=sw[0][None, :], out_dtype=torch.bfloat16)
    else:  # the same product in fp32 (torch 2.11's CPU _scaled_mm takes per-tensor scales only; 2.13's both)
        y = (x8.float() @ w8[0].float().t()) * sx[:, None] * sw[0][None, :]
    out.copy_(y[:, :n])
    return out


def dense_path_ok(device: torch.device, host_sync: bool) -> bool:
    """The decode-then-cuBLAS path can run here: torch has ``_grouped_mm`` (not tried on ROCm), and, for a call that
    synchronises with the host (``host_sync``: the MoE chunking reads the routing's counts), no CUDA graph is being
    captured. The linears never synchronise: they may be captured."""
    if not hasattr(torch, "_grouped_mm") or rocm():
        return False
    capturing = device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    return not (host_sync and capturing)


__all__ = ["dequant", "dense_grouped_gemm", "dense_linear", "dense_path_ok", "fp8_linear", "fp8_rows", "sorted_rows",
           "SCRATCH_MB"]
