"""The static-buffer path of graphed speculative steps (executor/speculative/graphs.py), run eagerly on the CPU: the steps
the CUDA graphs take (every sequence speculating with K drafts) go through the persistent buffers, padded to their
batch bucket, and give the same tokens as the eager path; mixed steps keep running eagerly. (The capture itself
runs on CUDA only: tests/gpu/test_spec_gpu.py.)"""
import torch

from m3serve.engine.sampling_params import SamplingParams
from m3serve.executor.speculative.controlled import ControlledProposals
from m3serve.executor.speculative.graphs import SpeculativeBuffers

K = 4


def _engine(make_engine, graphs: bool, **options):
    # a roomy pool: the reference attention writes the padding rows' slot -1 to the pool's last page, never used here
    eng = make_engine(max_num_seqs=8, num_gpu_blocks_override=64, max_model_len=256,
                      speculative_config={"method": "dspark", "num_speculative_tokens": K, **options})
    if graphs:
        eng.executor.worker.drafter.enable_graphs(8, 256)
    return eng


def _run(eng, prompts, sps, known, p):
    drafter = eng.executor.worker.drafter
    drafter.proposal_hook = ControlledProposals(known, p, drafter.draft.config.vocab_size)
    for i, (prompt, sp) in enumerate(zip(prompts, sps)):
        eng.add_request(f"r{i}", prompt_token_ids=prompt, sampling_params=sp)
    out = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [out[f"r{i}"] for i in range(len(prompts))]


def test_greedy_static_path_equals_plain_decoding_with_padding(make_engine, reference_greedy, eu):
    """3 sequences (bucket 4: one padded row), then fewer as they finish; drafts right 60% of the time."""
    prompts = eu.random_prompts([9, 30, 17], seed=21)
    gens = [25, 18, 30]
    sps = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, seed=1000 + i) for i, n in enumerate(gens)]
    known = {1000 + i: p + reference_greedy(p, n) for i, (p, n) in enumerate(zip(prompts, gens))}
    eng = _engine(make_engine, True)
    graphs = eng.executor.worker.drafter.graphs
    drafts = []  # per static step, each speculating sequence's k, and the plain decodes in it
    execute = graphs.execute
    graphs.execute = lambda step, prev=None: (drafts.append(([], step.num_seqs) if step.speculative is None else (
        step.speculative.num_drafts.tolist(), step.num_seqs - step.speculative.num_seqs)), execute(step, prev))[1]
    got = _run(eng, prompts, sps, known, 0.6)
    assert got == [reference_greedy(p, n) for p, n in zip(prompts, gens)]
    assert graphs.num_steps >= 5 and {key[0] for key in graphs.views} >= {4, 2}  # padded buckets ran
    # sequences near max_tokens (k < K drafts; k = 0: a plain decode) took the static path too, beside others
    assert any(d and min(d) < K == max(d) for d, _ in drafts) and any(len(d) == 1 and d[0] < K for d, _ in drafts)
    assert any(d and plain for d, plain in drafts) and any(not d for d, _ in drafts)  # some or all plain decodes
    assert eng.num_steps - graphs.num_steps <= 2  # the prefill steps
    st = eng.stats()
    assert 0 < st["spec_decode_num_accepted_tokens"] < st["spec_decode_num_draft_tokens"]


def test_draft_backoff_steps_of_plain_decodes_run_width_zero(make_engine, reference_greedy, eu):
    """speculative_config.draft_backoff with drafts right 10% of the time: the sequences back off, steps where all
    of them decode plainly take the width-0 static step (no draft phase: one row per sequence), and the tokens are
    plain greedy decoding's."""
    prompts = eu.random_prompts([9, 30, 17], seed=23)
    gens = [30, 24, 28]
    sps = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, seed=1000 + i) for i, n in enumerate(gens)]
    known = {1000 + i: p + reference_greedy(p, n) for i, (p, n) in enumerate(zip(prompts, gens))}
    eng = _engine(make_engine, True, draft_backoff=2)
    graphs = eng.executor.worker.drafter.graphs
    widths = []
    execute = graphs.execute
    graphs.execute = lambda step, prev=None: (widths.append(graphs._step_k(step)), execute(step, prev))[1]
    got = _run(eng, prompts, sps, known, 0.1)
    assert got == [reference_greedy(p, n) for p, n in zip(prompts, gens)]
    assert 0 in widths and K in widths  # steps of plain decodes only at width 0, speculative ones at K
    assert any(key[3] == 0 for key in graphs.views) and graphs.buffers[0].k == 0
    st = eng.stats()
    assert 0 < st["spec_decode_num_drafts"] < eng.num_steps * len(prompts)


def test_sampled_static_path_equals_eager_path(make_engine, reference_greedy, eu):
    """Seeded sampling (temperature 0.8, top-p 0.9), probabilistic drafts, block verification: the same tokens with
    and without the static path, which took some steps but not the mixed ones."""
    prompts = eu.random_prompts([40, 12, 25, 33, 8], seed=22)
    gens = [20, 14, 26, 9, 17]
    sps = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=n, ignore_eos=True, seed=1000 + i)
           for i, n in enumerate(gens)]
    known = {1000 + i: p + reference_greedy(p, n) for i, (p, n) in enumerate(zip(prompts, gens))}
    opts = dict(draft_sample_method="probabilistic", rejection_sample_method="block", kv_cache_dtype="fp8")
    eager = _run(_engine(make_engine, False, **opts), prompts, sps, known, 0.7)
    eng = _engine(make_engine, True, **opts)
    static = _run(eng, prompts, sps, known, 0.7)
    assert static == eager and [len(t) for t in static] == gens
    graphs = eng.executor.worker.drafter.graphs
    assert 0 < graphs.num_steps < eng.num_steps and any(not key[2] for key in graphs.views)


def test_buffers_pad_past_the_step():
    """Rows past the step's sequences: no slot (nothing written), position 0, greedy; a smaller step after a larger
    one leaves nothing of the larger one in the padding."""
    from m3serve.step_io import SamplingInput, SpeculativeInput, StepInput

    buf = SpeculativeBuffers(4, 3, 16, 2, torch.device("cpu"))

    def step(n, base):
        t = n * 3
        qsl = list(range(0, t + 1, 3))
        return StepInput(torch.arange(t) + base, torch.arange(t) + base, torch.tensor(qsl, dtype=torch.int32),
                         torch.full((n,), base, dtype=torch.int32), qsl, [base] * n, False, 3, 48,
                         torch.full((n, 2), 1, dtype=torch.int32), torch.arange(t) + base,
                         torch.arange(n) * 3, SamplingInput.full(n, 0.7, top_p=0.9, seed=5),
                         speculative=SpeculativeInput(torch.arange(n), torch.arange(n), torch.arange(n) * 3, torch.full((n,), 2),
                                        torch.arange(t), torch.arange(n * 2), torch.zeros(0, dtype=torch.int64), 2))

    big = buf.speculative_step(4, 3, False)
    buf.fill_speculative(step(4, 100), big)
    view = buf.speculative_step(4, 3, False)
    buf.fill_speculative(step(1, 50), view)
    assert view.input_ids.tolist() == [50, 51, 52] + [0] * 9
    assert view.slot_mapping.tolist() == [50, 51, 52] + [-1] * 9
    assert view.sampling.temperature.tolist()[1:] == [0.0] * 3 and view.sampling.top_p.tolist()[1:] == [1.0] * 3
    assert view.seq_lens_cpu == [50, 3, 3, 3] and view.block_tables[1:, 0].tolist() == [0, 0, 0]
    assert view.speculative.draft_rows.tolist() == [1, 2, 4, 5, 7, 8, 10, 11] and view.logits_indices.tolist() == [0, 3, 6, 9]


def test_buffers_spread_fewer_drafts_over_k_plus_one_rows():
    """A sequence with k < K drafts (k = 0: a plain decode) fills K+1 rows: its k+1 tokens, then its last token
    again at its position with no slot; its k goes into num_drafts (what the rule verifies), padding sequences
    take K."""
    from m3serve.step_io import SamplingInput, SpeculativeInput, StepInput

    buf = SpeculativeBuffers(4, 3, 16, 3, torch.device("cpu"))
    view = buf.speculative_step(4, 3, True)
    ks = [3, 1, 2]  # K = 3: 4 + 2 + 3 tokens
    qsl = [0, 4, 6, 9]
    ids = torch.arange(9) + 100
    pos = torch.tensor([20, 21, 22, 23, 7, 8, 40, 41, 42])
    slots = pos + 1000
    rows = [qsl[i] + 1 + j for i, k in enumerate(ks) for j in range(k)]
    step = StepInput(ids, pos, torch.tensor(qsl, dtype=torch.int32), torch.tensor([24, 9, 43], dtype=torch.int32),
                     qsl, [24, 9, 43], False, 4, 48, torch.ones(3, 2, dtype=torch.int32), slots,
                     torch.tensor(qsl[:3]), SamplingInput.full(3, 0.0),
                     speculative=SpeculativeInput(torch.arange(3), torch.arange(3), torch.tensor(qsl[:3]), torch.tensor(ks),
                                    torch.tensor(rows), torch.tensor([0, 1, 2, 3, 6, 7]),
                                    torch.zeros(0, dtype=torch.int64), 3))
    buf.fill_speculative(step, view)
    assert view.input_ids.tolist() == [100, 101, 102, 103, 104, 105, 105, 105, 106, 107, 108, 108] + [0] * 4
    assert view.positions.tolist() == [20, 21, 22, 23, 7, 8, 8, 8, 40, 41, 42, 42] + [0] * 4
    assert view.slot_mapping.tolist() == [1020, 1021, 1022, 1023, 1007, 1008, -1, -1, 1040, 1041, 1042, -1] + [-1] * 4
    assert view.speculative.num_drafts.tolist() == [3, 1, 2, 3] and view.seq_lens_cpu == [24, 9, 43, 4]
    # a greedy step whose second sequence decodes plainly (one token, no speculative row): 0 drafts, its token K+1 times
    qsl = [0, 4, 5, 8]
    step = StepInput(torch.arange(8) + 100, pos[[0, 1, 2, 3, 4, 6, 7, 8]], torch.tensor(qsl, dtype=torch.int32),
                     torch.tensor([24, 8, 43], dtype=torch.int32), qsl, [24, 8, 43], False, 4, 48,
                     torch.ones(3, 2, dtype=torch.int32), slots[[0, 1, 2, 3, 4, 6, 7, 8]], torch.tensor(qsl[:3]),
                     SamplingInput.full(3, 0.0),
                     speculative=SpeculativeInput(torch.tensor([0, 2]), torch.tensor([0, 2]), torch.tensor([0, 5]),
                                    torch.tensor([3, 2]), torch.tensor([1, 2, 3, 6, 7]), torch.tensor([0, 1, 2, 3, 4]),
                                    torch.tensor([1]), 3))
    buf.fill_speculative(step, view)
    assert view.input_ids.tolist()[:12] == [100, 101, 102, 103, 104, 104, 104, 104, 105, 106, 107, 107]
    assert view.slot_mapping.tolist()[:12] == [1020, 1021, 1022, 1023, 1007, -1, -1, -1, 1040, 1041, 1042, -1]
    assert view.positions.tolist()[4:8] == [7] * 4 and view.speculative.num_drafts.tolist() == [3, 0, 2, 3]


def test_fill_is_two_copies():
    """A step goes into the buffers by two copies (the packed per-row and per-sequence inputs, the block table's
    rows): on CUDA two transfers before the replay, where a copy and a fill per field were ~24 launches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from m3serve.step_io import SamplingInput, SpeculativeInput, StepInput

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in ("slice", "view", "alias", "select", "as_strided", "detach"):
                self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    buf = SpeculativeBuffers(4, 3, 16, 3, torch.device("cpu"))
    view = buf.speculative_step(4, 3, True)
    qsl = [0, 4, 6]  # two sequences, k = 3 and k = 1: the second spread over K + 1 rows
    pos = torch.tensor([20, 21, 22, 23, 7, 8])
    step = StepInput(torch.arange(6) + 100, pos, torch.tensor(qsl, dtype=torch.int32),
                     torch.tensor([24, 9], dtype=torch.int32), qsl, [24, 9], False, 4, 48,
                     torch.ones(2, 2, dtype=torch.int32), pos + 1000, torch.tensor(qsl[:2]), SamplingInput.full(2, 0.0),
                     speculative=SpeculativeInput(torch.arange(2), torch.arange(2), torch.tensor(qsl[:2]), torch.tensor([3, 1]),
                                    torch.tensor([1, 2, 3, 5]), torch.tensor([0, 1, 2, 3]),
                                    torch.zeros(0, dtype=torch.int64), 3))
    with Ops() as ops:
        buf.fill_speculative(step, view)
    assert ops.names == ["copy_", "copy_"]
    assert view.input_ids.tolist()[:8] == [100, 101, 102, 103, 104, 105, 105, 105]
    assert view.slot_mapping.tolist() == [1020, 1021, 1022, 1023, 1007, 1008, -1, -1] + [-1] * 8
    assert view.seq_lens.tolist() == [24, 9, 4, 4] and view.speculative.num_drafts.tolist() == [3, 1, 3, 3]
