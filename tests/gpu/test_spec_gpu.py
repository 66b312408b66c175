"""DSpark speculative steps on CUDA, replayed from their graphs (executor/speculative/graphs.py) and run eagerly: the same
tokens with graphs on and off (greedy, and seeded sampling with probabilistic drafts, block verification, FP8 draft
cache), greedy tokens equal to plain decoding up to near-ties, under in-flight batching with batch sizes between the
buckets (padded rows), sequences near max_tokens with fewer drafts (graphed too), mixed steps (prefill chunks) that
run eagerly; with the benchmarks' phase timing, one graph per phase and the same tokens; steps launched ahead
(async scheduling) give the synchronous engine's tokens. fp32 tiny model, fp32 caches."""
import pytest
import torch

from m3serve import LLM, SamplingParams
from m3serve.executor.speculative.controlled import ControlledProposals

pytestmark = pytest.mark.gpu
K = 5


def _prompts():
    g = torch.Generator().manual_seed(4)
    return [torch.randint(3, 480, (n,), generator=g).tolist() for n in (20, 90, 150, 7, 64)]


def _llm(tiny_model_dir, eager: bool, options: dict | None, async_scheduling: bool = True):
    return LLM(model=tiny_model_dir, device="cuda", dtype="float32", max_model_len=512, num_gpu_blocks_override=96,
               max_num_batched_tokens=64, max_num_seqs=8, enforce_eager=eager, async_scheduling=async_scheduling,
               speculative_config=None if options is None
               else {"method": "dspark", "num_speculative_tokens": K, **options})


def _speculate(tiny_model_dir, eager, options, params, known, async_scheduling=True):
    llm = _llm(tiny_model_dir, eager, options, async_scheduling)
    drafter = llm.engine.executor.worker.drafter
    drafter.proposal_hook = ControlledProposals(known, 0.7, drafter.draft.config.vocab_size, "cuda")
    outs = [o.token_ids for o in llm.generate(_prompts(), params)]
    return outs, drafter.graphs, llm.engine.stats()


def _near_tie(llm, prompt, plain_token, speculative_token):
    """Where speculation and plain decoding part, the two tokens were near-tied: the verify forward runs the prefill
    attention kernels, plain decoding the decode kernels, and their bf16 / fp16 dot operands move logprobs by
    0.02-0.07 (tests/gpu/test_engine_gpu.py); a broken step moves them by whole units."""
    top = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0].logprobs[0]
    assert speculative_token in top, f"{speculative_token} is not among plain decoding's top tokens {top}"
    assert top[plain_token] - top[speculative_token] < 0.15, (plain_token, speculative_token, top)


def test_greedy_speculation_equals_plain_decoding_with_graphs_on_and_off(tiny_model_dir):
    """Graphed and eager speculation give the same tokens (the same kernels); both equal plain decoding up to the
    first near-tie of a request, if any (checked), and most requests never part."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, seed=100 + i)
              for i, n in enumerate((40, 33, 25, 48, 30))]
    llm = _llm(tiny_model_dir, False, None)
    plain = [o.token_ids for o in llm.generate(_prompts(), params)]
    known = {100 + i: p + t for i, (p, t) in enumerate(zip(_prompts(), plain))}
    runs = {}
    for eager in (False, True):
        got, graphs, st = _speculate(tiny_model_dir, eager, {}, params, known)
        assert 0 < st["spec_decode_num_accepted_tokens"] < st["spec_decode_num_draft_tokens"]
        if eager:
            assert graphs is None
        else:
            assert graphs.num_steps > 5 and len(graphs.graphs) >= 2  # replayed, several batch buckets
            assert all(len(g) == 1 for g, _ in graphs.graphs.values())  # one graph per step
        runs[eager] = got
    # the same tokens, but where an all-plain greedy step (every sequence one token from max_tokens) ran: graphed it
    # is a graph row verifying 0 drafts (the prefill kernels), eager a decode step (the decode kernels): a near-tie
    # may part them there, at a request's last token only
    for prompt, graphed, eager in zip(_prompts(), runs[False], runs[True]):
        split = next((i for i, (a, b) in enumerate(zip(graphed, eager)) if a != b), None)
        if split is not None:
            assert split == len(eager) - 1, (split, len(eager))
            _near_tie(llm, prompt + eager[:split], eager[split], graphed[split])
    assert sum(g != e for g, e in zip(runs[False], runs[True])) <= 1
    parted = 0
    for prompt, want, got in zip(_prompts(), plain, runs[False]):
        split = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
        if split is not None:
            _near_tie(llm, prompt + want[:split], want[split], got[split])
            parted += 1
    assert parted <= 2, f"{parted} of 5 requests parted from plain decoding"


def test_draft_backoff_plain_steps_replay_width_zero_graphs(tiny_model_dir):
    """speculative_config.draft_backoff with drafts right 10% of the time: steps where every sequence has backed off
    replay their own width-0 graphs (no draft phase), and the tokens are plain decoding's up to a near-tie."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, seed=100 + i)
              for i, n in enumerate((40, 33, 25, 48, 30))]
    llm = _llm(tiny_model_dir, False, None)
    plain = [o.token_ids for o in llm.generate(_prompts(), params)]
    known = {100 + i: p + t for i, (p, t) in enumerate(zip(_prompts(), plain))}
    spec = _llm(tiny_model_dir, False, {"draft_backoff": 2})
    drafter = spec.engine.executor.worker.drafter
    drafter.proposal_hook = ControlledProposals(known, 0.1, drafter.draft.config.vocab_size, "cuda")
    got = [o.token_ids for o in spec.generate(_prompts(), params)]
    graphs = drafter.graphs
    assert any(key[3] == 0 for key in graphs.graphs) and any(key[3] == K for key in graphs.graphs)
    parted = 0
    for prompt, want, have in zip(_prompts(), plain, got):
        split = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), None)
        if split is not None:
            _near_tie(llm, prompt + want[:split], want[split], have[split])
            parted += 1
    assert parted <= 2, f"{parted} of 5 requests parted from plain decoding"


def test_sampled_speculation_same_tokens_with_graphs_on_and_off(tiny_model_dir):
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=n, ignore_eos=True, seed=200 + i)
              for i, n in enumerate((30, 22, 35, 18, 27))]
    known = {200 + i: p for i, p in enumerate(_prompts())}  # no continuation: the draft's own tokens
    options = {"draft_sample_method": "probabilistic", "rejection_sample_method": "block", "kv_cache_dtype": "fp8"}
    graphed, graphs, _ = _speculate(tiny_model_dir, False, options, params, known)
    eager, _, _ = _speculate(tiny_model_dir, True, options, params, known)
    assert graphed == eager and any(not key[2] for key in graphs.graphs)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_speculative_steps_launched_ahead_same_tokens(tiny_model_dir, sampled):
    """Async scheduling queues graphed speculative steps before the previous step's accepted runs reach the host
    (executor/ahead.py completes the buffers on the device, before the replay): the same tokens as the synchronous
    engine (the same graphs), with most decode steps launched ahead, drafts accepted and rejected."""
    params = [SamplingParams(temperature=0.8 if sampled else 0, top_p=0.9 if sampled else 1.0, max_tokens=n,
                             ignore_eos=True, seed=300 + i) for i, n in enumerate((60, 45, 70, 40, 55))]
    plain = [o.token_ids for o in _llm(tiny_model_dir, False, None).generate(_prompts(), params)]
    known = {300 + i: p + t for i, (p, t) in enumerate(zip(_prompts(), plain))}
    options = {"draft_sample_method": "probabilistic", "rejection_sample_method": "block"} if sampled else {}
    sync, _, st_sync = _speculate(tiny_model_dir, False, options, params, known, async_scheduling=False)
    ahead, graphs, st = _speculate(tiny_model_dir, False, options, params, known)
    assert ahead == sync and st_sync["num_steps_ahead"] == 0
    assert graphs.num_ahead > 5 and st["num_steps_ahead"] >= graphs.num_ahead  # through the graphs
    assert 0 < st["spec_decode_num_accepted_tokens"] < st["spec_decode_num_draft_tokens"]
    assert st["num_free_pages"] == st["num_total_pages"]


def test_draft_vocab_same_tokens_with_graphs_on_and_off(tiny_model_dir, tmp_path):
    """A draft vocabulary of 200 of the 512 ids (model/dspark_vocab.py: the subset's lm_head rows, the drafts'
    mapping to ids, Q read at the drafted ids and one residual row widened to V, all inside the captured graph):
    seeded sampling with probabilistic drafts, controlled toward a plain sampled run's tokens (those in the subset),
    gives the same tokens with graphs on and off, with drafts accepted and rejected."""
    from m3serve.model.dspark_tiny import make_tiny_dspark

    ids = torch.randperm(512, generator=torch.Generator().manual_seed(1))[:200].tolist()
    make_tiny_dspark(tiny_model_dir, str(tmp_path / "draft"), draft_vocab_ids=ids)
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=n, ignore_eos=True, seed=400 + i)
              for i, n in enumerate((30, 22, 35, 18, 27))]
    plain = [o.token_ids for o in _llm(tiny_model_dir, False, None).generate(_prompts(), params)]
    known = {400 + i: p + t for i, (p, t) in enumerate(zip(_prompts(), plain))}
    options = {"model": str(tmp_path / "draft"), "draft_vocab_size": 200, "draft_sample_method": "probabilistic"}
    graphed, graphs, st = _speculate(tiny_model_dir, False, options, params, known)
    eager, _, _ = _speculate(tiny_model_dir, True, options, params, known)
    assert graphed == eager and any(not key[2] for key in graphs.graphs) and graphs.num_steps > 5
    assert 0 < st["spec_decode_num_accepted_tokens"] < st["spec_decode_num_draft_tokens"]


@pytest.mark.parametrize("kv", ["bfloat16", "fp8"])
def test_draft_context_partials_at_m3_widths(kv):
    """The draft's paged context attention kernel compiled at M3's widths (64 query / 4 KV heads of 128, pages of
    128, bf16 queries), contexts of 0 to 3000 tokens, against its torch reference (merged over the splits)."""
    from m3serve.executor.speculative.draft_cache import DraftKVCache
    from m3serve.kernels.msa_attention import context_partials, context_partials_ref

    g = torch.Generator("cuda").manual_seed(0)
    lens = [0, 100, 700, 3000]
    cache = DraftKVCache(1, 120, 128, 4, 128, kv, torch.bfloat16, "cuda", scales={0: (0.25, 0.5)})
    tables = torch.randperm(120, device="cuda", generator=g)[:4 * 24].view(4, 24).to(torch.int32)
    for s, n in enumerate(lens):
        pos = torch.arange(n, device="cuda")
        kv_rows = torch.randn(2, n, 4, 128, device="cuda", generator=g)
        cache.write(0, tables[s, pos // 128].long() * 128 + pos % 128, kv_rows[0], kv_rows[1])
    pages = cache.paged_fn(tables)(0).cache
    q = torch.randn(4, 64, 128, device="cuda", generator=g).to(torch.bfloat16)
    ctx = torch.tensor(lens, device="cuda")
    op, lse = context_partials(q, pages, tables, ctx, 128 ** -0.5)
    rop, rlse = context_partials_ref(q, pages, tables, ctx, 128 ** -0.5)
    top = lse.amax(-1, keepdim=True)
    w = torch.exp2(lse[1:] - top[1:])
    merged = (op[1:] * w[..., None]).sum(2) / w.sum(-1)[..., None]
    assert torch.allclose(merged, rop[1:, :, 0], atol=2e-2, rtol=2e-2), (merged - rop[1:, :, 0]).abs().max()
    assert torch.allclose(torch.log2(w.sum(-1)) + top[1:, :, 0], rlse[1:, :, 0], atol=2e-2)
    assert bool((lse[0] == float("-inf")).all())


def test_confidence_scheduled_widths_replay_their_own_graphs(tiny_model_dir):
    """Confidence-scheduled verification (executor/speculative/confidence.py) with scores that switch between low and high
    with the position: steps of width 1 and of K both replay graphs of their own, and give the eager run's tokens."""
    from m3serve.executor.speculative.proposer import Proposal

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, seed=300 + i)
              for i, n in enumerate((40, 33, 25, 48, 30))]
    known = {300 + i: p for i, p in enumerate(_prompts())}
    options = {"confidence_scheduling": True, "confidence_cost_table": [[1, 1.0], [8, 1.0], [64, 4.0]]}
    runs = {}
    for eager in (False, True):
        llm = _llm(tiny_model_dir, eager, options)
        drafter = llm.engine.executor.worker.drafter
        control = ControlledProposals(known, 0.7, drafter.draft.config.vocab_size, "cuda")

        def hook(prop, ids, pos, seeds, control=control):
            prop = control(prop, ids, pos, seeds)
            conf = torch.where((pos // 5) % 2 == 0, 0.97, 0.05)[:, None].expand(-1, prop.tokens.shape[1])
            return Proposal(prop.tokens, prop.probs, conf.contiguous(), None)

        drafter.proposal_hook = hook
        runs[eager] = [o.token_ids for o in llm.generate(_prompts(), params)]
        if not eager:
            assert {1, K} <= {key[3] for key in drafter.graphs.graphs}
    assert runs[False] == runs[True]


def test_phase_timing_splits_the_graph_and_keeps_the_tokens(tiny_model_dir):
    """bench_spec's split: with `timing` each phase is a graph of its own, CUDA events between them; the tokens are
    the single graph's."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, seed=300 + i)
              for i, n in enumerate((24, 31, 17, 28, 20))]
    known = {300 + i: p for i, p in enumerate(_prompts())}
    llm = _llm(tiny_model_dir, False, {})
    drafter = llm.engine.executor.worker.drafter
    drafter.proposal_hook = ControlledProposals(known, 0.7, drafter.draft.config.vocab_size, "cuda")
    whole = [o.token_ids for o in llm.generate(_prompts(), params)]
    graphs = drafter.graphs
    graphs.timing = True
    split = [o.token_ids for o in llm.generate(_prompts(), params)]
    graphs.flush_timing()
    assert split == whole
    assert {len(g) for key, (g, _) in graphs.graphs.items() if key[4]} == {5}
    assert {len(g) for key, (g, _) in graphs.graphs.items() if not key[4]} == {1}
    assert graphs.phase_ms and all(len(ms) == 5 and min(ms) > 0 for ms in graphs.phase_ms)
