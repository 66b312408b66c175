"""The paged kernels on the GPU at M3 shapes (64 q heads, 4 KV heads, D=128, index 4x128, B=128, top-16),
compiled for real (not the interpreter), against the torch references on the same device."""
import pytest
import torch

from m3serve.kernels.dispatch import tuned
from m3serve.kernels.indexer import indexer_decode, indexer_decode_ref, indexer_prefill, indexer_prefill_ref
from m3serve.kernels.kv_insert import kv_insert, kv_insert_ref
from m3serve.kernels.msa_attention import msa_decode, msa_decode_ref, msa_prefill, msa_prefill_ref
from m3serve.kernels.platform import interpreting
from m3serve.kernels.qkv_insert import QKVLayout
from support.paged import (KV_DTYPES, build, chunk_positions, clone_cache, layer_cache, rel_err,
                           run_attention_scenario)
from support.qkv import check_qkv_insert

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(interpreting(), reason="TRITON_INTERPRET is set: these test compiled kernels")]

H_Q, H_KV, D, DI, B, TOPK = 64, 4, 128, 128, 128, 16
SEQ_LENS = [128 * 40 + 17, 300, 128 * 16, 1, 128 * 23 + 100]
CHUNKS = [200, 300, 64, 1, 130]
DEV = "cuda"


def _bytes(t):
    return None if t is None else (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)


@pytest.fixture(scope="module", params=KV_DTYPES)
def setup(request):
    g = torch.Generator().manual_seed(1234)
    st = build(SEQ_LENS, H_KV, D, B, request.param, request.param, DI, gen=g, device=DEV)
    return request.param, st, g


def _same_sets(got, ref, max_bad_frac=0.01):
    """Equal sets of block ids; allow a tiny fraction of near-tie swaps (fp32 accumulation order)."""
    bad = (got.sort(-1).values != ref.sort(-1).values).any(-1)
    assert bad.float().mean().item() <= max_bad_frac, bad.float().mean().item()


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_kv_insert_bit_exact_gpu(kv_dtype):
    g = torch.Generator().manual_seed(7)
    P, T = 40, 3000
    cache = layer_cache(kv_dtype, P, H_KV, B, D, kv_dtype, DI, (0.01, 0.003, 0.02), DEV)
    mag = torch.exp2(torch.randint(-12, 8, (T, 1, 1), generator=g).float())
    k = (torch.randn(T, H_KV, D, generator=g) * mag).to(DEV, torch.bfloat16)
    v = (torch.randn(T, H_KV, D, generator=g) * mag).to(DEV, torch.bfloat16)
    ik = (torch.randn(T, DI, generator=g) * mag[:, 0]).to(DEV, torch.bfloat16)
    slots = torch.randperm(P * B, generator=g)[:T].to(DEV)
    ref, got = clone_cache(cache), clone_cache(cache)
    kv_insert_ref(k, v, slots, ref, ik)
    kv_insert(k, v, slots, got, ik)
    torch.cuda.synchronize()
    for r, o in zip(ref.tensors(), got.tensors(), strict=True):
        assert torch.equal(_bytes(r), _bytes(o))


def test_indexer_decode_gpu(setup):
    kv_dtype, st, g = setup
    iq = torch.randn(len(SEQ_LENS), H_KV, DI, generator=g).to(DEV, torch.bfloat16)
    ref = indexer_decode_ref(iq, st.cache, st.bt, st.seq_lens, TOPK)
    got = indexer_decode(iq, st.cache, st.bt, st.seq_lens, TOPK)
    _same_sets(got, ref, 0.0)
    assert ((got[0] >= 0).sum(-1) == TOPK).all()  # 41 blocks -> 16 kept


def test_indexer_prefill_gpu(setup):
    kv_dtype, st, g = setup
    qsl, pos = chunk_positions(SEQ_LENS, CHUNKS)
    iq = torch.randn(qsl[-1], H_KV, DI, generator=g).to(DEV, torch.bfloat16)
    pos = pos.to(DEV)
    ref = indexer_prefill_ref(iq, st.cache, st.bt, qsl, pos, TOPK)
    got = indexer_prefill(iq, st.cache, st.bt, qsl, pos, TOPK)
    _same_sets(got, ref)


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_msa_decode_gpu(setup, mode):
    kv_dtype, st, g = setup
    S = len(SEQ_LENS)
    q = torch.randn(S, H_Q, D, generator=g).to(DEV, torch.bfloat16)
    bids = None
    if mode == "sparse":
        iq = torch.randn(S, H_KV, DI, generator=g).to(DEV, torch.bfloat16)
        bids = indexer_decode_ref(iq, st.cache, st.bt, st.seq_lens, TOPK)
    ref = msa_decode_ref(q, st.cache, st.bt, st.seq_lens, D ** -0.5, bids)
    for splits, words in ((None, None), (1, None), (5, None), (None, True), (None, False)):
        out = torch.full_like(q, float("nan"))
        with tuned(decode_splits=splits, decode_words=words):
            msa_decode(q, st.cache, st.bt, st.seq_lens, D ** -0.5, bids, out=out)
        assert rel_err(out, ref) < 1e-2, (splits, words, rel_err(out, ref))


@pytest.mark.parametrize("plain_from", [None, 128])
@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_msa_prefill_gpu(setup, mode, plain_from):
    """The kernel's prefill == the reference; with `Tuning.prefill_plain_from`, the 200-, 300- and 130-token chunks
    of NVFP4 / FP8 caches over an fp16 copy of their pages."""
    kv_dtype, st, g = setup
    qsl, pos = chunk_positions(SEQ_LENS, CHUNKS)
    pos = pos.to(DEV)
    T = qsl[-1]
    q = torch.randn(T, H_Q, D, generator=g).to(DEV, torch.bfloat16)
    bids = None
    if mode == "sparse":
        iq = torch.randn(T, H_KV, DI, generator=g).to(DEV, torch.bfloat16)
        bids = indexer_prefill_ref(iq, st.cache, st.bt, qsl, pos, TOPK)
    ref = msa_prefill_ref(q, st.cache, st.bt, qsl, pos, D ** -0.5, bids)
    out = torch.full_like(q, float("nan"))
    with tuned(prefill_plain_from=plain_from):
        msa_prefill(q, st.cache, st.bt, qsl, pos, D ** -0.5, bids, out=out, seq_lens_cpu=SEQ_LENS)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("shape", [(8192, 6144), (3, 6144), (64, 16, 128)])
def test_rms_norm_gpu(shape):
    """The one-launch RMSNorm at the geometry's widths, and the model's norm taking it under `Tuning.fused_norm`."""
    from m3serve.kernels.rms_norm import rms_norm, rms_norm_ref
    from m3serve.model.m3 import RMSNorm
    g = torch.Generator(device=DEV).manual_seed(4)
    x = torch.randn(shape, generator=g, device=DEV).to(torch.bfloat16) * 3
    norm = RMSNorm(shape[-1], 1e-6).to(DEV)
    norm.weight.normal_(0, 0.1, generator=g)
    want = rms_norm_ref(x, norm.weight, 1e-6)
    assert torch.allclose(rms_norm(x, norm.weight, 1e-6).float(), want.float(), rtol=8e-3, atol=8e-3)
    with tuned(fused_norm=True):
        assert torch.allclose(norm(x).float(), want.float(), rtol=8e-3, atol=8e-3)


def test_msa_prefill_sdpa_gpu(setup):
    """`Tuning.prefill_sdpa_from`: the dense rows of the 200-, 300- and 130-token chunks through torch's SDPA (the
    CUDA backends, lower-right causal, GQA 16), the rest through the kernel; the same chunks as the kernel test."""
    kv_dtype, st, g = setup
    qsl, pos = chunk_positions(SEQ_LENS, CHUNKS)
    pos = pos.to(DEV)
    q = torch.randn(qsl[-1], H_Q, D, generator=g).to(DEV, torch.bfloat16)
    from m3serve.kernels.msa_attention import sdpa_fused_ok
    assert sdpa_fused_ok(q, H_KV)  # flash / memory-efficient SDPA takes lower-right causal GQA here
    ref = msa_prefill_ref(q, st.cache, st.bt, qsl, pos, D ** -0.5, None)
    out = torch.full_like(q, float("nan"))
    with tuned(prefill_sdpa_from=128):
        msa_prefill(q, st.cache, st.bt, qsl, pos, D ** -0.5, None, out=out, seq_lens_cpu=SEQ_LENS)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("kv_dtype,index_dtype", [("nvfp4", "nvfp4"), ("fp8", "fp8"), ("bfloat16", "bfloat16")])
def test_triton_attention_gpu(kv_dtype, index_dtype):
    steps = [{0: 1500, 1: 700}, {0: 900, 1: 1, 2: 300}, {0: 1, 1: 1, 2: 1}, {0: 1, 1: 1, 2: 1}]
    run_attention_scenario(kv_dtype, index_dtype, device=DEV, h_q=H_Q, h_kv=H_KV, d=D, di=DI, b=B, topk=TOPK,
                           steps=steps)


def test_nvfp4_inline_ptx_decoder_selfcheck():
    """The CUDA fast NVFP4 decoder (inline PTX) decodes exactly like the portable one on this GPU."""
    from m3serve.kernels.codecs import nvfp4_asm_ok
    assert nvfp4_asm_ok(torch.device(DEV))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("head_dim", [32, 64])
def test_msa_decode_small_head_dims_gpu(kv_dtype, head_dim):
    """Head dims below M3's 128 (the tiny model's 32): every decoder choice compiled for real. The nvfp4
    joined-word tile once gave errors of order 1 here (D // 8 < 16); now it falls back to the byte path."""
    g = torch.Generator().manual_seed(5)
    st = build([150, 20, 90], 2, head_dim, 16, kv_dtype, kv_dtype, 32, gen=g, device=DEV)
    q = torch.randn(3, 4, head_dim, generator=g).float().to(DEV)
    iq = torch.randn(3, 2, 32, generator=g).to(DEV, torch.bfloat16)
    bids = indexer_decode_ref(iq, st.cache, st.bt, st.seq_lens, 4)
    for b in (bids, None):
        ref = msa_decode_ref(q, st.cache, st.bt, st.seq_lens, head_dim ** -0.5, b)
        for words in (None, False, True):
            with tuned(decode_words=words):
                out = msa_decode(q, st.cache, st.bt, st.seq_lens, head_dim ** -0.5, b)
            assert rel_err(out, ref) < 1e-2, (b is None, words, rel_err(out, ref))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("layout", [QKVLayout(H_Q, H_KV, D, 64, H_KV, DI), QKVLayout(H_Q, H_KV, D, 64),
                                    QKVLayout(H_Q // 4, H_KV // 4, D, 64, H_KV // 4, DI)],
                         ids=["sparse", "full", "sparse-tp4"])
def test_qkv_insert_gpu(kv_dtype, layout):
    for seed in (1, 2):  # fresh inputs each check
        check_qkv_insert(layout, kv_dtype, kv_dtype, 700 + seed, seed=seed, device=DEV)
