"""Paged indexer: refs vs the dense `indexer_topk_ref`, Triton (interpreter) vs the paged refs."""
import pytest
import torch

from m3serve.kernels.cache import gather_part_ref
from m3serve.kernels.dispatch import tuned
from m3serve.kernels.indexer import (indexer_block_scores, indexer_decode, indexer_decode_ref, indexer_prefill,
                                     indexer_prefill_ref, indexer_topk_ref)
from m3serve.model.kv_codec import KVCodec
from support.paged import KV_DTYPES, build, chunk_positions

B, H, DI, TOPK = 16, 4, 32, 4
SEQ_LENS = [150, 7, 97, 33]  # 10, 1, 7, 3 blocks: top-4 drops blocks on the long ones


def _setup(index_dtype, seed, seq_lens=SEQ_LENS):
    g = torch.Generator().manual_seed(seed)
    st = build(seq_lens, 1, 16, B, "bfloat16", index_dtype, DI, gen=g)
    return st, g


def _dense_block_scores(iq, keys, qpos):
    """[T, H, n_blocks] reference block scores (before the local boost) from dequantized dense keys."""
    L = keys.shape[0]
    nb = -(-L // B)
    s = torch.einsum("thd,kd->thk", iq.double(), keys.double())
    s = s.masked_fill(torch.arange(L)[None, None, :] > qpos[:, None, None], float("-inf"))
    s = torch.nn.functional.pad(s, (0, nb * B - L), value=float("-inf"))
    return s.view(*s.shape[:2], nb, B).amax(-1)


def _assert_same_selection(got, ref, scores, tol):
    """Equal sets of block ids per (token, head); a swap is allowed only between near-equal scores."""
    gs, rs = got.sort(-1).values, ref.sort(-1).values
    bad = (gs != rs).any(-1)
    for t, h in bad.nonzero().tolist():
        a = set(gs[t, h].tolist()) - {-1}
        b = set(rs[t, h].tolist()) - {-1}
        assert len(a) == len(b), (t, h, a, b)
        sa = sorted(float(scores[t, h, i]) for i in a ^ b)
        assert sa[-1] - sa[0] <= tol * max(1.0, abs(sa[0])), (t, h, a, b, sa)


@pytest.mark.parametrize("index_dtype", KV_DTYPES)
def test_paged_refs_equal_dense_ref(index_dtype):
    st, g = _setup(index_dtype, 11)
    codec = KVCodec(index_dtype, st.cache.index_scale)
    iq = torch.randn(len(SEQ_LENS), H, DI, generator=g).to(torch.bfloat16)
    got = indexer_decode_ref(iq, st.cache, st.bt, st.seq_lens, TOPK)
    for s, n in enumerate(SEQ_LENS):
        keys = codec.roundtrip(st.ik_dense[s].float())
        assert torch.equal(gather_part_ref(st.cache, "index", st.bt[s], n), keys)
        want = indexer_topk_ref(iq[s:s + 1], keys, torch.tensor([n - 1]), B, TOPK)[:, 0]
        assert torch.equal(got[s], want)
    qsl, pos = chunk_positions(SEQ_LENS, [20, 7, 1, 16])
    iq = torch.randn(qsl[-1], H, DI, generator=g).to(torch.bfloat16)
    got = indexer_prefill_ref(iq, st.cache, st.bt, qsl, pos, TOPK)
    for s, n in enumerate(SEQ_LENS):
        keys = codec.roundtrip(st.ik_dense[s].float())
        a, b = qsl[s], qsl[s + 1]
        want = indexer_topk_ref(iq[a:b], keys, pos[a:b], B, TOPK).permute(1, 0, 2)
        assert torch.equal(got[a:b], want)


@pytest.mark.parametrize("index_dtype", KV_DTYPES)
def test_indexer_decode_kernel(index_dtype):
    st, g = _setup(index_dtype, 21)
    S = len(SEQ_LENS)
    iq = torch.randn(S, H, DI, generator=g).to(torch.bfloat16)
    nb = st.bt.shape[1]
    poisoned = torch.full((S, H, nb), float("nan"))
    with tuned(index_chunks=3):
        scores = indexer_block_scores(iq, st.cache, st.bt, seq_lens=st.seq_lens, out=poisoned)
    dense = []
    for s, n in enumerate(SEQ_LENS):
        keys = gather_part_ref(st.cache, "index", st.bt[s], n)
        ref = _dense_block_scores(iq[s:s + 1], keys, torch.tensor([n - 1]))[0]  # [H, nb_s]
        k = ref.shape[-1]
        got = scores[s, :, :k]
        own = (n - 1) // B
        assert torch.isinf(got[:, own]).all() and (got[:, own] > 0).all()
        mask = torch.arange(k) != own
        torch.testing.assert_close(got[:, mask].double(), ref[:, mask], rtol=2e-3, atol=2e-3)
        dense.append(torch.nn.functional.pad(ref, (0, nb - k), value=float("-inf")))
    dense = torch.stack(dense)
    ref_ids = indexer_decode_ref(iq, st.cache, st.bt, st.seq_lens, TOPK)
    got_ids = indexer_decode(iq, st.cache, st.bt, st.seq_lens, TOPK)
    assert got_ids.dtype == torch.int32 and got_ids.shape == (S, H, TOPK)
    _assert_same_selection(got_ids, ref_ids, dense, tol=5e-3)
    # contexts long enough that top-k drops blocks; short ones are -1 padded
    assert ((got_ids[0] >= 0).sum(-1) == TOPK).all() and -(-SEQ_LENS[0] // B) > TOPK
    assert ((got_ids[1] >= 0).sum(-1) == 1).all() and (got_ids[1, :, 1:] == -1).all()
    assert (got_ids[0] == (SEQ_LENS[0] - 1) // B).any(-1).all()  # the local block is always chosen


@pytest.mark.parametrize("index_dtype", KV_DTYPES)
def test_indexer_prefill_kernel(index_dtype):
    st, g = _setup(index_dtype, 31)
    qsl, pos = chunk_positions(SEQ_LENS, [21, 7, 1, 16])  # chunk starts mid-block, whole-sequence, single token
    T = qsl[-1]
    iq = torch.randn(T, H, DI, generator=g).to(torch.bfloat16)
    ref_ids = indexer_prefill_ref(iq, st.cache, st.bt, qsl, pos, TOPK)
    with tuned(index_chunks=2):
        got_ids = indexer_prefill(iq, st.cache, st.bt, qsl, pos, TOPK)
    nb = st.bt.shape[1]
    dense = torch.full((T, H, nb), float("-inf"), dtype=torch.float64)
    for s, n in enumerate(SEQ_LENS):
        a, b = qsl[s], qsl[s + 1]
        keys = gather_part_ref(st.cache, "index", st.bt[s], n)
        d = _dense_block_scores(iq[a:b], keys, pos[a:b])
        dense[a:b, :, :d.shape[-1]] = d
    _assert_same_selection(got_ids, ref_ids, dense, tol=5e-3)
    assert ((got_ids[:qsl[1]] >= 0).sum(-1) == TOPK).all()


def test_topk_kernel_matches_torch_topk():
    from m3serve.kernels.indexer import select_topk_blocks, select_topk_blocks_ref
    g = torch.Generator().manual_seed(5)
    for nb, k in ((37, 4), (3, 4), (64, 16)):
        sc = torch.randn(5, 3, nb, generator=g)
        sc[0, 0, :] = float("-inf")
        sc[1, :, nb // 2:] = float("-inf")
        sc[2, 1, nb - 1] = float("inf")
        bt = torch.randperm(5 * nb, generator=g)[:5 * nb].view(5, nb).int()
        ids, pages = select_topk_blocks(sc, k, bt)
        ref = select_topk_blocks_ref(sc, k)
        assert torch.equal(ids, ref)  # distinct random scores: same order too
        want = torch.where(ref >= 0, bt.long().gather(1, ref.clamp(min=0).long().flatten(1)).view_as(ref), -1)
        assert torch.equal(pages.long(), want)
        assert torch.equal(select_topk_blocks(sc, k), ref)
