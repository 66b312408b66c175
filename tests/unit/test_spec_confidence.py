"""Confidence-scheduled verification (executor/speculative/confidence.py): the verify width each step picks from the
sequences' previous confidences and the step's cost, and the engine running with it (greedy output identical to
plain decoding, on the eager and the static-buffer path). The chi-square check of the sampled distribution with
scheduling on is test_spec_engine.py's `test_first_tokens_follow_the_target_distribution[scheduled]`."""
import pytest
import torch

from m3serve.config import ConfigError, EngineConfig
from m3serve.engine.sampling_params import SamplingParams
from m3serve.executor.speculative.confidence import VerifyScheduler, prefix_survival, verify_widths
from m3serve.executor.speculative.controlled import ControlledProposals
from m3serve.executor.speculative.proposer import Proposal
from m3serve.speculative_config import CostTable

K = 4
# flat up to 8 verify tokens, then rising: at 4 sequences every width costs more than the one below
COST = [[1, 1.0], [8, 1.0], [64, 4.0]]


def test_widths_and_cost_table():
    assert verify_widths(7) == [1, 2, 3, 5, 7] and verify_widths(4) == [1, 2, 3, 4] and verify_widths(1) == [1]
    c = CostTable([[64, 4.0], [8, 1.0], [1, 1.0]])
    assert c(0) == c(1) == c(8) == 1.0 and c(36) == pytest.approx(2.5) and c(120) == pytest.approx(7.0)
    for bad in ([[1, 1.0]], [[1, 1.0], [1, 2.0]], [[1, 0.0], [8, 1.0]], [[1, "x"], [2, 1.0]]):
        with pytest.raises((ValueError, TypeError)):
            CostTable(bad)


def test_prefix_survival_extends_the_last_confidence():
    assert prefix_survival([0.5, 0.8], 4) == pytest.approx([0.5, 0.4, 0.32, 0.256])
    assert prefix_survival([], 3) == [1.0, 1.0, 1.0]  # no history yet: scheduled as if accepted


def test_scheduler_cuts_low_confidence_and_keeps_high():
    s = VerifyScheduler(K, COST)
    four = lambda c: [([c] * K, K)] * 4  # noqa: E731
    assert s.width(four(0.95)) == K  # confident drafts are worth their rows
    assert s.width(four(0.1)) == 1  # unlikely ones are not: verify one
    assert 1 < s.width(four(0.7)) < K  # in between, a prefix
    assert s.width([([0.1] * K, K)]) == K  # one sequence: every width costs the same, all K pay
    assert s.width([]) == K and s.width([([], K)] * 4) == K  # nothing known: K
    # a sequence's own draft limit caps what it can gain: near max_tokens it adds no rows past k_r
    assert s.width([([0.95] * K, 1)] * 4) == 1


def test_config_validation():
    dspark = {"method": "dspark", "num_speculative_tokens": K}
    ok = EngineConfig(model="x", speculative_config={**dspark, "confidence_scheduling": True,
                                                     "confidence_cost_table": COST})
    ok.validate()
    assert ok.speculative.confidence_scheduling and ok.speculative.confidence_cost_table == COST
    for raw, match in (({"confidence_scheduling": "yes"}, "confidence_scheduling"),
                       ({"confidence_scheduling": True}, "confidence_cost_table"),  # no made-up default
                       ({"confidence_cost_table": [[1, 1.0]]}, "confidence_cost_table"),
                       ({"confidence_cost_table": [[1, 1.0], [2, 1.0, 3]]}, "confidence_cost_table"),
                       ({"confidence_cost_table": 5}, "confidence_cost_table")):
        with pytest.raises(ConfigError, match=match):
            EngineConfig(model="x", speculative_config={**dspark, **raw}).validate()


class _Confidence:
    """A proposal hook: the controlled proposals, their confidence replaced by conf(anchor positions) [R, k]; records
    each step's width (drafts per sequence)."""

    def __init__(self, control, conf):
        self.control, self.conf, self.widths, self.rows = control, conf, [], []

    def __call__(self, prop, ids, pos, seeds):
        prop = self.control(prop, ids, pos, seeds)
        self.widths.append(prop.tokens.shape[1])
        self.rows.append(prop.tokens.shape[0])
        c = self.conf(pos)[:, None].expand(-1, prop.tokens.shape[1]).contiguous()
        return Proposal(prop.tokens, prop.probs, c, None)


def _run(make_engine, reference_greedy, eu, conf, graphs=False, p=0.6):
    prompts = eu.random_prompts([9, 30, 17, 24], seed=31)
    gens = [26, 20, 30, 23]
    eng = make_engine(max_num_seqs=8, num_gpu_blocks_override=64, max_model_len=256, speculative_config={
        "method": "dspark", "num_speculative_tokens": K, "confidence_scheduling": True,
        "confidence_cost_table": COST})
    drafter = eng.executor.worker.drafter
    if graphs:
        drafter.enable_graphs(8, 256)
    known = {1000 + i: q + reference_greedy(q, n) for i, (q, n) in enumerate(zip(prompts, gens))}
    hook = _Confidence(ControlledProposals(known, p, drafter.draft.config.vocab_size), conf)
    drafter.proposal_hook = hook
    for i, (q, n) in enumerate(zip(prompts, gens)):
        eng.add_request(f"r{i}", prompt_token_ids=q, sampling_params=SamplingParams(
            temperature=0.0, max_tokens=n, ignore_eos=True, seed=1000 + i))
    res = eu.run_to_completion(eng)
    assert [res[f"r{i}"][0] for i in range(len(prompts))] == [reference_greedy(q, n) for q, n in zip(prompts, gens)]
    return eng, hook


@pytest.mark.parametrize("level", ["low", "high"])
def test_engine_verifies_fewer_drafts_after_low_confidence(level, make_engine, reference_greedy, eu):
    """Every draft scored 0.05 (or 0.97): after the first speculative step (no scores yet: all K) the engine verifies
    one draft per sequence (or keeps all K) while the 4 sequences run; greedy output stays the plain decode's."""
    c = 0.05 if level == "low" else 0.97
    eng, hook = _run(make_engine, reference_greedy, eu, lambda pos: torch.full(pos.shape, c))
    widths = hook.widths
    assert widths[0] == K
    steps = list(zip(widths, hook.rows))[1:]
    if level == "low":  # while all 4 run; with fewer the step costs about the same at every width: wider again
        assert [w for w, r in steps if r == 4] == [1] * 7
    else:  # (the last steps verify fewer: their one sequence may draft only what it has left of max_tokens)
        assert {w for w, r in steps if r >= 2} == {K}
    st = eng.stats()
    assert 0 < st["spec_decode_num_accepted_tokens"] < st["spec_decode_num_draft_tokens"]


@pytest.mark.parametrize("graphs", [False, True])
def test_greedy_identical_while_the_width_changes(graphs, make_engine, reference_greedy, eu):
    """Scores that switch between low and high with the position: widths 1 and K both run (and, on the static-buffer
    path, each width gets its own buffers and bucket); greedy output identical to plain decoding."""
    eng, hook = _run(make_engine, reference_greedy, eu,
                     lambda pos: torch.where((pos // 5) % 2 == 0, 0.97, 0.05), graphs=graphs)
    widths = hook.widths
    assert {1, K} <= set(widths)
    if graphs:
        g = eng.executor.worker.drafter.graphs
        assert {1, K} <= set(g.buffers) and {1, K} <= {key[3] for key in g.views}


def test_controlled_proposals_report_p_as_their_confidence():
    """Where the controlled proposals know the token their confidence is p (the true chance the draft is the
    target's: a calibrated head for benchmarks of scheduling); elsewhere the draft's own score stays."""
    control = ControlledProposals({7: list(range(10))}, 0.6, 16)
    prop = Proposal(torch.zeros(2, 3, dtype=torch.int64), None, torch.full((2, 3), 0.25), None)
    out = control(prop, torch.zeros(2, dtype=torch.int64), torch.tensor([2, 8]), torch.tensor([7, 9]))
    # seed 7 at anchor 2 knows positions 3..5; at anchor 8 seed 9 is unknown
    assert torch.allclose(out.confidence, torch.tensor([[0.6] * 3, [0.25] * 3]))
    edge = control(prop, torch.zeros(2, dtype=torch.int64), torch.tensor([7, 8]), torch.tensor([7, 7]))
    # the recording ends at position 9
    assert torch.allclose(edge.confidence, torch.tensor([[0.6, 0.6, 0.25], [0.6, 0.25, 0.25]]))
