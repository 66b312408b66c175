"""Shared helpers for the Triton kernels: cache-format detection, dot dtypes, in-kernel NVFP4/FP8 codecs.

Formats of a paged cache tensor are told apart by dtype: ``uint8`` = NVFP4 (packed E2M1, even element in
the low nibble, with an ``float8_e4m3fn`` block-scale tensor beside it), ``float8_e4m3fn`` = FP8 with a
per-layer scale, any float dtype = plain (bf16 on GPU).

In-kernel codecs are plain ``tl`` integer/float ops (portable to ROCm and to the interpreter):

* ``e2m1_to_f16``: a 4-bit code -> fp16 by placing the sign in bit 15 and the 3 magnitude bits in bits
  11..9 (exponent low bits + top mantissa bit), which is the value times 2^-14; one multiply restores it.
* ``f32_to_e4m3_bits``: fp32 -> e4m3fn bits, round-to-nearest-even, saturating at 448 (integer ops, so
  the result is identical on every backend and matches torch's ``.to(torch.float8_e4m3fn)``).
* ``e4m3_bits_to_f32``: the exact inverse (bits into an fp16, times 2^8).
* ``f32_to_e2m1_codes``: the threshold chain of ``nvfp4.cast_to_e2m1_codes``.

Interpreter pitfall: under ``TRITON_INTERPRET=1`` ``tl.dot`` on bf16 operands returns garbage, so the
Python wrappers pick fp32 dot operands for bf16 caches there (``dot_dtype``).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

FMT_PLAIN, FMT_FP8, FMT_NVFP4 = 0, 1, 2


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cache_format(data: torch.Tensor) -> int:
    if data.dtype == torch.uint8:
        return FMT_NVFP4
    if data.dtype == torch.float8_e4m3fn:
        return FMT_FP8
    if not data.dtype.is_floating_point:
        raise TypeError(f"unsupported cache dtype {data.dtype}")
    return FMT_PLAIN


def format_name(data: torch.Tensor) -> str:
    return {FMT_PLAIN: "bfloat16", FMT_FP8: "fp8", FMT_NVFP4: "nvfp4"}[cache_format(data)]


def dot_dtype(fmt: int, data_dtype: torch.dtype):
    """tl dtype of the dot operands for a cache of this format.

    NVFP4 and FP8 values (E2M1 * E4M3 block scale, or E4M3) are exact in fp16, so fp16 dots on every
    backend. Plain caches: their own dtype on GPU (bf16 dots), fp32 under the interpreter.
    """
    if fmt != FMT_PLAIN:
        return tl.float16
    if interpreting() or data_dtype == torch.float32:
        return tl.float32
    return tl.float16 if data_dtype == torch.float16 else tl.bfloat16


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 4


def prefill_tiles(query_start_loc, block_t: int, device) -> torch.Tensor:
    """int32 [n_tiles, 3] = (sequence, first token, end token): <= block_t consecutive tokens of one sequence."""
    qsl = [int(x) for x in query_start_loc]
    rows = [(s, t, min(t + block_t, qsl[s + 1])) for s in range(len(qsl) - 1)
            for t in range(qsl[s], qsl[s + 1], block_t)]
    return torch.tensor(rows, dtype=torch.int32, device=device).reshape(-1, 3)


@functools.lru_cache(maxsize=None)
def nvfp4_mma_kernels():
    """The module ``nvfp4_mma`` (Gluon kernels for sm_89/sm_90), or None where this Triton has no Gluon (older or
    some ROCm builds): then the portable kernels serve everywhere."""
    try:
        from . import nvfp4_mma
    except ImportError:
        return None
    return nvfp4_mma


def u8_view(t: torch.Tensor | None) -> torch.Tensor | None:
    """uint8 view of an e4m3 tensor (kernels write e4m3 bits computed with integer ops)."""
    if t is None:
        return None
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@triton.jit
def e2m1_to_f16(nib):
    """E2M1 codes (uint8 values 0..15) -> float16, exact."""
    n = nib.to(tl.uint16)
    bits = ((n & 8) << 12) | ((n & 7) << 9)
    return bits.to(tl.float16, bitcast=True) * 16384.0


@triton.jit
def e4m3_bits_to_f32(b):
    """e4m3fn bits (uint8) -> float32, exact for every finite code (NaN codes decode to +-480)."""
    n = b.to(tl.uint16)
    bits = ((n & 0x80) << 8) | ((n & 0x7F) << 7)
    return bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def f32_to_e4m3_bits(x):
    """float32 -> e4m3fn bits (uint8): round to nearest even, |x| saturated at 448 (NaN -> 448)."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    e = a >> 23
    # normal e4m3 (|x| >= 2^-6, fp32 exponent >= 121): drop 20 mantissa bits with RNE, rebias 127 -> 7
    nrm = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    nrm = tl.minimum(nrm, 0x7E)
    # subnormal e4m3: m = RNE(|x| * 2^9) from the 24-bit significand
    mant = (a & 0x7FFFFF) | 0x800000
    sh = tl.minimum(tl.maximum(141 - e, 1), 25)
    q = mant >> sh
    rem = mant & ((1 << sh) - 1)
    half = 1 << (sh - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    sub = q + up.to(tl.int32)
    res = tl.where(e >= 121, nrm, sub)
    return (res | sign).to(tl.uint8)


@triton.jit
def f32_to_e2m1_codes(y):
    """float32 (already divided by its scale) -> E2M1 codes (uint8 0..15), RNE, saturating at 6."""
    a = tl.abs(y)
    mag = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
           + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
           + (a > 5.0).to(tl.int32))
    sign = ((y.to(tl.int32, bitcast=True) >> 28) & 0x8)
    return (mag | sign).to(tl.uint8)


@triton.jit
def nvfp4_encode(xe, xo, scale):
    """Even/odd elements ``[R, G, 8]`` (fp32) of G 16-element groups -> (packed bytes ``[R, G, 8]``, e4m3 block-scale
    bits ``[R, G]``) with the per-tensor ``scale``: the bytes of ``nvfp4.quantize_nvfp4`` (exact divisions)."""
    amax = tl.maximum(tl.max(tl.abs(xe), axis=2), tl.max(tl.abs(xo), axis=2))  # [R, G]
    sf_bits = f32_to_e4m3_bits(tl.minimum(tl.math.div_rn(amax, 6.0 * scale), 448.0))
    denom = e4m3_bits_to_f32(sf_bits) * scale
    pos = denom > 0.0
    den = tl.where(pos, denom, 1.0)[:, :, None]
    ye = tl.where(pos[:, :, None], tl.math.div_rn(xe, den), 0.0)
    yo = tl.where(pos[:, :, None], tl.math.div_rn(xo, den), 0.0)
    return f32_to_e2m1_codes(ye) | (f32_to_e2m1_codes(yo) << 4), sf_bits


@triton.jit
def fp8_encode(x, scale):
    """fp32 -> e4m3 bits of ``x / scale`` (saturating): the bytes of ``fp8.quantize_fp8``."""
    return f32_to_e4m3_bits(tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0))


@triton.jit
def f32_to_bf16_rne(x):
    """float32 -> bfloat16, round to nearest even in integer ops (the interpreter's own cast truncates)."""
    b = x.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return (r & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def cast_to(x, dtype: tl.constexpr):
    """``x.to(dtype)`` with exact round-to-nearest-even for bfloat16 on every backend."""
    if dtype == tl.bfloat16:
        if x.dtype == tl.bfloat16:
            return x
        else:
            return f32_to_bf16_rne(x.to(tl.float32))
    else:
        return x.to(dtype)


# NVFP4 tiles are decoded to fp16 *pre-scaled by 2^-7*: E2M1 * S * 2^-7 = f16bits(code) * (S * 2^7), one multiply
# per element. Exact: the product has <= 6 significant bits and is >= 0.5 * 2^-9 * 2^-7 = 2^-17, representable
# (as an fp16 subnormal at worst); S * 2^7 <= 448 * 128 fits fp16. Callers multiply results by NVFP4_UNSCALE.
NVFP4_UNSCALE = 128.0


@triton.jit
def nvfp4_tile_f16(byte, scale, BN: tl.constexpr, DH: tl.constexpr):
    """Packed bytes [BN, DH] (uint8) + e4m3 block scales [BN, DH/8] -> (even, odd) elements, fp16 [BN, DH]
    each, in units of 2^-7 (see NVFP4_UNSCALE)."""
    s = scale.to(tl.float16) * 128.0
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (BN, DH // 8, 8)), (BN, DH))
    n = byte.to(tl.uint16)
    lo = (((n & 0x8) << 12) | ((n & 0x7) << 9)).to(tl.float16, bitcast=True) * s
    hi = (((n & 0x80) << 8) | ((n & 0x70) << 5)).to(tl.float16, bitcast=True) * s
    return lo, hi


@triton.jit
def _f16_pair(p):
    lo = (p & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    hi = ((p >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def nvfp4_words_f16(w):
    """NVFP4 data as int32 words (8 codes each, code k in bits 4k..4k+3) -> the 8 codes as fp16 tensors of
    w's shape, valued E2M1 * 2^-14. Two codes per 32-bit op: codes k and k+4 sit 16 bits apart, so one
    shift-and-mask places both (sign -> bit 15 / 31, magnitude -> bits 9..11 / 25..27)."""
    p0 = ((w << 9) & 0x0E000E00) | ((w << 12) & -2147450880)  # 0x80008000
    p1 = ((w << 5) & 0x0E000E00) | ((w << 8) & -2147450880)
    p2 = ((w << 1) & 0x0E000E00) | ((w << 4) & -2147450880)
    p3 = ((w >> 3) & 0x0E000E00) | (w & -2147450880)
    e0, e4 = _f16_pair(p0)
    e1, e5 = _f16_pair(p1)
    e2, e6 = _f16_pair(p2)
    e3, e7 = _f16_pair(p3)
    return e0, e1, e2, e3, e4, e5, e6, e7


# FP8 data as int32 words (4 e4m3 bytes each) -> the 4 bytes as fp16 valued e4m3 * 2^-8 (exact, subnormals
# included; callers multiply by FP8_WORDS_UNSCALE). Bytes 0 and 2, 1 and 3 sit 16 bits apart: one op each pair.
FP8_WORDS_UNSCALE = 256.0


@triton.jit
def fp8_words_f16(w):
    pa = ((w & 0x007F007F) << 7) | ((w & 0x00800080) << 8)
    pb = ((w & 0x7F007F00) >> 1) | (w & -2147450880)  # 0x80008000
    b0, b2 = _f16_pair(pa)
    b1, b3 = _f16_pair(pb)
    return b0, b1, b2, b3


# CUDA fast path (sm_89+): each E2M1 code c becomes the e4m3 byte ((c & 7) << 2) | ((c & 8) << 4), whose value
# is exactly E2M1(c) * 2^-6, four codes per 32-bit op; the hardware cvt turns two e4m3 into an f16x2.
_NVFP4_ASM = tl.constexpr("""
{
.reg .b32 x, y, lo, hi, t;
.reg .b16 a, b;
prmt.b32 x, $8, $9, 0x6240;
prmt.b32 y, $8, $9, 0x7351;
and.b32 lo, x, 0x07070707;
shl.b32 lo, lo, 2;
and.b32 t, x, 0x08080808;
shl.b32 t, t, 4;
or.b32 lo, lo, t;
mov.b32 {a, b}, lo;
cvt.rn.f16x2.e4m3x2 $0, a;
cvt.rn.f16x2.e4m3x2 $4, b;
shr.b32 hi, x, 2;
and.b32 hi, hi, 0x1C1C1C1C;
and.b32 t, x, 0x80808080;
or.b32 hi, hi, t;
mov.b32 {a, b}, hi;
cvt.rn.f16x2.e4m3x2 $1, a;
cvt.rn.f16x2.e4m3x2 $5, b;
and.b32 lo, y, 0x07070707;
shl.b32 lo, lo, 2;
and.b32 t, y, 0x08080808;
shl.b32 t, t, 4;
or.b32 lo, lo, t;
mov.b32 {a, b}, lo;
cvt.rn.f16x2.e4m3x2 $2, a;
cvt.rn.f16x2.e4m3x2 $6, b;
shr.b32 hi, y, 2;
and.b32 hi, hi, 0x1C1C1C1C;
and.b32 t, y, 0x80808080;
or.b32 hi, hi, t;
mov.b32 {a, b}, hi;
cvt.rn.f16x2.e4m3x2 $3, a;
cvt.rn.f16x2.e4m3x2 $7, b;
}
""")


@triton.jit
def nvfp4_words_f16_asm(w):
    """Like nvfp4_words_f16, values E2M1 * 2^-6 (CUDA inline PTX, two words per call: every output register
    is the f16x2 of one code position in two adjacent words, so nothing needs repacking)."""
    return tl.inline_asm_elementwise(_NVFP4_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [w],
                                     dtype=(tl.float16, tl.float16, tl.float16, tl.float16,
                                            tl.float16, tl.float16, tl.float16, tl.float16),
                                     is_pure=True, pack=2)


@triton.jit
def nvfp4_joined_tile(w, sc, BN: tl.constexpr, D: tl.constexpr, ASM: tl.constexpr = False):
    """int32 words [BN, D/8] + e4m3 block scales [BN, D/16] -> one fp16 tile [BN, D] valued E2M1 * S * 2^-7,
    columns in tl.join order: column 8w + 4x + 2y + z holds element 8w + 4z + 2y + x (see joined_cols)."""
    if ASM:
        s = sc.to(tl.float16) * 0.5
        f0, f1, f2, f3, f4, f5, f6, f7 = nvfp4_words_f16_asm(w)
    else:
        s = sc.to(tl.float16) * 128.0
        f0, f1, f2, f3, f4, f5, f6, f7 = nvfp4_words_f16(w)
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (BN, D // 16, 2)), (BN, D // 8))
    t = tl.join(tl.join(tl.join(f0 * s, f1 * s), tl.join(f2 * s, f3 * s)),
                tl.join(tl.join(f4 * s, f5 * s), tl.join(f6 * s, f7 * s)))
    return tl.reshape(t, (BN, D))


@triton.jit
def _asm_check_kernel(w_ptr, sc_ptr, out_ptr, N: tl.constexpr, ASM: tl.constexpr):
    r = tl.arange(0, 16)
    w = tl.load(w_ptr + r[:, None] * (N // 8) + tl.arange(0, N // 8)[None, :])
    sc = tl.load(sc_ptr + r[:, None] * (N // 16) + tl.arange(0, N // 16)[None, :])
    t = nvfp4_joined_tile(w, sc, 16, N, ASM).to(tl.float32)
    tl.store(out_ptr + r[:, None] * N + tl.arange(0, N)[None, :], t)


_ASM_OK: dict = {}


def nvfp4_asm_ok(device: torch.device) -> bool:
    """Use the inline-PTX NVFP4 decoder? CUDA (not ROCm, not the interpreter), sm_89+, and a one-time check
    that it decodes every code and scale exactly like the portable decoder (else the portable one is used)."""
    if device.type != "cuda" or interpreting() or getattr(torch.version, "hip", None):
        return False
    if os.environ.get("M3SERVE_NVFP4_ASM", "1") == "0":
        return False
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _ASM_OK:
        ok = False
        try:
            if torch.cuda.get_device_capability(device) >= (8, 9):
                g = torch.Generator(device="cpu").manual_seed(0)
                w = torch.randint(0, 256, (16, 64), dtype=torch.uint8, generator=g)
                w[0, :8] = torch.arange(0, 256, 32, dtype=torch.uint8) | torch.arange(8, dtype=torch.uint8)
                sc = torch.rand(16, 8, generator=g).mul(300).to(torch.float8_e4m3fn)
                w, sc = w.to(device).view(torch.int32), sc.to(device)
                outs = []
                for asm in (True, False):
                    o = torch.empty(16, 128, device=device)
                    _asm_check_kernel[(1,)](w, sc, o, N=128, ASM=asm)
                    outs.append(o)
                ok = bool(torch.equal(outs[0], outs[1]))
        except Exception:  # noqa: BLE001  (no PTX support for the cvt: use the portable decoder)
            ok = False
        _ASM_OK[key] = ok
    return _ASM_OK[key]


@triton.jit
def joined_cols(D: tl.constexpr):
    """Element index of each column of an nvfp4_joined_tile."""
    c = tl.arange(0, D)
    return (c // 8) * 8 + (c & 1) * 4 + (c & 2) + ((c >> 2) & 1)
