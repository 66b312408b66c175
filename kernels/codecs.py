"""Cache formats as the kernels see them, and the in-kernel codecs (NVFP4 / FP8 encode and decode in ``tl``).

Formats of a paged cache tensor are told apart by dtype: ``uint8`` = NVFP4 (packed E2M1, even element in
the low nibble, with an ``float8_e4m3fn`` block-scale tensor beside it), ``float8_e4m3fn`` = FP8 with a
per-layer scale, any float dtype = plain (bf16 on GPU). ``cache_format`` gives the code (``FMT_*``) that the
kernels take as their ``FMT`` constexpr; jitted code compares it with the constexpr twins ``PLAIN`` / ``FP8`` /
``NVFP4`` (a jitted function may read a global only if it is a constexpr).

In-kernel codecs are plain ``tl`` integer/float ops (portable to ROCm and to the interpreter):

* ``nvfp4_tile_f16``: 4-bit codes -> fp16 by placing the sign in bit 15 and the 3 magnitude bits in bits
  11..9 (exponent low bits + top mantissa bit), which is the value times 2^-14; one multiply by the block scale
  restores it (pre-scaled, see NVFP4_UNSCALE).
* ``f32_to_e4m3_bits``: fp32 -> e4m3fn bits, round-to-nearest-even, saturating at 448 (integer ops, so
  the result is identical on every backend and matches torch's ``.to(torch.float8_e4m3fn)``).
* ``e4m3_bits_to_f32``: the exact inverse (bits into an fp16, times 2^8).
* ``to_e4m3``: fp16 / fp32 -> the ``float8e4nv`` dot operand (the hardware convert; the integer codec above in the
  interpreter).
* ``f32_to_e2m1_codes``: the threshold chain of ``nvfp4.cast_to_e2m1_codes``.
* ``nvfp4_words_f16`` / ``fp8_words_f16``: two codes per 32-bit op from int32 words; ``nvfp4_words_f16_asm``:
  the CUDA inline-PTX variant (hardware e4m3x2 -> f16x2 convert), used where ``nvfp4_asm_ok`` holds.

Interpreter pitfall: under ``TRITON_INTERPRET=1`` ``tl.dot`` on bf16 operands returns garbage, so the
Python wrappers pick fp32 dot operands for bf16 caches there (``dot_dtype``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import platform

# The one format enum: a packed weight's format (`weight_layout.PackedWeight.fmt`), a cache's (`cache_format`), the
# kernels' FMT constexpr. An unquantized cache is the dense format (FMT_PLAIN names it on the cache side).
FMT_NVFP4, FMT_MXFP8, FMT_FP8, FMT_DENSE = 0, 1, 2, 3
FMT_PLAIN = FMT_DENSE
FMT_NAMES = {FMT_NVFP4: "nvfp4", FMT_MXFP8: "mxfp8", FMT_FP8: "fp8", FMT_DENSE: "dense"}
# constexpr twins for jitted code (`if FMT == NVFP4:`)
NVFP4, MXFP8, FP8, DENSE = (tl.constexpr(FMT_NVFP4), tl.constexpr(FMT_MXFP8), tl.constexpr(FMT_FP8),
                            tl.constexpr(FMT_DENSE))
PLAIN = DENSE
# The two NVFP4 decoders of the Gluon mma kernels (`nvfp4_mma`): the hardware e4m3 -> f16x2 convert, or integer
# ops alone; constexpr twins for jitted code as above.
MODE_CVT, MODE_INT = 0, 1
CVT, INT = tl.constexpr(MODE_CVT), tl.constexpr(MODE_INT)


def cache_format(data: torch.Tensor) -> int:
    if data.dtype == torch.uint8:
        return FMT_NVFP4
    if data.dtype == torch.float8_e4m3fn:
        return FMT_FP8
    if not data.dtype.is_floating_point:
        raise TypeError(f"unsupported cache dtype {data.dtype}")
    return FMT_PLAIN


def dot_dtype(fmt: int, data_dtype: torch.dtype):
    """tl dtype of the dot operands for a cache of this format.

    NVFP4 and FP8 values (E2M1 * E4M3 block scale, or E4M3) are exact in fp16, so fp16 dots on every
    backend. Plain caches: their own dtype on GPU (bf16 dots), fp32 under the interpreter.
    """
    if fmt != FMT_PLAIN:
        return tl.float16
    if platform.interpreting() or data_dtype == torch.float32:
        return tl.float32
    return tl.float16 if data_dtype == torch.float16 else tl.bfloat16


def u8_view(t: torch.Tensor | None) -> torch.Tensor | None:
    """uint8 view of an e4m3 tensor (kernels write e4m3 bits computed with integer ops)."""
    if t is None:
        return None
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@triton.jit
def e2m1_to_f16(nib):
    """E2M1 codes (uint8 values 0..15) -> float16, exact: the sign to bit 15 and the 3 magnitude bits to bits 11..9
    (the value times 2^-14), then one multiply."""
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
def to_e4m3(x, EXACT: tl.constexpr):
    """fp16 / fp32 -> ``float8e4nv``, round to nearest even, saturated at 448: the hardware convert, or with EXACT
    (the interpreter, whose convert rounds up across a binade wrongly: 1.99 -> 1.0) `f32_to_e4m3_bits`."""
    if EXACT:
        return f32_to_e4m3_bits(x.to(tl.float32)).to(tl.float8e4nv, bitcast=True)
    return x.to(tl.float8e4nv)


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
# is exactly E2M1(c) * 2^-6, four codes per 32-bit op; the hardware cvt turns two e4m3 into an f16x2. The PTX lines
# of that byte trick serve this decoder and the Gluon ones (`nvfp4_mma`): e4m3_low_nibbles_ptx puts the four low
# nibbles of the 32-bit register `src` into e4m3 bytes in `dst`, e4m3_high_nibbles_ptx the four high ones
# (t1, t2: scratch registers; t1 may be dst).
def e4m3_low_nibbles_ptx(src: str, dst: str, t1: str, t2: str) -> list[str]:
    return [f"and.b32 {t1}, {src}, 0x07070707;", f"shl.b32 {t1}, {t1}, 2;", f"and.b32 {t2}, {src}, 0x08080808;",
            f"shl.b32 {t2}, {t2}, 4;", f"or.b32 {dst}, {t1}, {t2};"]


def e4m3_high_nibbles_ptx(src: str, dst: str, t1: str, t2: str) -> list[str]:
    return [f"shr.b32 {t1}, {src}, 2;", f"and.b32 {t1}, {t1}, 0x1C1C1C1C;", f"and.b32 {t2}, {src}, 0x80808080;",
            f"or.b32 {dst}, {t1}, {t2};"]


def _nvfp4_words_asm() -> str:
    """Inputs $8 $9: two adjacent int32 words; output $k (k < 4): the f16x2 of code k of both words, $k+4 of
    code k + 4 (byte-permuted first so that each register holds one code position of the two words)."""
    lines = ["", "{", ".reg .b32 x, y, lo, hi, t;", ".reg .b16 a, b;", "prmt.b32 x, $8, $9, 0x6240;",
             "prmt.b32 y, $8, $9, 0x7351;"]
    for src, out_lo, out_hi in (("x", 0, 1), ("y", 2, 3)):
        for out, nibbles in ((out_lo, e4m3_low_nibbles_ptx), (out_hi, e4m3_high_nibbles_ptx)):
            reg = "lo" if out == out_lo else "hi"
            lines += nibbles(src, reg, reg, "t")
            lines += [f"mov.b32 {{a, b}}, {reg};", f"cvt.rn.f16x2.e4m3x2 ${out}, a;",
                      f"cvt.rn.f16x2.e4m3x2 ${out + 4}, b;"]
    return "\n".join(lines + ["}", ""])


_NVFP4_ASM = tl.constexpr(_nvfp4_words_asm())


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
    """Use the inline-PTX NVFP4 decoder? Where the platform allows it (`platform.nvfp4_asm_allowed`) and a one-time
    check on the device shows that it decodes every code and scale exactly like the portable decoder."""
    if not platform.nvfp4_asm_allowed(device):
        return False
    key = platform.device_index(device)
    if key not in _ASM_OK:
        try:
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
            _ASM_OK[key] = bool(torch.equal(outs[0], outs[1]))
        except Exception:  # noqa: BLE001  (no PTX support for the cvt: use the portable decoder)
            _ASM_OK[key] = False
    return _ASM_OK[key]


@triton.jit
def joined_cols(D: tl.constexpr):
    """Element index of each column of an nvfp4_joined_tile."""
    c = tl.arange(0, D)
    return (c // 8) * 8 + (c & 1) * 4 + (c & 2) + ((c >> 2) & 1)
