"""Quantized weights as the GEMM kernels read them (MoE experts, dense linears): laid out once at load time.

A `PackedWeight` holds G weight matrices of logical shape ``[N, K]`` (G experts, or 1 for a linear), with
``y = x @ W^T``. Rows are padded to a multiple of 16 and K to a multiple of 128 (zero weights), then cut into
tiles of 16 rows x one K chunk of 128 elements; each tile is one contiguous block (row-major inside), so one warp
of the mma kernels reads it with two 16-byte loads per thread, 512 contiguous bytes per load instruction
(`grouped_gemm_mma.py`), and the portable kernels address it with a few integer ops (`grouped_gemm.py`).

Formats (the checkpoint's, formats.md §1-2; what `m3serve.model.weights.QuantWeight` holds):

* ``nvfp4``: data = the packed E2M1 bytes as stored (even element in the low nibble), 64 bytes per tile row;
  scale = the E4M3 block scales (one per 16 elements), 8 bytes per tile row; rowscale = the fp32
  second-level scale per row. ``W = E2M1 * S * rowscale``.
* ``mxfp8``: data = the E4M3 bytes, 128 per tile row, each group of 8 stored in the order 0 1 4 5 2 3 6 7 (so
  that the mma decoder's f16x2 pairs are elements (j, j + 4), the pairing of the NVFP4 decoder: both read the
  same permuted activations); scale = fp16 multipliers ``2^(b - r)`` of the E8M0 block exponents b (one per 32
  elements, 4 per tile row) against a per-row reference r = max(b) - 15, and rowscale = ``2^(r - 127)``. Exact
  in fp16 for every block within 22 binades of the row's largest (smaller blocks round towards 0; their
  contribution is below 2^-22 of the row's). ``W = E4M3 * scale * rowscale``.
* ``fp8``: per-tensor or per-channel FP8: data as ``mxfp8``, no block scales, rowscale = the fp32 scale.
* ``dense``: bf16/fp16/fp32 ``[G, N_pad, K_pad]`` row-major, no tiling (the portable kernels only).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import nvfp4 as _nvfp4
from .codecs import FMT_DENSE, FMT_FP8, FMT_MXFP8, FMT_NAMES, FMT_NVFP4

TILE_N = 16  # rows per tile (one mma m-tile)
CHUNK_K = 128  # K elements per tile
DATA_BYTES = {FMT_NVFP4: CHUNK_K // 2, FMT_MXFP8: CHUNK_K, FMT_FP8: CHUNK_K}  # per tile row
SCALES = {FMT_NVFP4: CHUNK_K // 16, FMT_MXFP8: CHUNK_K // 32}  # block scales per tile row
MX_ORDER = (0, 1, 4, 5, 2, 3, 6, 7)  # mxfp8 / fp8 byte order inside each group of 8 elements


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass
class PackedWeight:
    """G matrices ``[N, K]`` in one of the layouts above; ``data`` / ``scale`` / ``rowscale`` live on the device."""
    fmt: int
    groups: int
    n: int
    k: int
    data: torch.Tensor
    scale: torch.Tensor | None
    rowscale: torch.Tensor | None

    @property
    def n_pad(self) -> int:
        return round_up(self.n, TILE_N)

    @property
    def k_pad(self) -> int:
        return round_up(self.k, CHUNK_K)

    @property
    def name(self) -> str:
        return FMT_NAMES[self.fmt]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.rowscale) if t is not None)

    def bytes_per_group(self) -> int:
        return self.nbytes() // self.groups


def _pad(t: torch.Tensor, rows: int, cols: int, value=0) -> torch.Tensor:
    """t [G, n, c] -> [G, rows, cols], new entries = value."""
    g, n, c = t.shape
    if (n, c) == (rows, cols):
        return t.contiguous()
    out = torch.full((g, rows, cols), value, dtype=t.dtype, device=t.device)
    out[:, :n, :c] = t
    return out


def _tile(t: torch.Tensor, per_row: int) -> torch.Tensor:
    """[G, N_pad, KC * per_row] -> [G, N_pad / 16, KC, 16, per_row] (each tile contiguous)."""
    g, n, c = t.shape
    return t.reshape(g, n // TILE_N, TILE_N, c // per_row, per_row).permute(0, 1, 3, 2, 4).contiguous()


def _untile(t: torch.Tensor) -> torch.Tensor:
    g, nt, kc, r, per_row = t.shape
    return t.permute(0, 1, 3, 2, 4).reshape(g, nt * r, kc * per_row)


def _as3(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 3 else t.unsqueeze(0)


def _rows(t: torch.Tensor | float, g: int, n: int, device) -> torch.Tensor:
    """A per-tensor, per-row or per-(group, row) fp32 scale -> fp32 [G, N]."""
    s = torch.as_tensor(t, dtype=torch.float32, device=device)
    if s.numel() == 1:
        return s.reshape(1, 1).expand(g, n).contiguous()
    return s.reshape(-1, n).expand(g, n).contiguous() if s.numel() in (n, g * n) else _bad_scale(s, g, n)


def _bad_scale(s, g, n):
    raise ValueError(f"scale of shape {tuple(s.shape)} is neither per tensor, per row [{n}] nor per group [{g}, {n}]")


def _mx_shuffle(q: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    idx = torch.tensor(MX_ORDER, device=q.device)
    if inverse:
        idx = torch.argsort(idx)
    *lead, k = q.shape
    return q.reshape(*lead, k // 8, 8)[..., idx].reshape(*lead, k)


def pack_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, scale_2) -> PackedWeight:
    """``packed`` uint8 [G, N, K/2] (or [N, K/2]), ``block_scale`` e4m3 [G, N, K/16], ``scale_2`` per tensor /
    row / (group, row) -> PackedWeight."""
    packed, block_scale = _as3(packed), _as3(block_scale)
    g, n, kh = packed.shape
    k = kh * 2
    if block_scale.shape != (g, n, k // 16):
        raise ValueError(f"block_scale {tuple(block_scale.shape)} does not match packed {tuple(packed.shape)}")
    np_, kp = round_up(n, TILE_N), round_up(k, CHUNK_K)
    data = _tile(_pad(packed.to(torch.uint8), np_, kp // 2), DATA_BYTES[FMT_NVFP4])
    sc = _tile(_pad(block_scale.view(torch.uint8), np_, kp // 16), SCALES[FMT_NVFP4])
    rs = _pad(_rows(scale_2, g, n, packed.device).unsqueeze(-1), np_, 1, 1.0).reshape(g, np_)
    return PackedWeight(FMT_NVFP4, g, n, k, data, sc, rs)


def pack_mxfp8(q: torch.Tensor, scale_e8m0: torch.Tensor) -> PackedWeight:
    """``q`` e4m3 [G, N, K], ``scale_e8m0`` uint8 [G, N, K/32] -> PackedWeight (see the module doc)."""
    q, scale_e8m0 = _as3(q), _as3(scale_e8m0)
    g, n, k = q.shape
    if scale_e8m0.shape != (g, n, k // 32):
        raise ValueError(f"scale_e8m0 {tuple(scale_e8m0.shape)} does not match q {tuple(q.shape)}")
    np_, kp = round_up(n, TILE_N), round_up(k, CHUNK_K)
    b = scale_e8m0.to(torch.int32)
    ref = b.amax(dim=-1, keepdim=True) - 15  # [G, N, 1]
    mult = torch.ldexp(torch.ones_like(b, dtype=torch.float32), (b - ref).float())
    mult = torch.where(b == 255, torch.full_like(mult, float("nan")), mult).to(torch.float16)
    rowscale = torch.ldexp(torch.ones_like(ref, dtype=torch.float32), (ref - 127).float()).reshape(g, n)
    data = _tile(_mx_shuffle(_pad(q.view(torch.uint8), np_, kp)), DATA_BYTES[FMT_MXFP8])
    sc = _tile(_pad(mult, np_, kp // 32), SCALES[FMT_MXFP8])
    rs = _pad(rowscale.unsqueeze(-1), np_, 1, 1.0).reshape(g, np_)
    return PackedWeight(FMT_MXFP8, g, n, k, data, sc, rs)


def pack_fp8(q: torch.Tensor, scale) -> PackedWeight:
    """``q`` e4m3 [G, N, K] with an fp32 scale per tensor, per row [N] or per (group, row) -> PackedWeight."""
    q = _as3(q)
    g, n, k = q.shape
    np_, kp = round_up(n, TILE_N), round_up(k, CHUNK_K)
    data = _tile(_mx_shuffle(_pad(q.view(torch.uint8), np_, kp)), DATA_BYTES[FMT_FP8])
    rs = _pad(_rows(scale, g, n, q.device).unsqueeze(-1), np_, 1, 1.0).reshape(g, np_)
    return PackedWeight(FMT_FP8, g, n, k, data, None, rs)


def pack_dense(w: torch.Tensor, dtype: torch.dtype | None = None) -> PackedWeight:
    w = _as3(w)
    g, n, k = w.shape
    data = _pad(w.to(dtype or w.dtype), round_up(n, TILE_N), round_up(k, CHUNK_K))
    return PackedWeight(FMT_DENSE, g, n, k, data, None, None)


def pack_quant_weight(qw, rows: slice | None = None, dtype: torch.dtype | None = None) -> PackedWeight:
    """A `QuantWeight` (any leading expert axis, or none) -> PackedWeight; ``rows`` selects output rows (e.g. the
    gate or the up half of a fused gate_up)."""
    r = rows if rows is not None else slice(None)
    if qw.fmt == "nvfp4":
        return pack_nvfp4(qw.packed[..., r, :], qw.block_scale[..., r, :], _as_rows(qw.scale_2[..., r]))
    if qw.fmt == "mxfp8":
        return pack_mxfp8(qw.qweight[..., r, :], qw.scale_e8m0[..., r, :])
    if qw.fmt == "fp8":
        return pack_fp8(qw.qweight[..., r, :], qw.scale[..., r])
    if qw.fmt == "dense":
        return pack_dense(qw.weight[..., r, :], dtype)
    raise ValueError(f"no packed layout for weight format {qw.fmt!r}")


def _as_rows(s: torch.Tensor) -> torch.Tensor:
    return s if s.dim() >= 2 else s.unsqueeze(0)


def concat_rows(parts: list[PackedWeight], n_each: int) -> PackedWeight:
    """Stack the rows of same-format PackedWeights, each padded to ``n_each`` rows (a multiple of 16): e.g. gate
    rows [0, n_each), up rows [n_each, 2 n_each) of a fused gate_up."""
    if n_each % TILE_N or any(p.fmt != parts[0].fmt or p.k != parts[0].k or p.groups != parts[0].groups
                              for p in parts):
        raise ValueError("concat_rows: parts must share format, K and groups; n_each a multiple of 16")
    g = parts[0].groups

    def rows_to(t: torch.Tensor, rows: int, fill) -> torch.Tensor:
        pad = torch.full((g, rows - t.shape[1], *t.shape[2:]), fill, dtype=t.dtype, device=t.device)
        return torch.cat([t, pad], dim=1)

    tiles = n_each if parts[0].fmt == FMT_DENSE else n_each // TILE_N
    data = torch.cat([rows_to(p.data, tiles, 0) for p in parts], dim=1)
    sc = None if parts[0].scale is None else torch.cat([rows_to(p.scale, n_each // TILE_N, 0) for p in parts], 1)
    rs = None if parts[0].rowscale is None else torch.cat([rows_to(p.rowscale, n_each, 1.0) for p in parts], 1)
    return PackedWeight(parts[0].fmt, g, n_each * len(parts), parts[0].k, data, sc, rs)


# The unit of a weight row, in its row scales, in which the portable kernel's FP8 dots round the decoded weights to
# e4m3 (`grouped_gemm`'s ``a8`` tiles and `dequant_gemm.dequant_e4m3`; their launchers pass it as the constexpr A8U):
# the largest value of each format then fits 448 (NVFP4: E2M1 * S <= 6 * 448; MXFP8: E4M3 times a multiplier <= 2^15;
# FP8: E4M3 itself, exact).
A8_UNIT = {FMT_NVFP4: 8.0, FMT_MXFP8: 32768.0, FMT_FP8: 1.0}


def unpack(pw: PackedWeight, group: int | None = None, dtype: torch.dtype = torch.float32,
           e4m3: bool = False) -> torch.Tensor:
    """The torch reference: PackedWeight -> dense ``[G, N_pad, K_pad]`` (padding included, zeros), or ``[N_pad,
    K_pad]`` of one ``group``; ``e4m3``: the values the ``a8`` tiles multiply (each rounded to e4m3 in the units of
    `A8_UNIT`)."""
    if group is None:
        return torch.stack([unpack(pw, g, dtype, e4m3) for g in range(pw.groups)])
    sel = lambda t: t[group: group + 1]
    if pw.fmt == FMT_DENSE:
        return pw.data[group].to(dtype)
    data = _untile(sel(pw.data))
    if pw.fmt == FMT_NVFP4:
        vals = _nvfp4.E2M1_VALUES.to(data.device)[_nvfp4.unpack_fp4(data).long()]
        sc = _untile(sel(pw.scale)).view(torch.float8_e4m3fn).float()
        w = (vals.reshape(*sc.shape, 16) * sc.unsqueeze(-1)).flatten(-2)
    else:
        w = _mx_shuffle(data, inverse=True).view(torch.float8_e4m3fn).float()
        if pw.fmt == FMT_MXFP8:
            sc = _untile(sel(pw.scale)).float()
            w = (w.reshape(*sc.shape, 32) * sc.unsqueeze(-1)).flatten(-2)
    if e4m3:
        unit = A8_UNIT[pw.fmt]
        w = (w / unit).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * unit
    return (w * sel(pw.rowscale).unsqueeze(-1))[0].to(dtype)
