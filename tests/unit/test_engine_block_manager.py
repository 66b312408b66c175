"""Block manager (ref counts, prefix hashes, LRU reuse of cached free pages) and a storm of random
adds / aborts / preemptions on a tiny pool that must leave no page behind."""
import random

import numpy as np
import pytest

from m3serve.engine.block_manager import BlockManager
from m3serve.engine.sampling_params import SamplingParams
from m3serve.engine.sequence import PageTable, Sequence

B = 4


def seq(tokens, rid="s"):
    return Sequence(rid, 0, list(tokens), SamplingParams(), 8)


def computed(bm, s):
    s.num_computed_tokens = s.num_tokens
    bm.mark_computed(s)


def test_allocate_free_refcounts():
    bm = BlockManager(8, B)
    a = seq(range(10))
    assert bm.can_allocate(a)
    bm.allocate(a)
    assert len(a.pages) == 3 and bm.num_free_pages == 5
    assert all(bm.pages[p].ref_count == 1 for p in a.pages)
    a.token_ids += [10, 11, 12]  # 13 tokens: a 4th page on append
    assert bm.can_append_slot(a)
    bm.append_slot(a)
    assert len(a.pages) == 4
    bm.free(a)
    assert bm.num_free_pages == 8 and all(p.ref_count == 0 for p in bm.pages) and not a.pages


def test_prefix_hits_only_for_computed_full_blocks():
    bm = BlockManager(16, B)
    a = seq(range(10), "a")
    bm.allocate(a)
    b = seq(range(10), "b")
    assert bm._lookup(b) == []  # a's blocks are not computed yet: nothing to share
    a.num_computed_tokens = 6
    bm.mark_computed(a)  # one full computed block
    bm.allocate(b)
    assert b.num_cached_tokens == 4 and b.pages[0] == a.pages[0] and bm.pages[a.pages[0]].ref_count == 2
    computed(bm, a)
    c = seq(list(range(8)) + [99, 98], "c")  # shares two blocks, differs in the third
    bm.allocate(c)
    assert c.num_cached_tokens == 8 and c.pages[:2] == a.pages[:2]
    d = seq(range(8), "d")  # exactly two blocks: the one holding the last token is recomputed
    bm.allocate(d)
    assert d.num_cached_tokens == 4
    for s in (a, b, c, d):
        bm.free(s)
    assert bm.num_free_pages == 16 and all(p.ref_count == 0 for p in bm.pages)
    assert bm.prefix_hit_tokens == 4 + 8 + 4


def test_cached_free_pages_are_reused_lru():
    bm = BlockManager(6, B)
    a = seq(range(9), "a")  # 3 pages, 2 full
    bm.allocate(a)
    computed(bm, a)
    cached_pages = set(a.pages[:2])
    bm.free(a)
    assert len(bm.cached) == 2 and bm.num_free_pages == 6
    # the unhashed page and never-used pages are handed out before cached ones
    x = seq(range(100, 112), "x")  # 3 pages
    bm.allocate(x)
    assert not set(x.pages) & cached_pages
    assert len(bm.cached) == 2
    b = seq(range(9), "b")
    bm.allocate(b)  # both cached blocks still there: a hit taken out of the free list
    assert b.num_cached_tokens == 8
    bm.free(b), bm.free(x)
    y = seq(range(200, 224), "y")  # all 6 pages: the cached ones get evicted
    bm.allocate(y)
    assert len(bm.cached) == 0
    bm.free(y)
    assert bm.num_free_pages == 6 and all(p.ref_count == 0 for p in bm.pages)


def test_can_allocate_counts_free_hits_and_watermark():
    bm = BlockManager(4, B, watermark_pages=1)
    a = seq(range(9), "a")
    bm.allocate(a)
    computed(bm, a)
    bm.free(a)
    big = seq(list(range(8)) + list(range(50, 58)), "big")  # 4 pages, 2 of them cached hits
    assert not bm.can_allocate(big)  # needs all 4 free pages, the watermark keeps one
    assert bm.can_allocate(big, use_watermark=False)
    nocache = BlockManager(4, B, enable_prefix_caching=False)
    nocache.allocate(a2 := seq(range(9)))
    computed(nocache, a2)
    assert not nocache.cached


def test_storm_of_adds_aborts_preemptions(make_engine, eu):
    rng = random.Random(0)
    eng = make_engine(num_gpu_blocks_override=12, max_model_len=192, max_num_batched_tokens=24, max_num_seqs=6)
    shared = eu.random_prompts([48], seed=30)[0]
    live, n_added, n_aborted, finished = set(), 0, 0, 0
    for it in range(400):
        r = rng.random()
        if r < 0.25 and n_added < 80:
            n = rng.randint(1, 100)
            prompt = (shared[:rng.choice([16, 32, 48])] if rng.random() < 0.4 else []) + \
                eu.random_prompts([n], seed=1000 + it)[0]
            sp = SamplingParams(temperature=rng.choice([0.0, 0.8, 1.5]), top_k=rng.choice([0, 5]),
                                max_tokens=rng.randint(1, min(40, 192 - len(prompt))), ignore_eos=rng.random() < 0.5,
                                seed=rng.choice([None, it]))
            rid = f"r{it}"
            eng.add_request(rid, prompt_token_ids=prompt, sampling_params=sp)
            live.add(rid)
            n_added += 1
        elif r < 0.35 and live:
            rid = rng.choice(sorted(live))
            out = eng.abort_request(rid)
            assert out.finish_reason == "abort"
            live.discard(rid)
            n_aborted += 1
        else:
            for o in eng.step():
                if o.finished:
                    live.discard(o.request_id)
                    finished += 1
        eu.check_invariants(eng)
    for rid in sorted(live)[::2]:
        eng.abort_request(rid)
    eu.run_to_completion(eng)
    st = eng.stats()
    assert st["num_preemptions"] > 0 and st["prefix_cache_hit_tokens"] > 0 and n_aborted > 5 and finished > 10
    assert st["num_free_pages"] == st["num_total_pages"] == 12
    assert all(p.ref_count == 0 for p in eng.block_manager.pages)
    assert st["num_running"] == st["num_waiting"] == 0 and not eng.scheduler.requests
    eu.check_invariants(eng)


def test_fcfs_no_starvation(make_engine, eu):
    """A big request at the head of the queue is admitted before the small ones that arrive after it,
    even though they would fit earlier."""
    eng = make_engine(num_gpu_blocks_override=12, max_model_len=192, max_num_batched_tokens=64)
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i, p in enumerate(eu.random_prompts([60, 60], seed=50)):
        eng.add_request(f"busy{i}", prompt_token_ids=p, sampling_params=sp)
    eng.step()
    big = eng.add_request("big", prompt_token_ids=eu.random_prompts([150], seed=51)[0],
                          sampling_params=SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    admitted, small = {}, []
    for step in range(400):
        if step < 30 and step % 2 == 0:
            small.append(eng.add_request(f"s{step}", prompt_token_ids=[1, 2, 3], sampling_params=sp))
        eng.step()
        for s in [big] + small:
            if s.request_id not in admitted and s.num_computed_tokens > 0:
                admitted[s.request_id] = step
        if not eng.has_unfinished_requests():
            break
    assert not eng.has_unfinished_requests()
    assert all(admitted["big"] <= admitted[s.request_id] for s in small)
    assert big.finish_reason == "length"


def test_page_table_reads_like_a_list():
    t = PageTable([5, 6])
    for p in range(7, 40):
        t.append(p)
    assert len(t) == 35 and t[0] == 5 and t[-1] == 39 and t[2:4] == [7, 8] and list(t)[:3] == [5, 6, 7]
    assert list(reversed(t))[:2] == [39, 38] and t == list(range(5, 40)) and t != list(range(5, 39))
    assert t.array.dtype == np.int32 and t.array.tolist() == list(range(5, 40))
    t.truncate(3)
    assert t == [5, 6, 7] and t.array.tolist() == [5, 6, 7] and 3 not in set(t)
    with pytest.raises(IndexError):
        t[3]
    seq = Sequence("s", 0, [1], SamplingParams(), 4)
    seq.pages = [4, 2]
    assert isinstance(seq.pages, PageTable) and seq.pages == [4, 2] and type(seq.pages[1]) is int


def test_trim_reads_the_page_table_only_when_pages_are_left_empty(monkeypatch):
    """A speculative step's rollback (`trim`) runs for every speculating sequence every step: with no lookahead
    page left empty it returns at once, without listing the sequence's pages (O(pages): 13 us per sequence at
    1,024 pages on the dev host); with some, it returns exactly those."""
    bm = BlockManager(40, 4, enable_prefix_caching=False)
    seq = Sequence("a", 0, list(range(10)), SamplingParams(), 20)
    bm.allocate(seq)  # 3 pages for 10 tokens
    calls = []
    orig = PageTable.tolist
    monkeypatch.setattr(PageTable, "tolist", lambda self: calls.append(1) or orig(self))
    bm.trim(seq)
    assert calls == [] and len(seq.pages) == 3
    bm.append_slot(seq, 5)  # lookahead to position 15: a 4th page
    assert len(seq.pages) == 4 and bm.num_free_pages == 36
    bm.trim(seq)  # no token reached it: returned
    assert calls and len(seq.pages) == 3 and bm.num_free_pages == 37
