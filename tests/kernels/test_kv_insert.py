"""kv_insert (Triton, interpreter) vs kv_insert_ref: bit-exact bytes; in-kernel codecs vs torch."""
import pytest
import torch
import triton
import triton.language as tl

from m3serve.kernels import fp8, nvfp4
from m3serve.kernels.cache import gather_part_ref
from m3serve.kernels.codecs import e4m3_bits_to_f32, f32_to_e4m3_bits, nvfp4_tile_f16
from m3serve.kernels.kv_insert import kv_insert, kv_insert_ref
from m3serve.model.kv_codec import KVCodec
from support.paged import KV_DTYPES, clone_cache, layer_cache, page_tables, slots_of


@triton.jit
def _codec_kernel(x_ptr, bits_ptr, back_ptr, lo_ptr, hi_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    bits = f32_to_e4m3_bits(tl.load(x_ptr + i))
    tl.store(bits_ptr + i, bits)
    tl.store(back_ptr + i, e4m3_bits_to_f32(bits))
    # every byte (two E2M1 codes) through the byte decoder, block scale 1: values E2M1 * 2^-7
    r = tl.arange(0, 16)
    c = tl.arange(0, 16)
    byte = (r[:, None] * 16 + c[None, :]).to(tl.uint8)
    lo, hi = nvfp4_tile_f16(byte, tl.full((16, 2), 1.0, tl.float32), 16, 16)
    tl.store(lo_ptr + r[:, None] * 16 + c[None, :], lo.to(tl.float32))
    tl.store(hi_ptr + r[:, None] * 16 + c[None, :], hi.to(tl.float32))


def test_e4m3_codec_matches_torch():
    codes = torch.arange(256, dtype=torch.uint8)
    vals = codes.view(torch.float8_e4m3fn).float()
    finite = vals[~torch.isnan(vals)]
    # every representable value, every midpoint between neighbours (ties), random values in all ranges
    pos = finite[finite >= 0].unique()
    mids = (pos[1:] + pos[:-1]) / 2
    g = torch.Generator().manual_seed(1)
    rnd = torch.exp2(torch.rand(4000, generator=g) * 22 - 13) * (torch.rand(4000, generator=g) + 0.5)
    x = torch.cat([finite, mids, -mids, rnd.clamp(max=448), -rnd.clamp(max=448),
                   torch.tensor([0.0, -0.0, 448.0, 2.0**-10, 2.0**-9 * 0.5, 2.0**-9 * 1.5])])
    n = triton.next_power_of_2(x.numel())
    x = torch.nn.functional.pad(x, (0, n - x.numel()))
    bits = torch.empty(n, dtype=torch.uint8)
    back = torch.empty(n)
    lo, hi = torch.empty(256), torch.empty(256)
    _codec_kernel[(1,)](x, bits, back, lo, hi, N=n)
    ref = x.to(torch.float8_e4m3fn)
    assert torch.equal(bits, ref.view(torch.uint8))
    assert torch.equal(back, ref.float())
    byte = torch.arange(256)
    assert torch.equal(lo * 128, nvfp4.E2M1_VALUES[byte & 15]) and torch.equal(hi * 128, nvfp4.E2M1_VALUES[byte >> 4])


def _bytes(t):
    return None if t is None else (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("index_dtype", [None, "nvfp4", "fp8", "bfloat16"])
def test_kv_insert_bit_exact(kv_dtype, index_dtype):
    g = torch.Generator().manual_seed(hash((kv_dtype, index_dtype)) % 1000)
    P, H, B, D, DI, T = 7, 2, 16, 64, 32, 24
    k_scale, v_scale, i_scale = 0.01, 0.0031, 0.5
    cache = layer_cache(kv_dtype, P, H, B, D, index_dtype, DI, (k_scale, v_scale, i_scale))
    # magnitudes from tiny (subnormal / zero e4m3 block scales) to saturating, bf16 and fp32 inputs
    mag = torch.exp2(torch.randint(-14, 10, (24, 1, 1), generator=g).float())
    k = (torch.randn(T, H, D, generator=g) * mag).to(torch.bfloat16)
    v = torch.randn(T, H, D, generator=g) * mag
    v[0, 0, :16] = 0.0  # an all-zero block: scale 0, codes 0
    ik = (torch.randn(T, DI, generator=g) * mag[:, 0]).to(torch.bfloat16) if index_dtype else None
    slots = torch.randperm(P * B, generator=g)[:T]
    slots[5] = -1  # padding token: skipped
    ref, got = clone_cache(cache), clone_cache(cache)
    kv_insert_ref(k, v, slots, ref, ik)
    kv_insert(k, v, slots, got, ik)
    for r, o in zip(ref.tensors(), got.tensors(), strict=True):
        assert torch.equal(_bytes(r), _bytes(o))
    # the reference wrote exactly the K/V/IK that KVCodec (the engine's torch path) would produce
    sl = slots[1]
    if kv_dtype == "nvfp4":
        p, s, _ = nvfp4.quantize_nvfp4(k[1], k_scale)
        assert torch.equal(ref.k[sl // B, :, sl % B], p) and torch.equal(_bytes(ref.k_scale_blocks[sl // B, :, sl % B]),
                                                                        _bytes(s))
    elif kv_dtype == "fp8":
        assert torch.equal(_bytes(ref.k[sl // B, :, sl % B]), _bytes(fp8.quantize_fp8(k[1], k_scale)[0]))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_gather_pages_roundtrip(kv_dtype):
    """insert through a shuffled page table, gather back == the KVCodec round trip of the dense tensor."""
    g = torch.Generator().manual_seed(3)
    B, H, D, n = 16, 2, 32, 45
    bt, P = page_tables([n, 20], B, gen=g)
    scale = 1.0 if kv_dtype == "bfloat16" else 0.01
    cache = layer_cache(kv_dtype, P, H, B, D, scales=(scale, scale, 1.0))
    k = torch.randn(n, H, D, generator=g).to(torch.bfloat16)
    kv_insert(k, k, slots_of(bt[0], torch.arange(n), B), cache)
    got = gather_part_ref(cache, "k", bt[0], n)
    want = KVCodec(kv_dtype, scale).roundtrip(k.float())
    assert torch.equal(got, want)
