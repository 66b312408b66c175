"""Torch references for NVFP4 / MXFP8 / FP8 (formats.md sections 1, 2, 3.1)."""
import pytest
import torch

from m3serve.kernels.fp8 import FP8_MAX, dequantize_fp8, quantize_fp8
from m3serve.kernels.mxfp8 import MX_BLOCK, dequantize_mxfp8, e8m0_to_float, quantize_mxfp8
from m3serve.kernels.nvfp4 import (
    E2M1_VALUES,
    FP4_BLOCK,
    cast_to_e2m1_codes,
    dequantize_nvfp4,
    nvfp4_global_from_compressed_tensors,
    pack_fp4,
    quantize_nvfp4,
    unpack_fp4,
)

SHAPES = [(8, 64), (3, 5, 128), (2, 2, 4, 32), (256, 512)]
DTYPES = [torch.float32, torch.bfloat16]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------------------------- E2M1 / packing
def test_e2m1_table():
    assert FP4_BLOCK == 16
    assert E2M1_VALUES.dtype == torch.float32 and E2M1_VALUES.shape == (16,)
    mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert E2M1_VALUES[:8].tolist() == mags
    assert E2M1_VALUES[8:].tolist() == [-m for m in mags]


# (input, expected magnitude) - every boundary of formats.md 1.4, ties to the even code.
ROUNDING = [
    (0.0, 0.0), (0.1, 0.0), (0.25, 0.0), (0.2500001, 0.5), (0.5, 0.5), (0.7499999, 0.5),
    (0.75, 1.0), (1.0, 1.0), (1.25, 1.0), (1.2500001, 1.5), (1.5, 1.5), (1.7499999, 1.5),
    (1.75, 2.0), (2.0, 2.0), (2.5, 2.0), (2.5000002, 3.0), (3.0, 3.0), (3.4999998, 3.0),
    (3.5, 4.0), (4.0, 4.0), (5.0, 4.0), (5.0000005, 6.0), (6.0, 6.0), (7.0, 6.0), (100.0, 6.0), (1e30, 6.0),
]


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_e2m1_rounding_boundaries(sign):
    y = torch.tensor([sign * v for v, _ in ROUNDING], dtype=torch.float32)
    codes = cast_to_e2m1_codes(y)
    assert codes.dtype == torch.uint8
    got = E2M1_VALUES[codes.long()]
    want = torch.tensor([sign * m for _, m in ROUNDING])
    assert torch.equal(got, want), list(zip(y.tolist(), got.tolist()))
    # sign bit: every negative input (including those rounding to zero) carries bit 3
    assert torch.all((codes >> 3) == (1 if sign < 0 else 0))


def test_e2m1_codes_exact_values():
    # every representable value maps to its own code
    assert torch.equal(cast_to_e2m1_codes(E2M1_VALUES), torch.arange(16, dtype=torch.uint8))


def test_pack_order_hand_built():
    codes = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert pack_fp4(codes).tolist() == [0x21, 0x43]
    assert unpack_fp4(torch.tensor([0x21, 0x43, 0xF0], dtype=torch.uint8)).tolist() == [1, 2, 3, 4, 0, 15]


@pytest.mark.parametrize("shape", [(10,), (3, 7, 32), (5, 64)])
def test_pack_unpack_roundtrip(shape):
    codes = torch.randint(0, 16, shape, generator=_gen(1), dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (*shape[:-1], shape[-1] // 2)
    assert torch.equal(unpack_fp4(packed), codes)


def test_pack_odd_raises():
    with pytest.raises(ValueError):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))


# ----------------------------------------------------------------------------------------------- NVFP4 quantize
def _half_step(y_abs):
    """Half the E2M1 grid spacing around |y| (y in units of the block's dequant factor)."""
    return torch.where(y_abs <= 2.0, 0.25, torch.where(y_abs <= 4.0, 0.5, 1.0))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_roundtrip_error_bound(shape, dtype):
    x = torch.randn(shape, generator=_gen(hash(shape) % 1000)).to(dtype)
    packed, S, s2 = quantize_nvfp4(x)
    K = shape[-1]
    assert packed.dtype == torch.uint8 and packed.shape == (*shape[:-1], K // 2)
    assert S.dtype == torch.float8_e4m3fn and S.shape == (*shape[:-1], K // 16)
    assert s2.dtype == torch.float32 and s2.dim() == 0

    xf = x.float()
    assert s2.item() == pytest.approx(xf.abs().max().item() / 2688.0, rel=1e-6)
    xd = dequantize_nvfp4(packed, S, s2)
    assert xd.dtype == torch.float32 and xd.shape == x.shape
    assert dequantize_nvfp4(packed, S, s2, dtype=torch.bfloat16).dtype == torch.bfloat16

    blocks = xf.reshape(*shape[:-1], K // 16, 16)
    amax_j = blocks.abs().amax(-1)
    D = S.float() * s2  # per-block dequant factor actually used
    # a priori: the block scale is amax_j / (6 s2) up to E4M3 rounding (relative 2^-4 for normals, abs 2^-10 subn.)
    ideal = amax_j / (6 * s2)
    assert torch.all((S.float() - ideal).abs() <= torch.maximum(ideal * 2 ** -4, torch.tensor(2.0 ** -10)) + 1e-6)
    # per element: at most half an E2M1 step at that element's magnitude, in units of D (a saturated element of
    # a block whose scale rounded down errs by <= 6 * 2^-4 * D, also inside the half step of 1.0 above 4)
    err = (xd.reshape(blocks.shape) - blocks).abs()
    bound = _half_step(blocks.abs() / D.unsqueeze(-1)) * D.unsqueeze(-1) * (1 + 1e-6)
    assert torch.all(err <= bound), (err - bound).max()
    # coarse form of the same bound: |err| <= amax_j / 6 * (1 + 2^-4)
    assert torch.all(err <= (amax_j / 6 * (1 + 2 ** -4) + 1e-7).unsqueeze(-1))
    # relative RMS error on Gaussian data: measured 9.4-9.7 %
    rel_rms = ((xd - xf).norm() / xf.norm()).item()
    assert 0.07 < rel_rms < 0.12, rel_rms


@pytest.mark.parametrize("scale_2", [2.0 ** -7, 0.375, 1.0])
def test_nvfp4_exact_representable_roundtrip(scale_2):
    g = _gen(3)
    N, K = 16, 64
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    codes[:, ::16] = torch.where(torch.rand(N, K // 16, generator=g) < 0.5, 7, 15).to(torch.uint8)  # a +-6 per block
    # random positive normal E4M3 block scales
    S = torch.exp2(torch.randint(-6, 8, (N, K // 16), generator=g).float()) * (1 + torch.randint(0, 8, (N, K // 16), generator=g) / 8)
    S = S.to(torch.float8_e4m3fn)
    assert torch.all(S.float() > 0)
    x = (E2M1_VALUES[codes.long()].reshape(N, K // 16, 16) * S.float().unsqueeze(-1) * scale_2).reshape(N, K)
    packed, S2, s2 = quantize_nvfp4(x, scale_2=scale_2)
    assert s2.item() == scale_2
    assert torch.equal(S2.view(torch.uint8), S.view(torch.uint8))
    assert torch.equal(packed, pack_fp4(codes))
    assert torch.equal(dequantize_nvfp4(packed, S2, s2), x)


def test_nvfp4_block_scale_byte():
    x = torch.zeros(2, 32)
    x[0, :16] = torch.linspace(-0.3, 0.2, 16)  # amax 0.3
    x[0, 16:] = torch.linspace(-1.0, 1.7, 16)  # amax 1.7
    x[1, 5] = 0.01
    x[1, 20] = -3.7
    scale_2 = 0.0123
    _, S, _ = quantize_nvfp4(x, scale_2=scale_2)
    s2 = torch.tensor(scale_2, dtype=torch.float32)
    for amax, got in zip([0.3, 1.7, 0.01, 3.7], S.flatten()):
        want = (torch.tensor(amax, dtype=torch.float32) / (6 * s2)).to(torch.float8_e4m3fn)
        assert got.view(torch.uint8).item() == want.view(torch.uint8).item()
    # default scale_2 (= 3.7/2688): the block holding the global amax gets scale 448
    _, S, s2 = quantize_nvfp4(x)
    assert S[1, 1].float().item() == 448.0
    assert s2.item() == pytest.approx(3.7 / 2688, rel=1e-6)


def test_nvfp4_block_scale_saturates():
    x = torch.full((1, 16), 1000.0)
    packed, S, _ = quantize_nvfp4(x, scale_2=0.01)  # ideal scale 16667 > 448
    assert S.float().item() == 448.0
    assert torch.all(dequantize_nvfp4(packed, S, 0.01) == 6 * 448 * 0.01)


def test_nvfp4_zero_block_and_zero_tensor():
    x = torch.randn(4, 48, generator=_gen(5))
    x[1, 16:32] = 0
    packed, S, s2 = quantize_nvfp4(x)
    assert S[1, 1].float().item() == 0.0
    xd = dequantize_nvfp4(packed, S, s2)
    assert torch.all(torch.isfinite(xd)) and torch.all(xd[1, 16:32] == 0)

    z = torch.zeros(3, 2, 32, dtype=torch.bfloat16)
    packed, S, s2 = quantize_nvfp4(z)
    assert torch.isfinite(s2) and s2.item() > 0
    zd = dequantize_nvfp4(packed, S, s2)
    assert torch.all(torch.isfinite(zd)) and torch.all(zd == 0)
    # given scale_2 and a zero tensor as well
    packed, S, s2 = quantize_nvfp4(z, scale_2=0.5)
    assert torch.all(dequantize_nvfp4(packed, S, s2) == 0)


def test_nvfp4_given_scale_2_kv_cache():
    # KV-cache use: [tokens, heads, D] with a per-layer k_scale (formats.md 3.1)
    k = torch.randn(7, 4, 128, generator=_gen(6)) * 3
    k_scale = torch.tensor(0.02)
    packed, S, s2 = quantize_nvfp4(k, scale_2=k_scale)
    assert s2.item() == pytest.approx(0.02) and packed.shape == (7, 4, 64) and S.shape == (7, 4, 8)
    amax_j = k.reshape(7, 4, 8, 16).abs().amax(-1)
    assert torch.equal(S.view(torch.uint8), (amax_j / (6 * k_scale)).to(torch.float8_e4m3fn).view(torch.uint8))
    # different from what the default (amax/2688) scale would give
    _, S_def, s2_def = quantize_nvfp4(k)
    assert s2_def.item() != pytest.approx(0.02)
    assert not torch.equal(S.view(torch.uint8), S_def.view(torch.uint8))
    kd = dequantize_nvfp4(packed, S, k_scale)
    assert ((kd - k).norm() / k.norm()).item() < 0.12


def test_nvfp4_compressed_tensors_reciprocal():
    w = torch.randn(32, 64, generator=_gen(7))
    packed, S, s2 = quantize_nvfp4(w)
    g = torch.tensor(1.0 / s2.item(), dtype=torch.float32)  # what llm-compressor would store
    s2_ct = nvfp4_global_from_compressed_tensors(g)
    assert s2_ct.dim() == 0 and s2_ct.dtype == torch.float32
    assert s2_ct.item() == pytest.approx(s2.item(), rel=1e-6)
    # formats.md 1.6: w = E2M1(q) * weight_scale / weight_global_scale
    ct = E2M1_VALUES[unpack_fp4(packed).long()].reshape(32, 4, 16) * S.float().unsqueeze(-1) / g
    torch.testing.assert_close(dequantize_nvfp4(packed, S, s2_ct), ct.reshape(32, 64), rtol=1e-6, atol=0)
    assert nvfp4_global_from_compressed_tensors(4.0).item() == 0.25


def test_nvfp4_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4(torch.zeros(4, 24))
    with pytest.raises(ValueError):
        dequantize_nvfp4(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 3, dtype=torch.float8_e4m3fn), 1.0)


# ----------------------------------------------------------------------------------------------- MXFP8
def test_e8m0_decode():
    b = torch.tensor([127, 128, 0, 1, 126, 254, 255], dtype=torch.uint8)
    v = e8m0_to_float(b)
    assert v.dtype == torch.float32
    assert v[:6].tolist() == [1.0, 2.0, 2.0 ** -127, 2.0 ** -126, 0.5, 2.0 ** 127]
    assert torch.isnan(v[6])


@pytest.mark.parametrize("amax,b", [
    (448.0, 127), (449.0, 128), (1.0, 119),   # 1/448 -> log2 = -8.8 -> ceil -8 -> scale 2^-8
    (896.0, 128), (897.0, 129), (224.0, 126), (0.0, 127), (1e30, 218),
])
def test_mxfp8_exponent_rule(amax, b):
    x = torch.zeros(2, 64)
    x[1, 40] = -amax
    x[1, 33] = amax / 3
    q, s = quantize_mxfp8(x)
    assert s.dtype == torch.uint8 and s.shape == (2, 2)
    assert s[1, 1].item() == b
    assert s[0, 0].item() == 127 and s[1, 0].item() == 127  # all-zero blocks
    xd = dequantize_mxfp8(q, s)
    assert torch.all(torch.isfinite(xd))
    assert torch.all(xd[:, :32] == 0)
    if amax > 0:  # amax <= 448 * scale: the block max is never clipped by more than E4M3 rounding
        assert abs(xd[1, 40].item() + amax) <= amax * 2 ** -4


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mxfp8_roundtrip_error(shape, dtype):
    x = (torch.randn(shape, generator=_gen(11)) * torch.exp2(torch.randint(-20, 20, shape[:-1], generator=_gen(12)).float()).unsqueeze(-1)).to(dtype)
    q, s = quantize_mxfp8(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and s.shape == (*shape[:-1], shape[-1] // MX_BLOCK)
    xf = x.float()
    xd = dequantize_mxfp8(q, s)
    scale = e8m0_to_float(s).repeat_interleave(MX_BLOCK, dim=-1)
    # block max fits without clipping: amax / scale in (224, 448]
    amax = xf.reshape(*shape[:-1], -1, MX_BLOCK).abs().amax(-1)
    r = amax / e8m0_to_float(s)
    assert torch.all((r > 224) & (r <= 448))
    err = (xd - xf).abs()
    normal = xf.abs() / scale >= 2 ** -6
    assert torch.all(err[normal] <= xf.abs()[normal] * 2 ** -4)
    assert torch.all(err[~normal] <= scale[~normal] * 2 ** -10)
    rel_rms = ((xd - xf).norm() / xf.norm()).item()  # measured ~2.6 %
    assert rel_rms < 0.035, rel_rms


def test_mxfp8_bad_shape():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp8(torch.zeros(2, 48))


# ----------------------------------------------------------------------------------------------- FP8 per tensor
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_roundtrip(dtype):
    x = torch.randn(64, 96, generator=_gen(13)).to(dtype) * 5
    q, s = quantize_fp8(x)
    xf = x.float()
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.dim() == 0
    assert s.item() == pytest.approx(xf.abs().max().item() / FP8_MAX, rel=1e-6)
    xd = dequantize_fp8(q, s)
    err = (xd - xf).abs()
    normal = xf.abs() / s >= 2 ** -6
    assert torch.all(err[normal] <= xf.abs()[normal] * 2 ** -4 * (1 + 1e-6))
    assert torch.all(err[~normal] <= s * 2 ** -10 * (1 + 1e-6))
    assert dequantize_fp8(q, s, torch.bfloat16).dtype == torch.bfloat16
    assert ((xd - xf).norm() / xf.norm()).item() < 0.035


def test_fp8_saturation_and_given_scale():
    x = torch.tensor([0.0, 1.0, -3.0, 1000.0, -1e9, 447.0])
    q, s = quantize_fp8(x, scale=0.5)
    assert s.item() == 0.5
    assert q.float().tolist() == [0.0, 2.0, -6.0, 448.0, -448.0, 448.0]
    assert dequantize_fp8(q, 0.5).tolist() == [0.0, 1.0, -3.0, 224.0, -224.0, 224.0]
    z, sz = quantize_fp8(torch.zeros(8))
    assert sz.item() > 0 and torch.all(dequantize_fp8(z, sz) == 0)
