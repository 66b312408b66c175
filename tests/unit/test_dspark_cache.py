"""The draft's paged context cache (design/dspark.md section 5, test 7): incremental inserts through the
target's pages give the same block as a recompute from all committed features; a partial rejection
leaves exactly the accepted rows; block rows never leak; FP8 storage with per-layer scales."""
import pytest
import torch

from m3serve.executor.speculative.draft_cache import DraftKVCache, commit_slots
from m3serve.executor.speculative.proposer import insert_context, propose
from m3serve.model.dspark import block_mask

BS, POOL, K = 16, 24, 7


class PagedSeqs:
    """S sequences over a shared pool of pages (interleaved, random), with their committed features."""

    def __init__(self, draft, num_seqs, gen, pages_per_seq=5):
        self.draft, self.gen = draft, gen
        self.tables = torch.randperm(POOL, generator=gen)[:num_seqs * pages_per_seq].view(num_seqs, -1).int()
        self.feats = [torch.zeros(0, draft.config.num_taps * draft.config.hidden_size) for _ in range(num_seqs)]

    def slots(self, seq, positions):
        return self.tables[seq, positions // BS].long() * BS + positions % BS

    def new_features(self, n):
        return torch.randn(n, self.draft.config.num_taps * self.draft.config.hidden_size, generator=self.gen)

    @property
    def lengths(self):
        return torch.tensor([f.shape[0] for f in self.feats])

    def reference_hidden(self, anchors):
        """Block hidden states from a recompute over each sequence's committed features (no cache)."""
        out = []
        for s, f in enumerate(self.feats):
            rows = self.draft.context_kv(f, torch.arange(f.shape[0]))
            out.append(self.draft.block_hidden(anchors[s:s + 1], self.lengths[s:s + 1],
                                               lambda layer: (rows[layer][0][None], rows[layer][1][None])))
        return torch.cat(out)


def _garbage(cache, gen):
    """Fill every page with junk rows, as pages freed by other sequences would hold."""
    for t in cache.k + cache.v:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))


def test_incremental_inserts_equal_recompute_across_partial_rejections(tiny_draft):
    draft = tiny_draft[0]
    gen = torch.Generator().manual_seed(0)
    seqs = PagedSeqs(draft, 3, gen)
    cache = DraftKVCache.for_draft(draft.config, POOL, BS, "float32")
    _garbage(cache, gen)
    for s, n in enumerate((5, 23, 40)):  # prefill
        f = seqs.new_features(n)
        insert_context(draft, cache, f, torch.arange(n), seqs.slots(s, torch.arange(n)))
        seqs.feats[s] = f
    for cycle in range(4):
        # verify rows t..t+K of every sequence arrive together; n accepted -> rows 0..n are committed
        t = seqs.lengths
        num_accepted = torch.randint(0, K + 1, (3,), generator=gen)
        rows = [seqs.new_features(K + 1) for _ in range(3)]
        positions = t[:, None] + torch.arange(K + 1)[None]
        slots = torch.stack([seqs.slots(s, positions[s]) for s in range(3)])
        insert_context(draft, cache, torch.cat(rows), positions.flatten(), commit_slots(slots, num_accepted).flatten())
        for s in range(3):
            seqs.feats[s] = torch.cat([seqs.feats[s], rows[s][:int(num_accepted[s]) + 1]])
        anchors = torch.randint(0, 500, (3,), generator=gen)
        got = draft.block_hidden(anchors, seqs.lengths, cache.context_fn(seqs.tables))
        assert torch.allclose(got, seqs.reference_hidden(anchors), atol=1e-4), cycle


def test_partial_rejection_leaves_exactly_the_accepted_rows(tiny_draft):
    draft = tiny_draft[0]
    gen = torch.Generator().manual_seed(1)
    seqs = PagedSeqs(draft, 2, gen)
    a, b = (DraftKVCache.for_draft(draft.config, POOL, BS, "bfloat16") for _ in range(2))
    t, n = torch.tensor([9, 30]), torch.tensor([2, 0])
    feats = seqs.new_features(2 * (K + 1))
    positions = (t[:, None] + torch.arange(K + 1)[None]).flatten()
    slots = torch.cat([seqs.slots(s, positions[s * (K + 1):(s + 1) * (K + 1)]) for s in range(2)])
    insert_context(draft, a, feats, positions, commit_slots(slots.view(2, -1), n).flatten())
    keep = torch.cat([torch.arange(int(n[s]) + 1) + s * (K + 1) for s in range(2)])
    insert_context(draft, b, feats[keep], positions[keep], slots[keep])
    for layer in range(draft.config.num_hidden_layers):
        assert torch.equal(a.k[layer][:POOL], b.k[layer][:POOL]) and torch.equal(a.v[layer][:POOL], b.v[layer][:POOL])
    assert int((b.k[0][:POOL] != 0).any(-1).sum()) == int(n.sum() + 2) * draft.config.num_key_value_heads


def test_propose_writes_nothing_and_repeats_exactly(tiny_draft):
    """Block rows are transient: a proposer step leaves the cache bit-identical, and drafting the same
    block again gives the same block."""
    draft = tiny_draft[0]
    gen = torch.Generator().manual_seed(2)
    seqs = PagedSeqs(draft, 2, gen)
    cache = DraftKVCache.for_draft(draft.config, POOL, BS, "fp8")
    for s, n in enumerate((17, 33)):
        insert_context(draft, cache, seqs.new_features(n), torch.arange(n), seqs.slots(s, torch.arange(n)))
    before = [t.clone() for t in cache.k + cache.v]
    anchors, t = torch.tensor([3, 4]), torch.tensor([17, 33])
    u = torch.rand(2, K, generator=gen)
    first = propose(draft, cache, anchors, t, seqs.tables, K, "probabilistic", None, u)
    assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(before, cache.k + cache.v))
    again = propose(draft, cache, anchors, t, seqs.tables, K, "probabilistic", None, u)
    assert torch.equal(first.tokens, again.tokens) and torch.equal(first.probs, again.probs)
    fewer = propose(draft, cache, anchors, t, seqs.tables, 3, "probabilistic", None, u[:, :3])
    assert torch.equal(fewer.tokens, first.tokens[:, :3])  # K < gamma: the first K of the same block
    with pytest.raises(ValueError, match="block_size"):
        propose(draft, cache, anchors, t, seqs.tables, K + 1, "greedy")


def test_fp8_storage_scales_and_scratch_page():
    cache = DraftKVCache(2, 4, BS, 2, 8, "fp8", scales={1: (2.0, 0.5)})
    ref = DraftKVCache(2, 4, BS, 2, 8, "float32")
    assert cache.k[0].dtype == torch.float8_e4m3fn and cache.nbytes * 4 == ref.nbytes
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(3, 2, 8, generator=gen), torch.randn(3, 2, 8, generator=gen)
    slots = torch.tensor([0, 17, 63])
    cache.write(1, slots, k, v)
    assert torch.allclose(cache.k[1][slots // BS, :, slots % BS].float() * 2.0, k, rtol=0.07, atol=0.01)
    assert torch.allclose(cache.v[1][slots // BS, :, slots % BS].float() * 0.5, v, rtol=0.07, atol=0.01)
    gk, gv = cache.gather(1, torch.tensor([[1, 3], [0, 2]]))
    assert torch.allclose(gk[0, 1], k[1], rtol=0.07, atol=0.02)
    assert torch.allclose(gk[0, 31], k[2], rtol=0.07, atol=0.02)
    assert torch.allclose(gv[1, 0], v[0], rtol=0.07, atol=0.02)
    before = [t[:4].clone() for t in cache.k + cache.v]
    cache.write(0, torch.tensor([-1, -1]), k[:2], v[:2])  # dropped rows land on the scratch page only
    assert all(torch.equal(x.view(torch.uint8), y[:4].view(torch.uint8)) for x, y in zip(before, cache.k + cache.v))


def test_commit_slots():
    slots = torch.arange(12).view(3, 4)
    assert commit_slots(slots, torch.tensor([0, 3, 1])).tolist() == [[0, -1, -1, -1], [4, 5, 6, 7], [8, 9, -1, -1]]


def test_block_mask_full_window_and_causal():
    full = block_mask(torch.tensor([2, 4]), 5, 3, None, False)
    assert full.shape == (2, 3, 8)
    assert full[0, :, :5].tolist() == [[True, True, False, False, False]] * 3 and bool(full[:, :, 5:].all())
    win = block_mask(torch.tensor([4]), 5, 3, 2, True)
    assert win[0, 0].tolist() == [False, False, True, True, False, True, False, False]
    assert win[0, 2, 5:].tolist() == [True, True, True]
