"""The DSpark draft's context attention through the paged kernel (interpreter): `context_partials` against its torch
reference, and the draft's block pass over `PagedContext` pages (kernel partials merged with the block's own rows)
against the gathered-context torch path, for fp32 and FP8 draft caches, contexts from none to several pages."""
import pytest
import torch

from m3serve.executor.speculative.draft_cache import DraftKVCache
from m3serve.executor.speculative.proposer import insert_context
from m3serve.kernels.dispatch import tuned
from m3serve.kernels.msa_attention import context_partials, context_partials_ref
from m3serve.model.dspark import DSparkDraft, SharedTargetParts
from m3serve.model.dspark_tiny import random_dspark_state, tiny_dspark_config
from m3serve.model.m3 import Rotary
from m3serve.model.tiny import tiny_config

BS, POOL = 16, 32
LENS = [0, 5, 16, 37, 70]  # no context, part of a page, a full page, several pages
TOL = {"float32": 2e-4, "fp8": 3e-3}  # fp8 pages: fp16 dot operands in the kernel


def _paged(cache_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    cache = DraftKVCache(1, POOL, BS, 2, 32, cache_dtype, scales={0: (0.5, 2.0)})
    tables = torch.randperm(POOL, generator=g)[:len(LENS) * 5].view(len(LENS), 5).to(torch.int32)
    for s, n in enumerate(LENS):
        pos = torch.arange(n)
        slots = tables[s, pos // BS].long() * BS + pos % BS
        cache.write(0, slots, torch.randn(n, 2, 32, generator=g), torch.randn(n, 2, 32, generator=g))
    return cache, tables, g


@pytest.mark.parametrize("cache_dtype", ["float32", "fp8"])
def test_context_partials_match_the_reference(cache_dtype):
    cache, tables, g = _paged(cache_dtype, 1)
    pages = cache.paged_fn(tables)(0).cache
    q = torch.randn(len(LENS), 2 * 3, 32, generator=g)  # 3 query heads per KV head
    lens = torch.tensor(LENS)
    with tuned(decode_splits=3):
        op, lse = context_partials(q, pages, tables, lens, 32 ** -0.5)
    rop, rlse = context_partials_ref(q, pages, tables, lens, 32 ** -0.5)
    w = torch.exp2(lse - lse.amax(-1, keepdim=True).clamp_min(-1e30)).nan_to_num(0.0)
    merged = (op * w[..., None]).sum(2) / w.sum(-1).clamp_min(1e-30)[..., None]
    total = torch.log2(torch.exp2(lse - lse.amax(-1, keepdim=True)).sum(-1)) + lse.amax(-1)
    assert op.shape[2] > 1  # several splits: the merge is exercised
    tol = TOL[cache_dtype]
    assert torch.allclose(merged[1:], rop[1:, :, 0], atol=tol, rtol=tol)
    assert torch.allclose(total[1:], rlse[1:, :, 0], atol=tol)
    assert bool((lse[0] == float("-inf")).all()) and bool((rlse[0] == float("-inf")).all())  # no context


@pytest.mark.parametrize("cache_dtype", ["float32", "fp8"])
def test_block_pass_over_pages_equals_the_gathered_context(cache_dtype):
    g = torch.Generator().manual_seed(2)
    cfg = tiny_dspark_config(tiny_config(512, 1, 2), num_hidden_layers=2)
    shared = SharedTargetParts(torch.nn.Embedding(512, cfg.hidden_size), torch.nn.Linear(cfg.hidden_size, 512, False))
    draft = DSparkDraft(cfg, shared)
    state = random_dspark_state(cfg)
    draft.load_state_dict({k: state[k] for k in draft.state_dict()})
    draft.rotary.inv_freq.copy_(Rotary(cfg.rotary_dim, cfg.rope_theta).inv_freq)
    cache = DraftKVCache.for_draft(cfg, POOL, BS, cache_dtype)
    tables = torch.randperm(POOL, generator=g)[:len(LENS) * 5].view(len(LENS), 5).to(torch.int32)
    for s, n in enumerate(LENS):
        pos = torch.arange(n)
        feats = torch.randn(n, cfg.num_taps * cfg.hidden_size, generator=g)
        insert_context(draft, cache, feats, pos, tables[s, pos // BS].long() * BS + pos % BS)
    anchors, t = torch.randint(0, 400, (len(LENS),), generator=g), torch.tensor(LENS)
    want = draft.block_hidden(anchors, t, cache.context_fn(tables))
    with tuned(decode_splits=2):
        got = draft.block_hidden(anchors, t, cache.paged_fn(tables))
    assert torch.allclose(got, want, atol=TOL[cache_dtype], rtol=TOL[cache_dtype]), (got - want).abs().max()
