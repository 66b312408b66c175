"""Speculative verification is lossless (design/dspark.md section 5, tests 1-5).

A toy of the exact DSpark form: a target that is a fixed random Markov chain T(. | last token) over a
vocabulary of 8, and a draft with fixed block hidden states / base logits U_k plus the real Markov head
(the bias depends on the *sampled* previous draft token) and the real confidence head, drafted by the
real `sample_block` loop and verified by `verify`. Each test runs 2*10^5 independent cycles from a fixed
anchor at once (rows of one batch) and compares the first two emitted tokens with the exact target joint
T(y1 | c) T(y2 | y1) by chi-square; a broken rule must fail the same harness.
"""
import math
import sys

import pytest
import torch

from m3serve.executor.speculative import verify as verify_mod
from m3serve.executor.speculative.confidence import confident_prefix_length
from m3serve.executor.speculative.probs import draw, one_hot, sampling_probs
from m3serve.step_io import SamplingInput
from m3serve.executor.speculative.proposer import sample_block
from m3serve.executor.speculative.verify import block_acceptance, verify
from m3serve.model.dspark_heads import ConfidenceHead, MarkovHead
from support.stats import chi_square_p as support_chi_square_p

V, GAMMA, HID, RANK = 8, 4, 16, 8
CYCLES = 200_000
ANCHOR = 3


class Toy:
    def __init__(self, seed=0, markov=True, conf_scale=3.0):
        self.vocab = None  # a reduced draft vocabulary (`with_draft_vocab`)
        g = torch.Generator().manual_seed(seed)
        self.target_logits = torch.randn(V, V, generator=g) * 1.5
        self.h = torch.randn(GAMMA, HID, generator=g)
        self.base = torch.randn(GAMMA, V, generator=g) * 0.8
        self.markov = None
        if markov:
            # the Markov bias W2 W1[prev] is a noisy copy of the target's transition: drafts are accepted
            # often, and rejected often
            self.markov = MarkovHead("vanilla", V, RANK, HID, torch.float32)
            self.markov.markov_w1.weight.copy_(self.target_logits + torch.randn(V, V, generator=g) * 0.6)
            self.markov.markov_w2.weight.copy_(torch.eye(V) + torch.randn(V, RANK, generator=g) * 0.1)
        self.conf = ConfidenceHead(HID, RANK if markov else 0)
        width = HID + (RANK if markov else 0)
        self.conf.proj.weight.copy_(torch.randn(1, width, generator=g) * conf_scale / HID ** 0.5)
        # c_1 (which only sees the fixed anchor) passes a 0.5 threshold; later positions vary with x_{k-1}
        first = self.conf(self.h[0], None if self.markov is None else self.markov.prev_embedding(torch.tensor(ANCHOR)))
        self.conf.proj.bias.copy_(0.5 - torch.logit(first).reshape(1))

    def with_draft_vocab(self, ids: list[int]) -> "Toy":
        """The draft proposes from the sorted `ids` only: U and W2 cut to their columns / rows, as
        DSparkDraft.use_draft_vocab cuts them."""
        self.vocab = torch.tensor(ids)
        self.base = self.base[:, self.vocab]
        w2 = self.markov.markov_w2
        w2.weight = torch.nn.Parameter(w2.weight.detach()[self.vocab], requires_grad=False)
        return self

    def target(self, prev, st):
        """prev [S, K+1] = [x0, x_1..x_K] -> T [S, K+1, V] after the sampling transform."""
        s, k1 = prev.shape
        rows = self.target_logits[prev.flatten()]
        return sampling_probs(rows, None if st is None else st.repeat_rows(k1)).view(s, k1, V)

    def cycle(self, anchor, gen, rule="standard", method="probabilistic", st=None, threshold=None, k=GAMMA):
        s = anchor.shape[0]
        h = self.h[:k].expand(s, -1, -1)
        prop = sample_block(self.markov, self.conf if threshold is not None else None, h,
                            self.base[:k].expand(s, -1, -1), anchor, method, st, torch.rand(s, k, generator=gen),
                            vocab_ids=self.vocab)
        lens = None if threshold is None else confident_prefix_length(prop.confidence, threshold)
        t = self.target(torch.cat([anchor[:, None], prop.tokens], 1), st)
        return verify(prop.tokens, prop.probs, t, torch.rand(s, k + 1, generator=gen), lens, rule,
                      prop.vocab_ids), lens

    def first_two(self, gen, **kw):
        anchor = torch.full((CYCLES,), ANCHOR, dtype=torch.long)
        out, _ = self.cycle(anchor, gen, **kw)
        again, _ = self.cycle(out.tokens[:, 0], gen, **kw)  # rows that emitted one token continue
        y2 = torch.where(out.num_accepted >= 1, out.tokens[:, 1], again.tokens[:, 0])
        return out.tokens[:, 0], y2, out

    def exact_joint(self, opts=None):
        """T(y1 | anchor) T(y2 | y1) [V, V] under sampling options `opts` (None: plain softmax)."""
        st = (lambda n: None) if opts is None else (lambda n: SamplingInput.full(n, **opts))
        p1 = sampling_probs(self.target_logits[ANCHOR][None], st(1))[0]
        return p1[:, None] * sampling_probs(self.target_logits, st(V))


def chi_square_p(y1, y2, joint):
    """p-value of the V^2-cell histogram against `joint`; a sample in a zero-probability cell fails outright."""
    return support_chi_square_p(y1 * V + y2, joint)


SAMPLING = {"T1": None, "T0.7_topp0.9": dict(temperature=0.7, top_p=0.9)}


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("method", ["probabilistic", "greedy"])
@pytest.mark.parametrize("rule", ["standard", "block"])
def test_distribution_preserved_chi_square(rule, method, sampling):
    toy = Toy(seed=1)
    st = None if SAMPLING[sampling] is None else SamplingInput.full(CYCLES, **SAMPLING[sampling])
    gen = torch.Generator().manual_seed(7)
    y1, y2, out = toy.first_two(gen, rule=rule, method=method, st=st)
    p, chi2, df = chi_square_p(y1, y2, toy.exact_joint(SAMPLING[sampling]))
    assert p > 1e-3, (p, chi2, df)
    mean_accepted = float(out.num_accepted.float().mean())
    assert 0.3 < mean_accepted < GAMMA - 0.3, mean_accepted  # drafts are both accepted and rejected


DRAFT_VOCAB = [0, 2, 3, 5, 6]  # 5 of the 8 ids: the target's mass on 1, 4, 7 comes from the residual alone


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("method", ["probabilistic", "greedy"])
@pytest.mark.parametrize("rule", ["standard", "block"])
def test_distribution_preserved_with_a_draft_vocabulary(rule, method, sampling):
    """The draft proposes from 5 of the 8 ids (Q zero elsewhere, held as [S, K, 5]): the emitted pair still follows
    the target's joint, drafts are accepted and rejected, and ids outside the subset are emitted (residuals)."""
    toy = Toy(seed=1).with_draft_vocab(DRAFT_VOCAB)
    st = None if SAMPLING[sampling] is None else SamplingInput.full(CYCLES, **SAMPLING[sampling])
    y1, y2, out = toy.first_two(torch.Generator().manual_seed(7), rule=rule, method=method, st=st)
    p, chi2, df = chi_square_p(y1, y2, toy.exact_joint(SAMPLING[sampling]))
    assert p > 1e-3, (p, chi2, df)
    assert 0.3 < float(out.num_accepted.float().mean()) < GAMMA - 0.3
    outside = ~torch.isin(y1, torch.tensor(DRAFT_VOCAB))
    assert 0.02 < float(outside.float().mean()) < 0.98


def test_negative_control_residual_ignoring_the_draft_vocab_mapping_fails(monkeypatch):
    """The residual's Q row widened to V without the subset's ids (its columns taken as ids 0..N-1)."""
    monkeypatch.setattr(verify_mod, "full_rows", lambda q, ids, v: torch.nn.functional.pad(q, (0, v - q.shape[-1])))
    toy = Toy(seed=1).with_draft_vocab(DRAFT_VOCAB)
    y1, y2, _ = toy.first_two(torch.Generator().manual_seed(7))
    p, chi2, df = chi_square_p(y1, y2, toy.exact_joint())
    assert p < 1e-6, (p, chi2, df)


def test_negative_control_always_accept_fails(monkeypatch):
    monkeypatch.setattr(verify_mod, "_accept_standard", lambda ratio, u, lens: (lens, torch.ones_like(ratio[:, 0])))
    toy = Toy(seed=1)
    y1, y2, _ = toy.first_two(torch.Generator().manual_seed(7))
    p, chi2, df = chi_square_p(y1, y2, toy.exact_joint())
    assert p < 1e-6, (p, chi2, df)


def test_negative_control_block_stop_at_first_failure_fails(monkeypatch):
    monkeypatch.setattr(verify_mod, "_last_passed", lambda ok: ok.long().cumprod(-1).sum(-1))
    toy = Toy(seed=1)
    y1, y2, _ = toy.first_two(torch.Generator().manual_seed(7), rule="block")
    p, chi2, df = chi_square_p(y1, y2, toy.exact_joint())
    assert p < 1e-6, (p, chi2, df)


def test_negative_control_verifying_another_q_fails(monkeypatch):
    """The drafts are drawn from the top-p transform of z_k, but the verifier is handed softmax(z_k)."""
    real = sample_block

    def wrong_q(*args, **kw):
        prop = real(*args, **kw)
        prop.probs = torch.softmax(prop.logits, -1)
        return prop

    monkeypatch.setattr(sys.modules[__name__], "sample_block", wrong_q)
    toy, opts = Toy(seed=1), SAMPLING["T0.7_topp0.9"]
    y1, y2, _ = toy.first_two(torch.Generator().manual_seed(7), st=SamplingInput.full(CYCLES, **opts))
    p, chi2, df = chi_square_p(y1, y2, toy.exact_joint(opts))
    assert p < 1e-6, (p, chi2, df)


def test_expected_accepted_rule_a_context_free():
    """No Markov head, a target that ignores the prefix: E[n] = sum_k prod_{i<=k} alpha_i,
    alpha_i = sum_v min(T, Q_i)."""
    toy = Toy(seed=2, markov=False)
    toy.target_logits[:] = toy.target_logits[0]
    t = torch.softmax(toy.target_logits[0], -1)
    alpha = torch.minimum(torch.softmax(toy.base, -1), t[None]).sum(-1)
    expected = float(torch.cumprod(alpha, 0).sum())
    out, _ = toy.cycle(torch.full((CYCLES,), ANCHOR), torch.Generator().manual_seed(3))
    n = out.num_accepted.double()
    assert abs(float(n.mean()) - expected) < 5 * float(n.std()) / CYCLES ** 0.5 + 1e-3, (float(n.mean()), expected)


@pytest.mark.parametrize("rule,expected", [("standard", 10 / 9), ("block", 11 / 9)])
def test_block_verification_toy_10_9_vs_11_9(rule, expected):
    """T = [1/3, 2/3], Q = [2/3, 1/3] at both of 2 positions (Sun et al.; sglang's test)."""
    gen = torch.Generator().manual_seed(5)
    q = torch.tensor([2 / 3, 1 / 3]).expand(CYCLES, 2, 2)
    t = torch.tensor([1 / 3, 2 / 3]).expand(CYCLES, 3, 2)
    x = torch.stack([draw(q[:, i], torch.rand(CYCLES, generator=gen)) for i in range(2)], 1)
    out = verify(x, q, t, torch.rand(CYCLES, 3, generator=gen), rule=rule)
    assert abs(float(out.num_accepted.double().mean()) - expected) < 0.03
    # what is emitted is still the target's: y1 ~ T
    assert abs(float((out.tokens[:, 0] == 1).double().mean()) - 2 / 3) < 0.01


def test_block_acceptance_matches_hand_computation():
    """h and rho of one row against the formulas worked by hand (V = 2, L = 2)."""
    q = torch.tensor([[[0.6, 0.4], [0.3, 0.7]]])
    t = torch.tensor([[[0.2, 0.8], [0.5, 0.5], [0.9, 0.1]]])
    x = torch.tensor([[1, 0]])
    ratio = verify_mod._ratios(x, q, t)
    h, rho = block_acceptance(ratio, torch.tensor([2]), q, t)
    rho1 = min(1.0, 0.8 / 0.4)
    rho2 = min(1.0, rho1 * 0.5 / 0.3)
    z1 = max(0.0, rho1 * 0.5 - 0.3) + max(0.0, rho1 * 0.5 - 0.7)
    h1 = z1 / (z1 + 1 - rho1) if z1 + 1 - rho1 > 0 else 1.0
    assert torch.allclose(rho[0], torch.tensor([1.0, rho1, rho2]))
    assert torch.allclose(h[0], torch.tensor([h1, rho2]))


@pytest.mark.parametrize("rule", ["standard", "block"])
def test_confidence_threshold_truncation_is_lossless(rule):
    toy = Toy(seed=1)
    gen = torch.Generator().manual_seed(11)
    y1, y2, out = toy.first_two(gen, rule=rule, threshold=0.5)
    p, chi2, df = chi_square_p(y1, y2, toy.exact_joint())
    assert p > 1e-3, (p, chi2, df)
    _, lens = toy.cycle(torch.full((CYCLES,), ANCHOR), gen, rule=rule, threshold=0.5)
    counts = torch.bincount(lens, minlength=GAMMA + 1)
    assert (counts[1:] > CYCLES // 50).all(), counts  # the threshold cuts at every position


def test_confident_prefix_length():
    c = torch.tensor([[0.9, 0.8, 0.2, 0.9], [0.1, 0.9, 0.9, 0.9], [0.6, 0.6, 0.6, 0.6]])
    assert confident_prefix_length(c, 0.5).tolist() == [2, 0, 4]
    assert confident_prefix_length(c, 0.0).tolist() == [4, 4, 4]
    assert confident_prefix_length(c, torch.tensor([0.85, 0.05, 0.7])).tolist() == [1, 4, 0]


@pytest.mark.parametrize("rule", ["standard", "block"])
def test_greedy_target_accepts_matching_prefix_whatever_the_uniforms(rule):
    """One-hot T (temperature 0): n = the prefix where x_i = argmax T_i, y = argmax T_{n+1}, for a
    probabilistic draft Q as for a one-hot one, whatever the uniforms."""
    gen = torch.Generator().manual_seed(0)
    s, k = 4096, 4
    logits = torch.randn(s, k + 1, V, generator=gen)
    t = sampling_probs(logits.flatten(0, 1), SamplingInput.full(s * (k + 1), temperature=0.0)).view(s, k + 1, V)
    q = torch.softmax(torch.randn(s, k, V, generator=gen), -1)
    best = logits.argmax(-1)
    x = torch.where(torch.rand(s, k, generator=gen) < 0.7, best[:, :k], torch.randint(0, V, (s, k), generator=gen))
    match = (x == best[:, :k]).long().cumprod(-1).sum(-1)
    for trial in range(3):
        out = verify(x, q, t, torch.rand(s, k + 1, generator=gen), rule=rule)
        assert torch.equal(out.num_accepted, match)
        col = torch.arange(k + 1)[None, :]
        assert torch.equal(out.tokens[:, :k][col[:, :k] < match[:, None]], x[col[:, :k] < match[:, None]])
        assert torch.equal(out.tokens.gather(1, match[:, None])[:, 0], best.gather(1, match[:, None])[:, 0])


@pytest.mark.parametrize("rule", ["standard", "block"])
@pytest.mark.parametrize("probabilistic", [False, True])
def test_verify_greedy_equals_verify_on_one_hot_targets(rule, probabilistic):
    """The speculative step's greedy shortcut (argmaxes only) gives exactly `verify`'s tokens on the one-hot T, for
    one-hot and probabilistic Q, any uniforms and verify lengths 0..K (ties in the logits included)."""
    gen = torch.Generator().manual_seed(3)
    s, k = 4096, 4
    logits = torch.randint(0, 3, (s, k + 1, V), generator=gen).float()  # many ties: argmax takes the first
    t = sampling_probs(logits.flatten(0, 1), SamplingInput.full(s * (k + 1), temperature=0.0)).view(s, k + 1, V)
    best = logits.argmax(-1)
    x = torch.where(torch.rand(s, k, generator=gen) < 0.7, best[:, :k], torch.randint(0, V, (s, k), generator=gen))
    q = torch.softmax(torch.randn(s, k, V, generator=gen), -1) if probabilistic else None
    lens = torch.randint(0, k + 1, (s,), generator=gen)
    want = verify(x, q, t, torch.rand(s, k + 1, generator=gen), lens, rule)
    got = verify_mod.verify_greedy(x, best, lens)
    assert torch.equal(got.num_accepted, want.num_accepted) and torch.equal(got.tokens, want.tokens)
    assert (want.num_accepted == lens).any() and (want.num_accepted < lens).any() and (lens == 0).any()
    # the lengths matter: without them the shortcut accepts past L
    assert not torch.equal(verify_mod.verify_greedy(x, best).num_accepted, want.num_accepted)


@pytest.mark.parametrize("rule", ["standard", "block"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_speculation_equals_greedy_decoding(rule, k):
    """Toy-level greedy equivalence (test 4): target and draft greedy, any K and any verify lengths: the
    emitted stream equals plain greedy decoding of the target, token for token."""
    toy = Toy(seed=3)
    st = SamplingInput.full(64, temperature=0.0)
    gen = torch.Generator().manual_seed(1)
    anchors = torch.arange(64) % V
    plain = [anchors]
    for _ in range(24):
        plain.append(toy.target_logits[plain[-1]].argmax(-1))
    plain = torch.stack(plain[1:], 1)
    streams = [[] for _ in range(64)]
    anchor = anchors.clone()
    for _ in range(24):
        s = 64
        h = toy.h[:k].expand(s, -1, -1)
        prop = sample_block(toy.markov, None, h, toy.base[:k].expand(s, -1, -1), anchor, "greedy")
        t = toy.target(torch.cat([anchor[:, None], prop.tokens], 1), st)
        lens = torch.randint(0, k + 1, (s,), generator=gen)
        out = verify(prop.tokens, prop.probs, t, torch.rand(s, k + 1, generator=gen), lens, rule)
        for row in range(s):
            streams[row] += out.tokens[row, :int(out.num_accepted[row]) + 1].tolist()
        anchor = out.tokens.gather(1, out.num_accepted[:, None])[:, 0]
    for row in range(64):
        assert streams[row][:24] == plain[row].tolist()


def test_verify_lengths_invariance_at_temperature_zero():
    """T = 0: verifying fewer drafts only cuts the emitted run short; it never changes a token."""
    toy = Toy(seed=4)
    s, st = 2048, SamplingInput.full(2048, temperature=0.0)
    gen = torch.Generator().manual_seed(2)
    anchor = torch.randint(0, V, (s,), generator=gen)
    prop = sample_block(toy.markov, None, toy.h.expand(s, -1, -1), toy.base.expand(s, -1, -1), anchor, "greedy")
    t = toy.target(torch.cat([anchor[:, None], prop.tokens], 1), st)
    full = verify(prop.tokens, prop.probs, t, torch.rand(s, GAMMA + 1, generator=gen))
    lens = torch.randint(0, GAMMA + 1, (s,), generator=gen)
    cut = verify(prop.tokens, prop.probs, t, torch.rand(s, GAMMA + 1, generator=gen), lens)
    assert torch.equal(cut.num_accepted, torch.minimum(full.num_accepted, lens))
    col = torch.arange(GAMMA + 1)[None, :]
    keep = col <= cut.num_accepted[:, None]
    assert torch.equal(cut.tokens[keep], full.tokens[keep])
    assert bool((cut.tokens[~keep] == -1).all())


def test_verify_rejects_bad_shapes_and_rule():
    x, q, t, u = torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, 4) / 4, torch.ones(2, 4, 4) / 4, torch.rand(2, 4)
    with pytest.raises(ValueError, match="rule"):
        verify(x, q, t, u, rule="typical")
    with pytest.raises(ValueError, match="shapes"):
        verify(x, q, t[:, :3], u)
    assert math.isfinite(float(verify(x, q, t, u).num_accepted.float().mean()))


@pytest.mark.parametrize("rule", ["standard", "block"])
def test_greedy_draft_without_q_is_the_one_hot_draft(rule):
    """A greedy proposal carries no Q; verify builds the one-hot Q: same result as passing it."""
    gen = torch.Generator().manual_seed(6)
    s, k = 512, 3
    x = torch.randint(0, V, (s, k), generator=gen)
    t = torch.softmax(torch.randn(s, k + 1, V, generator=gen), -1)
    u = torch.rand(s, k + 1, generator=gen)
    implicit, explicit = verify(x, None, t, u, rule=rule), verify(x, one_hot(x, V), t, u, rule=rule)
    assert torch.equal(implicit.tokens, explicit.tokens) and 0 < float(implicit.num_accepted.float().mean()) < k


def test_greedy_draft_standard_rule_builds_no_vocabulary_wide_q():
    """Rule "standard" with a greedy draft reads Q_i(x_i) = 1 and one [S, V] residual row: no [S, K, V] one-hot
    (at M3's vocabulary, batch 32 and K = 7: 180 MB written per step before). Rule "block" still builds it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and not func.is_view:  # tensors made, not views of the inputs
                self.shapes.append(tuple(out.shape))
            return out

    gen = torch.Generator().manual_seed(7)
    s, k = 16, 3
    x = torch.randint(0, V, (s, k), generator=gen)
    t = torch.softmax(torch.randn(s, k + 1, V, generator=gen), -1)
    u = torch.rand(s, k + 1, generator=gen)
    for rule, built in (("standard", False), ("block", True)):
        with Shapes() as mode:
            verify(x, None, t, u, rule=rule)
        assert ((s, k, V) in mode.shapes) == built, rule
