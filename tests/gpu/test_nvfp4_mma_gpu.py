"""The NVFP4 mma.sync kernels (kernels/nvfp4_mma.py: index scan and decode attention, Gluon, sm_89/sm_90) at M3
shapes against the torch references and the portable kernels, on fresh random caches, outputs poisoned first.
Both decoders (hardware convert, integer ops) and every launch variant the benchmark times are checked."""
import pytest
import torch

from m3serve.kernels import dispatch, platform
from m3serve.kernels.codecs import MODE_CVT, MODE_INT
from m3serve.kernels.dispatch import tuned
from m3serve.kernels.indexer import indexer_block_scores, indexer_decode, indexer_decode_ref
from m3serve.kernels.msa_attention import msa_decode, msa_decode_ref
from m3serve.kernels.platform import interpreting
from support.paged import build, rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(interpreting(), reason="TRITON_INTERPRET is set: these test compiled kernels")]

DEV = "cuda"
D, B, TOPK = 128, 128, 16
SEQ_LENS = [128 * 40 + 17, 300, 128 * 16, 1, 128 * 23 + 100, 128 * 90 + 64]


def _need_mma():
    if not platform.nvfp4_mma_ok(torch.device(DEV)):
        pytest.skip("no sm_89 / sm_90 GPU: the mma.sync NVFP4 kernels are not used here")


@pytest.fixture(scope="module", params=[(64, 4), (16, 1)], ids=["m3", "m3-tp4"])
def setup(request):
    _need_mma()
    h_q, h_kv = request.param
    g = torch.Generator().manual_seed(4321 + h_q)
    st = build(SEQ_LENS, h_kv, D, B, "nvfp4", "nvfp4", D, gen=g, device=DEV)
    return h_q, h_kv, st, g


@pytest.mark.parametrize("mode", [MODE_CVT, MODE_INT])
@pytest.mark.parametrize("unroll", [1, 3])
def test_index_scan_matches_portable_and_reference(setup, mode, unroll):
    h_q, h_kv, st, g = setup
    for _ in range(2):  # fresh queries each check
        iq = torch.randn(len(SEQ_LENS), h_kv, D, generator=g).to(DEV, torch.bfloat16)
        args = (iq, st.cache, st.bt)
        assert dispatch.use_mma_index_scan(iq, st.cache)
        nb = st.bt.shape[1]
        for chunks in (None, 1, 7):
            out = torch.full((iq.shape[0], h_kv, nb), float("nan"), device=DEV)
            with tuned(index_chunks=chunks, index_mma_mode=mode, index_mma_unroll=unroll):
                got = indexer_block_scores(*args, seq_lens=st.seq_lens, out=out)
            with tuned(index_chunks=chunks, mma=False):
                ref = indexer_block_scores(*args, seq_lens=st.seq_lens)
            n_blk = (st.seq_lens.long() + B - 1) // B
            scored = torch.arange(nb, device=DEV)[None, :] < n_blk[:, None]  # [S, nb]
            assert not torch.isnan(got[scored[:, None, :].expand_as(got)]).any()
            fin = torch.isfinite(ref) & scored[:, None, :]
            assert torch.equal(torch.isinf(got) & scored[:, None, :], torch.isinf(ref) & scored[:, None, :])
            # both fp32 accumulations of exact fp16 products; q rounded to fp16 alike
            assert torch.allclose(got[fin], ref[fin], rtol=1e-4, atol=1e-4 * ref[fin].abs().max().item())
        with tuned(index_mma_mode=mode, index_mma_unroll=unroll):
            ids = indexer_decode(iq, st.cache, st.bt, st.seq_lens, TOPK)
        ref_ids = indexer_decode_ref(iq, st.cache, st.bt, st.seq_lens, TOPK)
        assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)


@pytest.mark.parametrize("kmode", [MODE_CVT, MODE_INT])
@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_decode_attention_matches_reference(setup, kmode, sparse):
    h_q, h_kv, st, g = setup
    S = len(SEQ_LENS)
    for _ in range(2):
        q = torch.randn(S, h_q, D, generator=g).to(DEV, torch.bfloat16)
        assert dispatch.use_mma_decode_attention(q, st.cache)
        bids = None
        if sparse:
            iq = torch.randn(S, h_kv, D, generator=g).to(DEV, torch.bfloat16)
            bids = indexer_decode_ref(iq, st.cache, st.bt, st.seq_lens, TOPK)
        ref = msa_decode_ref(q, st.cache, st.bt, st.seq_lens, D ** -0.5, bids)
        with tuned(mma=False):
            portable = msa_decode(q, st.cache, st.bt, st.seq_lens, D ** -0.5, bids)
        for splits in (None, 1, 3):
            out = torch.full_like(q, float("nan"))
            with tuned(decode_splits=splits, decode_mma_kmode=kmode):
                msa_decode(q, st.cache, st.bt, st.seq_lens, D ** -0.5, bids, out=out)
            err = rel_err(out, ref)
            assert err < 1e-2, (splits, err)
            assert err < 2 * rel_err(portable, ref) + 1e-3, (splits, err, rel_err(portable, ref))


def test_shapes_outside_the_fast_path_use_the_portable_kernels():
    _need_mma()
    g = torch.Generator().manual_seed(9)
    st = build([300, 40], 2, 64, 16, "nvfp4", "nvfp4", 32, gen=g, device=DEV)  # tiny-model shapes
    iq = torch.randn(2, 2, 32, generator=g).to(DEV, torch.bfloat16)
    q = torch.randn(2, 4, 64, generator=g).to(DEV, torch.bfloat16)
    assert not dispatch.use_mma_index_scan(iq, st.cache)
    assert not dispatch.use_mma_decode_attention(q, st.cache)
    ids = indexer_decode(iq, st.cache, st.bt, st.seq_lens, 4)
    ref = indexer_decode_ref(iq, st.cache, st.bt, st.seq_lens, 4)
    assert torch.equal(ids.sort(-1).values, ref.sort(-1).values)


def test_engine_uses_the_mma_kernels_and_matches_the_reference(tmp_path):
    """A small model with M3's attention shapes (16 query heads per KV head, D = 128, index D = 128, 128-token
    blocks, top-16), an NVFP4 cache, prompts past 16 blocks: the engine's decode steps run the mma.sync kernels,
    shadowed at every layer by the torch reference on the same cache (tests/support/shadow.py)."""
    _need_mma()
    from support.shadow import shadow_of

    from m3serve import LLM, SamplingParams
    from m3serve.config import FULL, SPARSE
    from m3serve.model.layers.triton_attention import TritonAttention
    from m3serve.model.checkpoint_writer import write_checkpoint
    from m3serve.model.tiny import make_tiny, random_state, tiny_config

    tiny = make_tiny(str(tmp_path))  # tokenizer + a checkpoint, replaced by the M3-shaped one below
    cfg = tiny_config(tiny.vocab_size, tiny.bos_token_id, tiny.eos_token_id[0], hidden_size=128,
                      num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=1, head_dim=128,
                      layer_types=[FULL, SPARSE], mlp_layer_types=["dense", "dense"], index_n_heads=1,
                      index_head_dim=128, index_block_size=128, index_topk_blocks=16, max_position_embeddings=8192)
    for f in tmp_path.glob("*.safetensors*"):
        f.unlink()
    write_checkpoint(str(tmp_path), cfg, random_state(cfg, 3), dtype=torch.bfloat16)
    llm = LLM(model=str(tmp_path), device="cuda", dtype="float32", kv_cache_dtype="nvfp4", max_model_len=4096,
              num_gpu_blocks_override=64, enforce_eager=True)  # the shadow backend checks on the host
    runner = llm.engine.executor.worker.runner
    assert all(isinstance(b, TritonAttention) for b in runner.attention)
    cache = runner.cache
    lc = cache.layers[1]
    assert dispatch.use_mma_index_scan(torch.zeros(1, 1, 128, device=DEV), lc)
    assert dispatch.use_mma_decode_attention(torch.zeros(1, 16, 128, device=DEV), lc)
    shadow = shadow_of(runner, tol=0.05)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, tiny.vocab_size - 1, (n,), generator=g).tolist() for n in (2300, 2600, 700)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert all(len(o.token_ids) == 8 for o in outs)
    print(f"{shadow.calls} layer calls, {shadow.tokens} token rows, {shadow.flips} near-tie flips, "
          f"max error {shadow.max_err:.3g}")
    assert shadow.calls >= 2 * 8 and shadow.flips <= shadow.tokens // 100
