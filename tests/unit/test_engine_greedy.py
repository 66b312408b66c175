"""Batched greedy decoding equals each sequence's standalone greedy decoding (the model over a
ContiguousCache, one sequence at a time), whatever the arrival order, chunk size, batch mix,
preemptions and prefix-cache hits. Each test asserts that the situation it is about really happened.
Prompts longer than top-k x block (64 tokens on the tiny model) make the MSA block selection matter."""
import pytest

from m3serve.config import ConfigError
from m3serve.engine.sampling_params import SamplingParams

LENGTHS = [3, 17, 70, 100, 33, 130]
GEN = 12


def greedy(n=GEN, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def check_against_reference(res, prompts, gens, reference_greedy):
    for i, (p, n) in enumerate(zip(prompts, gens)):
        toks, reason, _ = res[f"r{i}"]
        assert toks == reference_greedy(p, n), f"request r{i} (prompt of {len(p)} tokens) diverged"
        assert reason == "length"


@pytest.mark.parametrize("budget", [7, 48, 8192])
@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_batched_equals_standalone(make_engine, reference_greedy, eu, budget, order):
    prompts = eu.random_prompts(LENGTHS, seed=1)
    eng = make_engine(max_num_batched_tokens=budget)
    idx = list(range(len(prompts)))[:: 1 if order == "forward" else -1]
    for i in idx:
        eng.add_request(f"r{i}", prompt_token_ids=prompts[i], sampling_params=greedy())
    res = eu.run_to_completion(eng)
    check_against_reference(res, prompts, [GEN] * len(prompts), reference_greedy)
    st = eng.stats()
    assert st["max_running"] == (len(prompts) if budget > sum(LENGTHS) else st["max_running"]) >= 3
    if budget < max(LENGTHS):
        assert st["num_chunked_prefills"] > 0 and st["num_mixed_steps"] > 0
    kinds = st["steps_by_kind"]  # steps by kind: a mixed step is "decode+prefill"; no draft, no speculative step
    assert kinds["decode+prefill"] == st["num_mixed_steps"] and kinds["prefill"] >= 1 and kinds["decode"] >= 1
    assert kinds["speculative"] == kinds["speculative+prefill"] == 0 and sum(kinds.values()) == st["num_steps"]
    assert st["num_prompt_steps"] == kinds["prefill"] + kinds["decode+prefill"]  # steps that carried prompt tokens
    assert st["num_free_pages"] == st["num_total_pages"]
    eu.check_invariants(eng)


def test_staggered_arrivals_join_and_leave(make_engine, reference_greedy, eu):
    """Requests join the running batch every few steps and leave at different times."""
    prompts = eu.random_prompts([90, 5, 66, 40, 120, 12], seed=2)
    gens = [20, 4, 15, 9, 6, 25]
    eng = make_engine(max_num_batched_tokens=40)
    res, pending, step = {}, list(range(len(prompts))), 0
    joined_while_running = 0
    while pending or eng.has_unfinished_requests():
        if pending and step % 3 == 0:
            i = pending.pop(0)
            joined_while_running += eng.stats()["num_running"] > 0
            eng.add_request(f"r{i}", prompt_token_ids=prompts[i], sampling_params=greedy(gens[i]))
        for o in eng.step():
            toks, _, outs = res.setdefault(o.request_id, ([], None, []))
            res[o.request_id] = (toks + o.new_token_ids, o.finish_reason, outs + [o])
        step += 1
        eu.check_invariants(eng)
    check_against_reference(res, prompts, gens, reference_greedy)
    assert joined_while_running >= 4 and eng.stats()["num_mixed_steps"] > 0


def test_preemption_by_recompute(make_engine, reference_greedy, eu):
    """A pool of 16 pages cannot hold these sequences at once: the newest are preempted and recomputed."""
    prompts = eu.random_prompts([70, 100, 33, 130, 20], seed=3)
    gens = [24] * len(prompts)
    for caching in (True, False):
        eng = make_engine(num_gpu_blocks_override=16, max_model_len=256, max_num_batched_tokens=64,
                          enable_prefix_caching=caching)
        seqs = [eng.add_request(f"r{i}", prompt_token_ids=p, sampling_params=greedy(gens[i]))
                for i, p in enumerate(prompts)]
        res = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                toks, _, outs = res.setdefault(o.request_id, ([], None, []))
                res[o.request_id] = (toks + o.new_token_ids, o.finish_reason, outs)
            eu.check_invariants(eng)
        check_against_reference(res, prompts, gens, reference_greedy)
        st = eng.stats()
        assert st["num_preemptions"] > 0 and seqs[0].num_preemptions == 0  # victims are the newest
        assert sum(s.num_preemptions for s in seqs) == st["num_preemptions"]
        assert st["num_free_pages"] == st["num_total_pages"] == 16
        assert all(p.ref_count == 0 for p in eng.block_manager.pages)
        if caching:  # the recompute found its own computed blocks in the prefix cache
            assert st["prefix_cache_hit_tokens"] > 0
        else:
            assert st["prefix_cache_hit_tokens"] == 0


def test_prefix_cache_hits(make_engine, reference_greedy, eu):
    base = eu.random_prompts([80], seed=4)[0]
    tails = eu.random_prompts([1, 7, 30, 16], seed=5)
    prompts = [base + t for t in tails] + [base, base + tails[2]]  # the last one is a duplicate
    eng = make_engine(max_num_batched_tokens=64)
    eng.add_request("r0", prompt_token_ids=prompts[0], sampling_params=greedy())
    first = eu.run_to_completion(eng)
    assert eng.stats()["prefix_cache_hit_tokens"] == 0
    for i in range(1, len(prompts)):
        eng.add_request(f"r{i}", prompt_token_ids=prompts[i], sampling_params=greedy())
    res = {**first, **eu.run_to_completion(eng)}
    check_against_reference(res, prompts, [GEN] * len(prompts), reference_greedy)
    cached = {rid: r[2][0].num_cached_tokens for rid, r in res.items()}
    assert cached["r0"] == 0
    assert all(cached[f"r{i}"] >= 64 for i in range(1, len(prompts))), cached
    assert cached["r4"] == 64  # == base: the block holding the last prompt token is always recomputed
    st = eng.stats()
    assert st["prefix_cache_hit_tokens"] == sum(cached.values())
    assert st["num_free_pages"] == st["num_total_pages"]
    eu.check_invariants(eng)


def test_everything_at_once(make_engine, reference_greedy, eu):
    """Shared prefixes + tiny chunks + a tiny pool + staggered arrivals, in one run."""
    base = eu.random_prompts([70], seed=6)[0]
    prompts = [base + t for t in eu.random_prompts([3, 20, 45], seed=7)] + eu.random_prompts([110, 9], seed=8)
    gens = [18, 10, 22, 14, 30]
    eng = make_engine(num_gpu_blocks_override=12, max_model_len=160, max_num_batched_tokens=13)
    res, step = {}, 0
    order = [0, 3, 1, 4, 2]
    while order or eng.has_unfinished_requests():
        if order and step % 2 == 0:
            i = order.pop(0)
            eng.add_request(f"r{i}", prompt_token_ids=prompts[i], sampling_params=greedy(gens[i]))
        for o in eng.step():
            toks, _, outs = res.setdefault(o.request_id, ([], None, []))
            res[o.request_id] = (toks + o.new_token_ids, o.finish_reason, outs)
        eu.check_invariants(eng)
        step += 1
    check_against_reference(res, prompts, gens, reference_greedy)
    st = eng.stats()
    assert st["num_preemptions"] > 0 and st["prefix_cache_hit_tokens"] > 0
    assert st["num_chunked_prefills"] > 0 and st["num_mixed_steps"] > 0
    assert st["num_free_pages"] == st["num_total_pages"]


def test_block_size_must_be_the_msa_block(make_engine):
    with pytest.raises(ConfigError, match="block_size.*index_block_size"):
        make_engine(block_size=32)
    make_engine(block_size=16)  # the tiny model's index_block_size


def test_pool_too_small_for_max_model_len(make_engine):
    with pytest.raises(ConfigError, match="max_model_len"):
        make_engine(num_gpu_blocks_override=4, max_model_len=512)
