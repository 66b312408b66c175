"""DSpark speculative decoding inside the engine (in-flight batching), on the tiny model and its tiny draft.

The tiny draft is random, so on its own it is almost never right; most tests put `ControlledProposals` in front
of it (the real draft still runs; with probability p per position its token is replaced by the target's known
continuation, and the verifier is handed the true mixture distribution), so accepted runs, partial rejections and
full acceptance all happen. Each test asserts that the situation it is about happened."""
import json
import os

import pytest
import torch

from m3serve.config import ConfigError, EngineConfig
from m3serve.engine.sampling_params import SamplingParams
from m3serve.engine.scheduler import STEP_KINDS
from m3serve.executor.speculative import verify as verify_mod
from m3serve.executor.speculative.controlled import ControlledProposals
from m3serve.executor.speculative.probs import draw, sampling_probs
from m3serve.step_io import SamplingInput
from m3serve.executor.speculative import decoder as decoder_mod
from m3serve.executor.sampler import Sampler
from m3serve.model.dspark_taps import TapRecorder
from m3serve.model.dspark_tiny import make_tiny_dspark
from support.reference import ReferenceRunner
from support.stats import chi_square_p

K = 4


def dspark(k=K, **kw):
    return {"method": "dspark", "num_speculative_tokens": k, **kw}


def greedy(n, seed, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, seed=seed, **kw)


def control(eng, sequences, p):
    """Put ControlledProposals (known continuations by seed) in front of the engine's draft."""
    drafter = eng.executor.worker.drafter
    drafter.proposal_hook = ControlledProposals(sequences, p, drafter.draft.config.vocab_size)


def continuations(prompts, gens, reference_greedy, seed0=1000):
    return {seed0 + i: p + reference_greedy(p, n) for i, (p, n) in enumerate(zip(prompts, gens))}


def check_step_invariants(eng, eu):
    """The block manager's invariants, and no rejected draft counted as computed: a running sequence has at most
    its last token uncomputed-but-scheduled, and never more computed tokens than accepted ones."""
    eu.check_invariants(eng)
    for seq in eng.scheduler.running:
        assert seq.num_computed_tokens <= seq.num_tokens - 1, seq
        assert len(seq.block_hashes) <= seq.num_computed_tokens // eng.block_manager.block_size


def check_draft_cache(eng, model):
    """Every computed position of every running sequence has its draft-cache row, equal to the row made from the
    target's tapped features of a standalone forward (rebuilt after recompute, shared through prefix hits)."""
    drafter = eng.executor.worker.drafter
    checked = []
    for seq in eng.scheduler.running:
        c = seq.num_computed_tokens
        if c == 0:
            continue
        with TapRecorder(model, drafter.draft.tap_layers) as taps:
            ReferenceRunner(model).hidden(seq.token_ids[:c])
        rows = drafter.draft.context_kv(taps.take(), torch.arange(c))
        table = torch.tensor([seq.pages.tolist()])
        for layer, (k, v) in enumerate(rows):
            ck, cv = drafter.cache.gather(layer, table)
            assert torch.allclose(ck[0, :c], k, atol=2e-3, rtol=1e-3), (seq, layer)
            assert torch.allclose(cv[0, :c], v, atol=2e-3, rtol=1e-3), (seq, layer)
        checked.append((seq.request_id, seq.num_preemptions))
    return checked


def run(eng, arrivals=None, every=1, on_step=None):
    """Step to completion, adding request i at step arrivals[i] (every `every` steps when None given);
    {request_id: (tokens, finish_reason, outputs)}."""
    pending, res, step = list(arrivals or []), {}, 0
    while pending or eng.has_unfinished_requests():
        while pending and (step % every == 0 or not eng.has_unfinished_requests()):
            rid, prompt, sp = pending.pop(0)
            eng.add_request(rid, prompt_token_ids=prompt, sampling_params=sp)
            if every > 1:
                break
        for o in eng.step():
            toks, _, outs = res.setdefault(o.request_id, ([], None, []))
            res[o.request_id] = (toks + o.new_token_ids, o.finish_reason, outs + [o])
        if on_step is not None:
            on_step(step)
        step += 1
    return res


# ---- rollback in the block manager -----------------------------------------------------------------------------
def test_rollback_returns_lookahead_pages_and_hashes_only_accepted_blocks():
    """Pages of 4 tokens: a 6-token prompt, then a speculative step with 6 drafts (positions 6..12, pages for 13
    tokens); 1 draft accepted + the correction token: the cache holds positions 0..7, the page past the new tokens
    goes back to the free list's head, and only the full blocks of accepted tokens are hashed."""
    from m3serve.engine.block_manager import BlockManager, chain_hash
    from m3serve.engine.scheduler import Scheduler
    from m3serve.engine.sequence import Sequence

    bm = BlockManager(8, 4)
    sch = Scheduler(bm, 4, 64, num_lookahead=lambda seq: 6)
    seq = Sequence("a", 0, [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=20), 20)
    sch.add(seq)
    batch = sch.schedule()
    seq.token_ids.append(7)  # the prefill's sample
    sch.update(batch)
    assert seq.num_computed_tokens == 6 and len(bm.cached) == 1
    batch = sch.schedule()
    assert (batch.num_new_tokens, batch.num_draft_tokens, len(seq.pages)) == ([7], [6], 4)
    assert bm.num_free_pages == 4
    lookahead_page = seq.pages[3]
    seq.token_ids += [8, 9]  # draft 8 accepted, 9 the correction; drafts at positions 8..12 rejected
    sch.update(batch, [5])
    assert seq.num_computed_tokens == 8 and seq.num_uncomputed_tokens == 1
    assert len(seq.pages) == 3 and bm.num_free_pages == 5 and next(iter(bm.free_ids)) == lookahead_page
    h0 = chain_hash(None, (1, 2, 3, 4))
    assert seq.block_hashes == [h0, chain_hash(h0, (5, 6, 7, 8))] and len(bm.cached) == 2
    assert bm.pages[seq.pages[2]].hash is None  # block 2 holds the uncomputed 9 and rejected rows


# ---- greedy: identical tokens ----------------------------------------------------------------------------------
@pytest.mark.parametrize("apart", [True, False], ids=["prefill_apart", "mixed"])
def test_greedy_equals_plain_decoding_with_chunks_preemption_and_prefix_hits(make_engine, reference_greedy,
                                                                             tiny_loaded, eu, apart):
    """Shared prefixes + tiny chunks + a tiny pool + staggered arrivals, drafts right 60% of the time; speculating
    decodes in steps of their own (prefill_apart, the default) or beside prefill chunks."""
    base = eu.random_prompts([70], seed=6)[0]
    prompts = [base + t for t in eu.random_prompts([3, 20, 45], seed=7)] + eu.random_prompts([110, 9], seed=8)
    gens = [18, 10, 22, 14, 30]
    eng = make_engine(num_gpu_blocks_override=12, max_model_len=160, max_num_batched_tokens=13,
                      speculative_config=dspark(prefill_apart=apart))
    control(eng, continuations(prompts, gens, reference_greedy), 0.6)
    order = [0, 3, 1, 4, 2]
    arrivals = [(f"r{i}", prompts[i], greedy(gens[i], 1000 + i)) for i in order]
    checked = []

    def on_step(step):
        check_step_invariants(eng, eu)
        if step % 3 == 0:
            checked.extend(check_draft_cache(eng, tiny_loaded[0]))

    res = run(eng, arrivals, every=2, on_step=on_step)
    for i, (p, n) in enumerate(zip(prompts, gens)):
        toks, reason, outs = res[f"r{i}"]
        assert toks == reference_greedy(p, n), f"request r{i} diverged"
        assert reason == "length"
    st = eng.stats()
    assert st["num_preemptions"] > 0 and st["prefix_cache_hit_tokens"] > 0
    assert st["num_chunked_prefills"] > 0 and (st["num_mixed_steps"] > 0) == (not apart)
    assert 0 < st["spec_decode_num_accepted_tokens"] < st["spec_decode_num_draft_tokens"]
    assert any(len(o.new_token_ids) > 1 for _, _, outs in res.values() for o in outs)  # accepted runs streamed
    assert len(checked) >= 10 and any(n for _, n in checked)  # checked after a recompute rebuilt the rows
    assert st["num_free_pages"] == st["num_total_pages"]


def test_greedy_with_the_real_draft_fp8_cache_and_confidence_threshold(make_engine, reference_greedy, eu):
    """No help for the draft: probabilistic drafts at temperature 0, FP8 draft cache, with and without the static
    confidence threshold; mixed with requests that cannot speculate (penalties, min_tokens) in the same steps."""
    prompts = eu.random_prompts([5, 40, 23, 31], seed=11)
    cfg = dict(draft_sample_method="probabilistic", kv_cache_dtype="fp8")
    engines = [make_engine(max_num_batched_tokens=64, speculative_config=dspark(7, **cfg, confidence_threshold=0.3)),
               make_engine(max_num_batched_tokens=64, speculative_config=dspark(7, **cfg)),
               make_engine(max_num_batched_tokens=64)]
    anchors = []  # (seed, anchor position) of every speculating row
    engines[0].executor.worker.drafter.proposal_hook = lambda prop, ids, pos, seeds: (
        anchors.extend(zip(seeds.tolist(), pos.tolist())), prop)[1]
    sps = [greedy(12, 1), greedy(12, 2, repetition_penalty=1.3), greedy(12, 3, min_tokens=6),
           greedy(12, 4, logprobs=2)]
    outs = []
    for e in engines:
        for i, (p, sp) in enumerate(zip(prompts, sps)):
            e.add_request(f"r{i}", prompt_token_ids=p, sampling_params=sp)
        outs.append(eu.run_to_completion(e))
    got, _, want = outs
    for i in range(4):
        assert got[f"r{i}"][0] == outs[1][f"r{i}"][0] == want[f"r{i}"][0], f"r{i}"
    assert got["r0"][0] == reference_greedy(prompts[0], 12)
    # logprobs of verified tokens equal the plain engine's, one entry per streamed token
    g_lp = [d for o in got["r3"][2] for d in o.logprobs]
    w_lp = [d for o in want["r3"][2] for d in o.logprobs]
    assert len(g_lp) == 12 and all(len(o.logprobs) == len(o.new_token_ids) for o in got["r3"][2])
    for a, b in zip(g_lp, w_lp):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    # the penalised request never speculated; the min_tokens one only from its 6th output on
    seeds = {s for s, _ in anchors}
    assert seeds == {1, 3, 4}
    assert min(pos for s, pos in anchors if s == 3) == len(prompts[2]) + 6 - 1
    st, st_all = engines[0].stats(), engines[1].stats()
    assert st["spec_decode_num_drafts"] == len(anchors) and st["num_free_pages"] == st["num_total_pages"]
    assert st["spec_decode_num_draft_tokens"] < st_all["spec_decode_num_draft_tokens"]  # the threshold cut drafts


def test_draft_backoff_drafts_less_where_drafts_fail_and_changes_no_token(make_engine, reference_greedy, eu):
    """speculative_config.draft_backoff: the tiny random draft is almost never right, so greedy requests back off
    (fewer drafts than without it) and still give the reference's tokens; a sampled request in the same steps never
    backs off (its tokens and its drafts are those of an engine without backoff)."""
    prompts = eu.random_prompts([9, 30, 17], seed=5)
    sps = [greedy(24, 1), greedy(24, 2), SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=3)]
    engines = [make_engine(speculative_config=dspark(4, draft_backoff=2)), make_engine(speculative_config=dspark(4))]
    anchors = [[], []]  # per engine: (seed, anchor position) of every speculating row
    for e, log in zip(engines, anchors):
        e.executor.worker.drafter.proposal_hook = lambda prop, ids, pos, seeds, log=log: (
            log.extend(zip(seeds.tolist(), pos.tolist())), prop)[1]
    outs = []
    for e in engines:
        for i, (p, sp) in enumerate(zip(prompts, sps)):
            e.add_request(f"r{i}", prompt_token_ids=p, sampling_params=sp)
        outs.append(eu.run_to_completion(e))
    backoff, plain = outs
    for i in range(2):
        assert backoff[f"r{i}"][0] == plain[f"r{i}"][0] == reference_greedy(prompts[i], 24), f"r{i}"
    assert backoff["r2"][0] == plain["r2"][0]  # sampled: the same drafts, so the same tokens
    by_seed = [{s: sorted(p for t, p in log if t == s) for s in (1, 2, 3)} for log in anchors]
    assert by_seed[0][3] == by_seed[1][3]
    for s in (1, 2):
        assert 0 < len(by_seed[0][s]) < len(by_seed[1][s]), s  # backed off, and drafted again after it
    st, st_off = engines[0].stats(), engines[1].stats()
    assert st["spec_decode_num_drafts"] < st_off["spec_decode_num_drafts"]
    assert st["num_free_pages"] == st["num_total_pages"]


def test_prefill_apart_keeps_speculating_decodes_out_of_prefill_steps(make_engine, reference_greedy, eu):
    """speculative_config.prefill_apart: with staggered arrivals and small chunks, no step holds both a decode that
    drafts and a prefill chunk (without the option many do); a prefill left by a speculating step runs in the next
    one; the tokens are the reference's, as without the option."""
    prompts = eu.random_prompts([30, 45, 12, 60], seed=21)
    gens = [16, 12, 20, 10]
    outs, batches, turn_logs = [], [], []
    for apart in (True, False):
        eng = make_engine(max_num_batched_tokens=24, speculative_config=dspark(prefill_apart=apart))
        control(eng, continuations(prompts, gens, reference_greedy), 0.6)
        log = []
        schedule = eng.scheduler.schedule

        def logged(schedule=schedule, log=log):
            b = schedule()
            if b:
                log.append(([(k, n) for n, k in zip(b.num_new_tokens, b.num_draft_tokens)], b.kind))
            return b

        eng.scheduler.schedule = logged
        turns = []

        def logged_turn(turn_ahead=eng.scheduler.prefill_turn_ahead, turns=turns):
            b = turn_ahead()
            if b is not None:
                turns.append(b.kind)
            return b

        eng.scheduler.prefill_turn_ahead = logged_turn
        outs.append(run(eng, [(f"r{i}", p, greedy(n, 1000 + i)) for i, (p, n) in enumerate(zip(prompts, gens))],
                        every=3))
        batches.append(log), turn_logs.append(turns)
        st = eng.stats()
        assert st["num_free_pages"] == st["num_total_pages"]
        assert 0 < st["spec_decode_num_accepted_tokens"]
        # the engine's steps by kind: the scheduled batches' kinds, and the steps queued ahead (speculative decodes,
        # and with prefill_apart the prompts' steps after drafting decodes, `prefill_turn_ahead`)
        scheduled = {k: sum(kind == k for _, kind in log) for k in STEP_KINDS}
        assert set(turns) <= {"prefill"} and (len(turns) > 0) == apart
        assert st["steps_by_kind"] == {**scheduled, "prefill": scheduled["prefill"] + len(turns),
                                       "speculative": scheduled["speculative"] + st["num_steps_ahead"] - len(turns)}
        assert sum(st["steps_by_kind"].values()) == st["num_steps"]
        assert all(t >= 0 for t in st["step_seconds_by_kind"].values())
        assert 0 < sum(st["step_seconds_by_kind"].values())
    for i, (p, n) in enumerate(zip(prompts, gens)):
        assert outs[0][f"r{i}"][0] == outs[1][f"r{i}"][0] == reference_greedy(p, n), f"r{i}"

    def mixed(b):  # a drafting decode and a prefill chunk (more than one new token without drafts) in one step
        return any(k for k, _ in b) and any(not k and n > 1 for k, n in b)

    for b, kind in batches[0] + batches[1]:  # the kind names what the batch holds
        assert ("speculative" in kind) == any(k for k, _ in b) and (kind == "speculative+prefill" or not mixed(b))
    apart, together = [[b for b, _ in log] for log in batches]
    assert not any(mixed(b) for b in apart) and sum(mixed(b) for b in together) >= 2
    # a prefill-only step right after a step of drafting decodes, the prefill work that step left: scheduled when
    # that step was back, or queued behind it (`prefill_turn_ahead`, called only after drafting decodes)
    assert turn_logs[0] or any(any(k for k, _ in a) and b and all(not k and n > 1 for k, n in b)
                               for a, b in zip(apart, apart[1:]))


def test_draft_backoff_policy():
    """A step that accepted no draft doubles the plain stretch (N, 2N, 4N, ... at most 16N output tokens); one that
    accepted a draft ends it; sampled requests, steps without drafts and backoff 0 change nothing."""
    from m3serve.engine.sequence import Sequence
    from m3serve.engine.speculative_scheduling import after_speculative_step, num_draft_tokens

    seq = Sequence("a", 0, [1, 2, 3], greedy(100, 1), 100)
    waits = []
    for _ in range(7):
        seq.token_ids.append(5)
        after_speculative_step(seq, 4, 1, 3)
        waits.append(seq.draft_resume_at - seq.num_output_tokens)
        assert num_draft_tokens(seq, 4) == 0 and num_draft_tokens(seq, 4, waits[-1]) == 4
    assert waits == [3, 6, 12, 24, 48, 48, 48]
    after_speculative_step(seq, 4, 2, 3)  # a draft held
    assert (seq.draft_misses, seq.draft_resume_at, num_draft_tokens(seq, 4)) == (0, 0, 4)
    for drafted, backoff, sp in ((0, 3, greedy(100, 1)), (4, 0, greedy(100, 1)),
                                 (4, 3, SamplingParams(temperature=0.8, max_tokens=100, seed=1))):
        other = Sequence("b", 0, [1, 2, 3], sp, 100)
        after_speculative_step(other, drafted, 1, backoff)
        assert (other.draft_misses, other.draft_resume_at) == (0, 0)


# ---- temperature > 0 ------------------------------------------------------------------------------------------
def test_sampled_tokens_do_not_depend_on_batch_chunks_or_preemption(make_engine, reference_greedy, eu):
    """Seeded requests at temperature 0.8 / top-p 0.9, block verification: the same tokens alone in a roomy engine
    and squeezed into a tiny pool with tiny chunks and staggered arrivals (preempted and recomputed)."""
    prompts = eu.random_prompts([70, 100, 33, 20], seed=3)
    gens = [20, 16, 24, 18]
    sps = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=n, ignore_eos=True, seed=1000 + i)
           for i, n in enumerate(gens)]
    cfg = dspark(draft_sample_method="probabilistic", rejection_sample_method="block")
    results, stats = [], []
    for opts, every in ((dict(max_num_batched_tokens=4096), 1),
                        (dict(num_gpu_blocks_override=12, max_model_len=160, max_num_batched_tokens=11), 3)):
        eng = make_engine(speculative_config=cfg, **opts)
        control(eng, continuations(prompts, gens, reference_greedy), 0.7)
        results.append(run(eng, [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, sps))], every=every))
        stats.append(eng.stats())
    roomy, tight = results
    for i in range(len(prompts)):
        assert roomy[f"r{i}"][0] == tight[f"r{i}"][0], f"r{i}"
        assert len(roomy[f"r{i}"][0]) == gens[i]
    assert stats[1]["num_preemptions"] > 0 and stats[1]["num_chunked_prefills"] > 0
    assert all(0 < s["spec_decode_num_accepted_tokens"] < s["spec_decode_num_draft_tokens"] for s in stats)


PROMPT = [17, 250, 33, 402, 9]
OPTS = dict(temperature=0.8, top_k=3)


def exact_first_three(model) -> dict[tuple[int, int, int], float]:
    """The target's exact joint distribution of the first three output tokens under OPTS (its support only)."""
    def probs(ids):
        p = sampling_probs(ReferenceRunner(model).logits(ids)[-1:], SamplingInput.full(1, **OPTS))[0].double()
        return {t: float(p[t]) for t in p.nonzero()[:, 0].tolist()}

    p1 = probs(PROMPT)
    joint = {}
    for a, pa in p1.items():
        for b, pb in probs(PROMPT + [a]).items():
            for c, pc in probs(PROMPT + [a, b]).items():
                joint[(a, b, c)] = pa * pb * pc
    return joint


def residual_ignores_q(draft_tokens, draft_probs, target_probs, uniforms, verify_lens=None, rule="standard",
                       vocab_ids=None):
    """A broken rule: after a rejection the correction token is drawn from T, not from norm(max(0, T - Q))."""
    out = verify_mod.verify(draft_tokens, draft_probs, target_probs, uniforms, verify_lens, rule, vocab_ids)
    n = out.num_accepted
    t_next = target_probs.gather(1, n[:, None, None].expand(-1, 1, target_probs.shape[2]))[:, 0]
    y = draw(t_next, uniforms[:, -1])
    out.tokens.scatter_(1, n[:, None], y[:, None])
    return out


def first_tokens(model, n):
    """The first output token of seeds 0..n-1 under OPTS: the engine's sampler on the prompt's logits."""
    logits = ReferenceRunner(model).logits(PROMPT)[-1:].expand(n, -1).clone()
    s = SamplingInput.full(n, **OPTS)
    s.seeds, s.positions = torch.arange(n), torch.full((n,), len(PROMPT))
    return Sampler()(logits, s).token_ids.tolist()


@pytest.mark.parametrize("rule", ["standard", "block", "scheduled", "vocab", "broken", "vocab-broken"])
def test_first_tokens_follow_the_target_distribution(rule, make_engine, tiny_loaded, reference_greedy, monkeypatch,
                                                     tiny_model_dir, tmp_path):
    """300 seeds of one prompt at temperature 0.8 / top-k 3, K = 2 probabilistic drafts, each replaced by the
    target's greedy choice after the seed's first token with probability 0.6: the first three output tokens (the
    prefill's sample, then the first speculative step's run) against the target's exact joint by chi-square; a
    residual that ignores Q fails the same check. "scheduled": confidence-scheduled verification with a cost table
    that makes the 300 sequences verify one draft of the two (every step after the prefill: widths recorded).
    "vocab": a draft vocabulary (`draft_vocab_size`) holding the known continuations' tokens (the frequent ones),
    every other token of the rest of the joint's support, and 100 others: the draft's Q is zero on the rest, which
    the target still emits (residuals); "vocab-broken": the same with a residual whose Q row misses the subset's
    ids (its columns taken for ids 0..N-1)."""
    if rule == "broken":
        monkeypatch.setattr(decoder_mod, "verify", residual_ignores_q)
    if rule == "vocab-broken":
        monkeypatch.setattr(verify_mod, "full_rows", lambda q, ids, v: torch.nn.functional.pad(q, (0, v - q.shape[-1])))
    model, n = tiny_loaded[0], 300
    joint = exact_first_three(model)
    known = {s: PROMPT + [t] + reference_greedy(PROMPT + [t], 3) for s, t in enumerate(first_tokens(model, n))}
    sched = dict(confidence_scheduling=True, confidence_cost_table=[[1, 1.0], [2 * n, 1.0], [3 * n, 1.6]])
    vocab = {}
    if rule.startswith("vocab"):
        frequent = sorted({t for seq in known.values() for t in seq[len(PROMPT):]})
        support = sorted({t for cell in joint for t in cell} - set(frequent))
        ids = frequent + support[::2] + [t for t in range(0, 512, 5) if t not in frequent + support][:100]
        make_tiny_dspark(tiny_model_dir, str(tmp_path / "draft"), draft_vocab_ids=ids)
        vocab = dict(model=str(tmp_path / "draft"), draft_vocab_size=len(ids))
    eng = make_engine(max_num_seqs=n, max_num_batched_tokens=8 * n, speculative_config=dspark(
        2, draft_sample_method="probabilistic", rejection_sample_method="block" if rule == "block" else "standard",
        **(sched if rule == "scheduled" else {}), **vocab))
    control(eng, known, 0.6)
    widths = []
    drafter = eng.executor.worker.drafter
    hook = drafter.proposal_hook
    drafter.proposal_hook = lambda prop, *a: (widths.append(prop.tokens.shape[1]), hook(prop, *a))[1]
    for s in range(n):
        eng.add_request(f"r{s}", prompt_token_ids=PROMPT,
                        sampling_params=SamplingParams(max_tokens=4, ignore_eos=True, seed=s, **OPTS))
    res = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            res.setdefault(o.request_id, []).extend(o.new_token_ids)
    cells = list(joint)
    index = {c: i for i, c in enumerate(cells)}
    samples = [tuple(res[f"r{s}"][:3]) for s in range(n)]
    assert all(c in index for c in samples), "a token triple the target gives probability 0 was emitted"
    p, chi2, df = chi_square_p(torch.tensor([index[c] for c in samples]), torch.tensor([joint[c] for c in cells]),
                               min_expected=5)
    st = eng.stats()
    assert 0.2 < st["spec_decode_acceptance_rate"] < 0.8, st  # drafts were accepted and rejected a lot
    assert set(widths) == ({1} if rule == "scheduled" else {2})
    if rule == "vocab":  # tokens outside the draft's vocabulary were emitted, beside accepted drafts
        assert eng.executor.worker.drafter.draft.vocab_ids.numel() == len(ids) < 512
        assert any(t not in ids for c in samples for t in c[1:])
    if rule.endswith("broken"):
        assert p < 1e-4, (p, chi2, df)
    else:
        assert p > 1e-3, (p, chi2, df)


# ---- stop conditions inside accepted runs, streaming, metrics ----------------------------------------------
def _inside_a_run(ref):
    """An output index inside (neither first nor last of) a speculative step's run of K+1 tokens, whose token did
    not occur before (so a stop on it cannot fire earlier). Output 0 is the prefill's; runs are 1..K+1, ..."""
    return next(j for j in range(K + 2, len(ref)) if ref[j] not in ref[:j] and j % (K + 1) not in (0, 1))


def _accepting_engine(make_engine, prompt, n, reference_greedy, **opts):
    eng = make_engine(speculative_config=dspark(), **opts)
    control(eng, {7: prompt + reference_greedy(prompt, n)}, 1.0)
    return eng, reference_greedy(prompt, n)


def _one(eng, prompt, sp):
    eng.add_request("r", prompt_token_ids=prompt, sampling_params=sp)
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    return outs


def test_every_draft_accepted_exact_metrics_and_streaming(make_engine, reference_greedy, eu):
    """p = 1: each speculative step emits K drafts + the bonus token, streamed as one output of K+1 tokens."""
    prompt = eu.random_prompts([9], seed=21)[0]
    eng, ref = _accepting_engine(make_engine, prompt, 1 + 3 * (K + 1), reference_greedy)
    outs = _one(eng, prompt, greedy(1 + 3 * (K + 1), 7))
    assert [len(o.new_token_ids) for o in outs] == [1, K + 1, K + 1, K + 1]
    assert [t for o in outs for t in o.new_token_ids] == ref and outs[-1].finish_reason == "length"
    assert [o.num_output_tokens for o in outs] == [1, 1 + K + 1, 1 + 2 * (K + 1), 1 + 3 * (K + 1)]
    st = eng.stats()
    assert (st["spec_decode_num_drafts"], st["spec_decode_num_draft_tokens"], st["spec_decode_num_accepted_tokens"]) \
        == (3, 3 * K, 3 * K)
    assert st["spec_decode_num_accepted_tokens_per_pos"] == [3] * K
    assert st["spec_decode_acceptance_rate"] == 1.0 and st["spec_decode_mean_accepted_length"] == K + 1
    assert st["spec_decode_acceptance_rate_per_pos"] == [1.0] * K


def test_partial_acceptance_metrics(make_engine, reference_greedy, eu):
    prompt = eu.random_prompts([9], seed=22)[0]
    eng = make_engine(speculative_config=dspark())
    control(eng, {7: prompt + reference_greedy(prompt, 60)}, 0.6)
    outs = _one(eng, prompt, greedy(60, 7))
    assert [t for o in outs for t in o.new_token_ids] == reference_greedy(prompt, 60)
    st = eng.stats()
    per_pos = st["spec_decode_num_accepted_tokens_per_pos"]
    assert per_pos == sorted(per_pos, reverse=True) and per_pos[0] > per_pos[-1]  # run i needs runs < i accepted
    assert sum(per_pos) == st["spec_decode_num_accepted_tokens"]
    assert 0.1 < st["spec_decode_acceptance_rate"] < 0.6  # ~ (0.6 + 0.6^2 + 0.6^3 + 0.6^4) / 4 = 0.33
    emitted = sum(len(o.new_token_ids) for o in outs[1:])
    steps = len(outs) - 1
    assert st["spec_decode_num_drafts"] <= steps and emitted == steps + st["spec_decode_num_accepted_tokens"]
    assert st["spec_decode_mean_accepted_length"] == pytest.approx(
        1 + st["spec_decode_num_accepted_tokens"] / st["spec_decode_num_drafts"])


def test_stop_token_and_eos_inside_an_accepted_run(make_engine, reference_greedy, eu):
    """The stop token is the 3rd token of the second speculative step's run: the output ends on it, no bonus."""
    prompt = eu.random_prompts([9], seed=23)[0]
    eng, ref = _accepting_engine(make_engine, prompt, 30, reference_greedy)
    j = _inside_a_run(ref)
    outs = _one(eng, prompt, greedy(30, 7, stop_token_ids=[ref[j]]))
    assert [t for o in outs for t in o.new_token_ids] == ref[:j + 1]
    assert outs[-1].finish_reason == "stop" and len(outs[-1].new_token_ids) == j % (K + 1)
    eng, _ = _accepting_engine(make_engine, prompt, 30, reference_greedy)
    assert not eng.eos_token_ids & set(ref[:j + 1])
    eng.eos_token_ids.add(ref[j])  # as a generation_config.json naming it would
    outs = _one(eng, prompt, SamplingParams(temperature=0.0, max_tokens=30, seed=7))
    assert [t for o in outs for t in o.new_token_ids] == ref[:j + 1] and outs[-1].finish_reason == "stop"
    st = eng.stats()
    assert st["num_free_pages"] == st["num_total_pages"]
    # two speculative steps (not a third launched ahead of the stop), the drafts up to the stop and none past it
    assert (st["spec_decode_num_drafts"], st["spec_decode_num_accepted_tokens"]) == (2, K + j % (K + 1))


def test_max_tokens_inside_a_run_limits_the_drafts(make_engine, reference_greedy, eu):
    """max_tokens = 8 with K = 4: the second speculative step drafts only 2 (it may emit 3), ends at 8 exactly."""
    prompt = eu.random_prompts([9], seed=24)[0]
    eng, ref = _accepting_engine(make_engine, prompt, 8, reference_greedy)
    outs = _one(eng, prompt, greedy(8, 7))
    assert [len(o.new_token_ids) for o in outs] == [1, K + 1, 2]
    assert [t for o in outs for t in o.new_token_ids] == ref and outs[-1].finish_reason == "length"
    assert eng.stats()["spec_decode_num_draft_tokens"] == K + 1


def test_stop_string_inside_an_accepted_run(make_engine, reference_greedy, eu):
    """A stop string completed by a token inside an accepted run: the output stops at the same token as without
    speculation (the detokenizer sees the tokens one by one), with the same text, and the rest of the run is
    dropped."""
    prompt = eu.random_prompts([9], seed=25)[0]
    eng, ref = _accepting_engine(make_engine, prompt, 30, reference_greedy)
    texts = [eng.tokenizer.decode(ref[:i]) for i in range(len(ref) + 1)]
    # the new text of a token in the middle of a run, not seen before it
    j = next(j for j in range(K + 2, 25) if j % (K + 1) not in (0, 1) and texts[j + 1].startswith(texts[j])
             and texts[j + 1][len(texts[j]):].strip() and texts[j + 1][len(texts[j]):] not in texts[j])
    sp = greedy(30, 7, stop=[texts[j + 1][len(texts[j]):]])
    outs = _one(eng, prompt, sp)
    plain = _one(make_engine(), prompt, sp)
    toks = [t for o in outs for t in o.new_token_ids]
    assert toks == [t for o in plain for t in o.new_token_ids] and toks == ref[:len(toks)]
    assert "".join(o.text for o in outs) == "".join(o.text for o in plain)
    assert outs[-1].finish_reason == plain[-1].finish_reason == "stop"
    assert 1 < len(outs[-1].new_token_ids) < K + 1 and len(toks) < 30  # the run was cut


# ---- configuration -------------------------------------------------------------------------------------------
def test_speculative_config_validation():
    ok = EngineConfig(model="x", speculative_config={
        "method": "dspark", "num_speculative_tokens": 7, "attention_backend": "FLASHINFER_TS", "kv_cache_dtype": "fp8",
        "draft_sample_method": "probabilistic"})
    ok.validate()
    s = ok.speculative
    assert (s.num_speculative_tokens, s.draft_sample_method, s.rejection_sample_method, s.kv_cache_dtype,
            s.attention_backend, s.draft_dir("/m")) == (7, "probabilistic", "standard", "fp8", "FLASHINFER_TS",
                                                          "/m/dspark")
    bad = [({"method": "eagle", "num_speculative_tokens": 3}, "method"),
           ({"method": "dspark"}, "num_speculative_tokens"),
           (dspark(0), "num_speculative_tokens"), (dspark(draft_sample_method="top1"), "draft_sample_method"),
           (dspark(rejection_sample_method="tree"), "rejection_sample_method"), (dspark(kv_cache_dtype="nvfp4"),
                                                                              "kv_cache_dtype"),
           (dspark(confidence_threshold=1.5), "confidence_threshold"), (dspark(num_draft=3), "unknown key"),
           (dspark(draft_backoff=-1), "draft_backoff"), (dspark(draft_backoff=True), "draft_backoff"),
           (dspark(prefill_apart=1), "prefill_apart"), ("dspark", "JSON object")]
    for raw, match in bad:
        with pytest.raises(ConfigError, match=match):
            EngineConfig(model="x", speculative_config=raw).validate()
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        EngineConfig(model="x", max_num_batched_tokens=4, speculative_config=dspark(7)).validate()
    off = EngineConfig(model="x", speculative_config={})
    off.validate()
    assert off.speculative is None


def test_draft_loading_errors_name_the_option(make_engine, tmp_path):
    with pytest.raises(ConfigError, match="exceeds the draft's block_size"):
        make_engine(speculative_config=dspark(8))
    with pytest.raises(ConfigError, match="no config.json in the DSpark draft directory"):
        make_engine(speculative_config=dspark(model=str(tmp_path)))


def test_model_json_and_cli_take_the_launch_line(tiny_model_dir, tmp_path):
    """The Triton model.json passes speculative_config through (its draft path resolved like `model`); the CLI
    takes --speculative-config and generates the same greedy tokens as without it."""
    from m3serve.triton.engine_args import engine_config
    from m3serve.cli import main

    version = tmp_path / "1"
    version.mkdir()
    (version / "model.json").write_text(json.dumps({
        "model": tiny_model_dir, "device": "cpu",
        "speculative_config": dspark(7, model=os.path.relpath(os.path.join(tiny_model_dir, "dspark"), version))}))
    cfg, _ = engine_config(str(version))
    assert cfg.speculative.num_speculative_tokens == 7
    assert os.path.samefile(cfg.speculative.draft_dir(cfg.model), os.path.join(tiny_model_dir, "dspark"))
    common = ["generate", "--model", tiny_model_dir, "--prompt-ids", "5,7,9", "--max-tokens", "6", "--device", "cpu",
              "--dtype", "float32", "--ignore-eos", "--max-model-len", "64"]
    assert main(common + ["--speculative-config", json.dumps(dspark(7, kv_cache_dtype="fp8"))]) == 0
    assert main(common + ["--speculative-config", '{"method": "dspark"}']) == 2


def test_triton_metrics_export_the_engine_counters():
    """backend/triton/metrics.py reads stats(): the vLLM spec-decode counters and the engine thread's step and
    device-wait counters grow by the stats' deltas."""
    from types import SimpleNamespace

    from m3serve.engine.scheduler import STEP_KINDS
    from m3serve.triton.metrics import Metrics

    class Family:
        COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
        all = {}

        def __init__(self, name, description, kind):
            self.name = name

        def Metric(self, labels, buckets=None):  # noqa: N802 - pb_utils' spelling
            m = SimpleNamespace(value=0.0)
            m.increment = lambda v, m=m: setattr(m, "value", m.value + v)
            m.set = lambda v, m=m: setattr(m, "value", v)
            m.observe = lambda v: None
            Family.all[self.name + (f"/{labels['kind']}" if "kind" in labels else "")] = m
            return m

    metrics = Metrics(SimpleNamespace(MetricFamily=Family), {"model": "m3"}, 512)
    stats = {"spec_decode_num_drafts": 3, "spec_decode_num_draft_tokens": 12, "spec_decode_num_accepted_tokens": 9,
             "spec_decode_acceptance_rate": 0.75, "num_steps": 4, "device_wait_seconds": 0.25, "num_prompt_steps": 1,
             "num_steps_ahead": 2, "steps_by_kind": {"decode": 3, "prefill": 1},
             "step_seconds_by_kind": {"decode": 0.03, "prefill": 0.05}}
    metrics.engine_stats(stats, 0)
    metrics.engine_stats({**stats, "spec_decode_num_drafts": 5, "spec_decode_num_draft_tokens": 20, "num_steps": 7,
                          "device_wait_seconds": 0.5, "num_prompt_steps": 3, "num_steps_ahead": 5,
                          "steps_by_kind": {"decode": 4, "prefill": 1, "decode+prefill": 2},
                          "step_seconds_by_kind": {"decode": 0.04, "prefill": 0.05, "decode+prefill": 0.1}}, 0)
    m = {k: v.value for k, v in Family.all.items()}
    assert (m["vllm:spec_decode_num_drafts_total"], m["vllm:spec_decode_num_draft_tokens_total"],
            m["vllm:spec_decode_num_accepted_tokens_total"]) == (5, 20, 9)
    assert m["vllm:spec_decode_draft_acceptance_rate"] == 0.75
    # the engine thread's own counters (steps, seconds waiting for the device) follow the engine's totals
    assert (m["m3serve:engine_steps_total"], m["m3serve:engine_device_wait_seconds_total"],
            m["m3serve:engine_prompt_steps_total"], m["m3serve:engine_steps_ahead_total"]) == (7, 0.5, 3, 5)
    # and so do the steps by kind and their seconds (a kind the engine has not run yet stays at 0)
    assert {k: m[f"m3serve:engine_steps_by_kind_total/{k}"] for k in STEP_KINDS} == {
        "decode": 4, "speculative": 0, "prefill": 1, "decode+prefill": 2, "speculative+prefill": 0}
    assert m["m3serve:engine_step_seconds_total/decode"] == pytest.approx(0.04)
    assert m["m3serve:engine_step_seconds_total/decode+prefill"] == pytest.approx(0.1)
