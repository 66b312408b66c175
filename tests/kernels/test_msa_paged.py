"""Paged MSA attention: refs vs the dense `msa_attention_ref`, Triton (interpreter) vs the paged refs."""
import pytest
import torch

from m3serve.kernels.cache import gather_part_ref
from m3serve.kernels.dispatch import tuned
from m3serve.kernels.indexer import indexer_decode_ref, indexer_prefill_ref
from m3serve.kernels.msa_attention import msa_attention_ref, msa_decode, msa_decode_ref, msa_prefill, msa_prefill_ref
from m3serve.model.kv_codec import KVCodec
from support.paged import KV_DTYPES, build, chunk_positions, rel_err

B, H_KV, G, D, DI, TOPK = 16, 2, 4, 64, 32, 4
SEQ_LENS = [150, 7, 97, 33]
TOL = {"bfloat16": 1e-2, "fp8": 1e-2, "nvfp4": 1e-2}  # output bf16 + fp16/bf16 dot operands


def _setup(kv_dtype, seed, seq_lens=SEQ_LENS):
    g = torch.Generator().manual_seed(seed)
    return build(seq_lens, H_KV, D, B, kv_dtype, "bfloat16", DI, gen=g), g


def _decode_block_ids(st, g):
    iq = torch.randn(len(st.seq_lens), H_KV, DI, generator=g).to(torch.bfloat16)
    return indexer_decode_ref(iq, st.cache, st.bt, st.seq_lens, TOPK)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_paged_refs_equal_dense_ref(kv_dtype):
    st, g = _setup(kv_dtype, 5)
    codec = KVCodec(kv_dtype, st.cache.k_scale)
    S = len(SEQ_LENS)
    q = torch.randn(S, H_KV * G, D, generator=g).to(torch.bfloat16)
    bids = _decode_block_ids(st, g)
    got = msa_decode_ref(q, st.cache, st.bt, st.seq_lens, D ** -0.5, bids)
    for s, n in enumerate(SEQ_LENS):
        k, v = codec.roundtrip(st.k_dense[s].float()), codec.roundtrip(st.v_dense[s].float())
        assert torch.equal(gather_part_ref(st.cache, "k", st.bt[s], n), k)
        want = msa_attention_ref(q[s:s + 1], k, v, torch.tensor([n - 1]), D ** -0.5, bids[s][:, None], B)
        assert torch.equal(got[s:s + 1], want)
    qsl, pos = chunk_positions(SEQ_LENS, [20, 7, 1, 16])
    q = torch.randn(qsl[-1], H_KV * G, D, generator=g).to(torch.bfloat16)
    got = msa_prefill_ref(q, st.cache, st.bt, qsl, pos, D ** -0.5, None)
    for s, n in enumerate(SEQ_LENS):
        k, v = codec.roundtrip(st.k_dense[s].float()), codec.roundtrip(st.v_dense[s].float())
        a, b = qsl[s], qsl[s + 1]
        assert torch.equal(got[a:b], msa_attention_ref(q[a:b], k, v, pos[a:b], D ** -0.5, None, B))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_msa_decode_kernel(kv_dtype, mode):
    st, g = _setup(kv_dtype, 7 + len(mode))
    S = len(SEQ_LENS)
    q = torch.randn(S, H_KV * G, D, generator=g).to(torch.bfloat16)
    bids = _decode_block_ids(st, g) if mode == "sparse" else None
    if bids is not None:  # top-k really drops blocks of the long sequences
        assert ((bids[0] >= 0).sum(-1) == TOPK).all() and -(-SEQ_LENS[0] // B) > TOPK
    ref = msa_decode_ref(q, st.cache, st.bt, st.seq_lens, D ** -0.5, bids)
    for splits in (1, 3):
        out = torch.full_like(q, float("nan"))
        with tuned(decode_splits=splits):
            msa_decode(q, st.cache, st.bt, st.seq_lens, D ** -0.5, bids, out=out)
        assert rel_err(out, ref) < TOL[kv_dtype], (splits, rel_err(out, ref))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_msa_prefill_kernel(kv_dtype, mode):
    st, g = _setup(kv_dtype, 17 + len(mode))
    qsl, pos = chunk_positions(SEQ_LENS, [21, 7, 1, 16])
    T = qsl[-1]
    q = torch.randn(T, H_KV * G, D, generator=g).to(torch.bfloat16)
    bids = None
    if mode == "sparse":
        iq = torch.randn(T, H_KV, DI, generator=g).to(torch.bfloat16)
        bids = indexer_prefill_ref(iq, st.cache, st.bt, qsl, pos, TOPK)
        assert ((bids[:qsl[1]] >= 0).sum(-1) == TOPK).all()
    ref = msa_prefill_ref(q, st.cache, st.bt, qsl, pos, D ** -0.5, bids)
    for walk in ((False, True) if mode == "sparse" else (False,)):  # a scan of the blocks, or the sorted selections
        out = torch.full_like(q, float("nan"))
        with tuned(prefill_sorted_blocks=walk):
            msa_prefill(q, st.cache, st.bt, qsl, pos, D ** -0.5, bids, out=out)
        assert rel_err(out, ref) < TOL[kv_dtype], walk


def test_msa_decode_gqa16_fp32_query():
    """M3's 16 query heads per KV head, an fp32 query, a block size with two tiles per page."""
    g = torch.Generator().manual_seed(9)
    st = build([300, 40], 1, 32, 64, "nvfp4", "bfloat16", DI, gen=g)
    q = torch.randn(2, 16, 32, generator=g)
    iq = torch.randn(2, 1, DI, generator=g).to(torch.bfloat16)
    bids = indexer_decode_ref(iq, st.cache, st.bt, st.seq_lens, 2)
    for b in (bids, None):
        ref = msa_decode_ref(q, st.cache, st.bt, st.seq_lens, 0.2, b)
        with tuned(decode_block_n=32):
            out = msa_decode(q, st.cache, st.bt, st.seq_lens, 0.2, b)
        assert out.dtype == torch.float32 and rel_err(out, ref) < 3e-3


@pytest.mark.parametrize("kv_dtype", ["nvfp4", "fp8"])
def test_msa_decode_word_decoders(kv_dtype):
    """D = 128: nvfp4 K/V and fp8 V decoded from int32 words (8 / 4 codes per word) == the byte path."""
    g = torch.Generator().manual_seed(13)
    st = build([70, 33], 1, 128, 16, kv_dtype, "bfloat16", DI, gen=g)
    q = torch.randn(2, 16, 128, generator=g).to(torch.bfloat16)
    iq = torch.randn(2, 1, DI, generator=g).to(torch.bfloat16)
    bids = indexer_decode_ref(iq, st.cache, st.bt, st.seq_lens, 2)
    for b in (bids, None):
        ref = msa_decode_ref(q, st.cache, st.bt, st.seq_lens, 128 ** -0.5, b)
        for words in ((True, "split", False, None) if kv_dtype == "nvfp4" else (True, False, None)):
            out = torch.full_like(q, float("nan"))
            with tuned(decode_splits=2, decode_words=words):
                msa_decode(q, st.cache, st.bt, st.seq_lens, 128 ** -0.5, b, out=out)
            assert rel_err(out, ref) < 1e-2, (words, rel_err(out, ref))


@pytest.mark.parametrize("kv_dtype", ["nvfp4", "fp8"])
def test_msa_prefill_word_decoders(kv_dtype):
    """D = 128, 16 query heads per KV head: the prefill attention with K / V decoded from int32 words (nvfp4: the
    joined tile and its permuted columns, or 8 sub-tiles; fp8: V in 4 sub-tiles) and with 8- and 1-token tiles (128,
    16 rows) == the reference, sparse and dense-mode."""
    g = torch.Generator().manual_seed(23)
    seq_lens = [70, 33]
    st = build(seq_lens, 1, 128, 16, kv_dtype, "bfloat16", DI, gen=g)
    qsl, pos = chunk_positions(seq_lens, [19, 33])
    T = qsl[-1]
    q = torch.randn(T, 16, 128, generator=g).to(torch.bfloat16)
    iq = torch.randn(T, 1, DI, generator=g).to(torch.bfloat16)
    bids = indexer_prefill_ref(iq, st.cache, st.bt, qsl, pos, 2)
    for b in (bids, None):
        ref = msa_prefill_ref(q, st.cache, st.bt, qsl, pos, 128 ** -0.5, b)
        for words in ((True, "split", False) if kv_dtype == "nvfp4" else (True, False)):
            for block_t in (None, 8, 1):
                out = torch.full_like(q, float("nan"))
                with tuned(prefill_words=words, prefill_block_t=block_t):
                    msa_prefill(q, st.cache, st.bt, qsl, pos, 128 ** -0.5, b, out=out)
                assert rel_err(out, ref) < 1e-2, (words, block_t, rel_err(out, ref))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_dense_prefill_sdpa_beside_the_kernel(kv_dtype, monkeypatch):
    """`Tuning.prefill_sdpa_from`: the full-attention rows of long chunks (130 tokens after 270 of context, a whole
    150-token prompt) run torch's SDPA over their pages dequantized once, the short ones (1 and 16 tokens) the
    kernel, in one call == the reference. The chunk after context is what the causal alignment must get right:
    SDPA's own is_causal (aligned top-left) is wrong there, and the test says so."""
    import torch.nn.attention.bias as bias

    from m3serve.kernels import msa_attention
    seq_lens = [400, 150, 7, 97]
    st, g = _setup(kv_dtype, 31, seq_lens)
    qsl, pos = chunk_positions(seq_lens, [130, 150, 1, 16])
    q = torch.randn(qsl[-1], H_KV * G, D, generator=g).to(torch.bfloat16)
    ref = msa_prefill_ref(q, st.cache, st.bt, qsl, pos, D ** -0.5, None)
    calls = []
    real = msa_attention.dense_prefill_sdpa
    monkeypatch.setattr(msa_attention, "dense_prefill_sdpa", lambda *a: calls.append(a[3]) or real(*a))

    def run():
        out = torch.full_like(q, float("nan"))
        with tuned(prefill_sdpa_from=100):
            msa_prefill(q, st.cache, st.bt, qsl, pos, D ** -0.5, None, out=out, seq_lens_cpu=seq_lens)
        return out

    assert rel_err(run(), ref) < TOL[kv_dtype]
    assert calls == [400, 150]  # the two long chunks, by their lengths after the step
    monkeypatch.setattr(bias, "causal_lower_right", bias.causal_upper_left)
    out = run()
    a, b = qsl[0], qsl[1]
    assert rel_err(out[a:b], ref[a:b]) > 0.1  # the chunk after context, aligned top-left: wrong
    assert rel_err(out[b:], ref[b:]) < TOL[kv_dtype]  # a whole prompt is the same either way


@pytest.mark.parametrize("kv_dtype", ["nvfp4", "fp8"])
def test_prefill_over_plain_pages(kv_dtype, monkeypatch):
    """`Tuning.prefill_plain_from`: the long chunks (130 tokens after 270 of context, a whole 150-token prompt) run
    the kernel over an fp16 copy of their pages, the short ones (1 and 16 tokens) over the quantized pages, in one
    call, sparse and dense-mode: == the reference, and == the kernel over the quantized pages alone (the same fp16
    products). With the SDPA option on too, the dense mode's long chunks take SDPA and copy nothing; past
    PLAIN_PAGES_MAX_BYTES a long chunk keeps the quantized pages."""
    from m3serve.kernels import msa_attention
    seq_lens = [400, 150, 7, 97]
    st, g = _setup(kv_dtype, 37, seq_lens)
    qsl, pos = chunk_positions(seq_lens, [130, 150, 1, 16])
    q = torch.randn(qsl[-1], H_KV * G, D, generator=g).to(torch.bfloat16)
    iq = torch.randn(qsl[-1], H_KV, DI, generator=g).to(torch.bfloat16)
    copied = []
    real = msa_attention.plain_pages
    monkeypatch.setattr(msa_attention, "plain_pages", lambda *a: copied.append(list(a[2])) or real(*a))

    def run(b, **tuning):
        out = torch.full_like(q, float("nan"))
        with tuned(**tuning):
            msa_prefill(q, st.cache, st.bt, qsl, pos, D ** -0.5, b, out=out, seq_lens_cpu=seq_lens)
        return out

    for b in (indexer_prefill_ref(iq, st.cache, st.bt, qsl, pos, TOPK), None):
        ref = msa_prefill_ref(q, st.cache, st.bt, qsl, pos, D ** -0.5, b)
        copied.clear()
        quantized = run(b, prefill_plain_from=None)
        assert copied == []
        plain = run(b, prefill_plain_from=100)
        assert copied == [[0, 1]]
        assert rel_err(plain, ref) < TOL[kv_dtype] and rel_err(plain, quantized) < 2e-3
    copied.clear()
    assert rel_err(run(None, prefill_plain_from=100, prefill_sdpa_from=100), ref) < TOL[kv_dtype]
    assert copied == []
    # a copy of at most the first long chunk's pages (400 tokens, K and V in fp16): the second runs quantized
    from m3serve.kernels import dispatch
    monkeypatch.setattr(dispatch, "PLAIN_PAGES_MAX_BYTES", 400 * 4 * H_KV * D + 1)
    assert rel_err(run(None, prefill_plain_from=100), ref) < TOL[kv_dtype]
    assert copied == [[0]]


@pytest.mark.parametrize("kv_dtype", ["nvfp4", "fp8"])
def test_plain_pages_exact(kv_dtype):
    """`plain_pages`: the pages of the sequences named, decoded by the kernel == the torch dequantization (per-layer
    scale 1) bit for bit, behind block tables that keep each sequence's logical blocks."""
    from m3serve.kernels.cache import cache_part, dequant_pages_ref
    from m3serve.kernels.msa_attention import plain_pages
    seq_lens = [40, 7, 33]
    st, _ = _setup(kv_dtype, 41, seq_lens)
    k, v, tables = plain_pages(st.cache, st.bt, [0, 2], seq_lens)
    assert tables[1].eq(0).all()
    for part, got in (("k", k), ("v", v)):
        data, blocks, _ = cache_part(st.cache, part)
        for s in (0, 2):
            n = -(-seq_lens[s] // B)
            pages = st.bt[s, :n].long()
            want = dequant_pages_ref(data[pages], None if blocks is None else blocks[pages], 1.0, torch.float16)
            assert torch.equal(got[tables[s, :n].long()], want)
