"""The batched sampling transform (each filter on where some row needs it, neutral values where a row has none)
equals the engine sampler's per-row branches, runs no filter no row needs, and inverse-CDF draws are exact."""
import torch

from m3serve.executor.speculative.probs import draw, one_hot, sampling_probs
from m3serve.step_io import SamplingInput
from m3serve.executor.sampler import filter_logits


def test_sampling_probs_equal_the_samplers_transform_row_by_row():
    g = torch.Generator().manual_seed(0)
    s, v = 64, 50
    logits = torch.randn(s, v, generator=g) * 3
    half = lambda off, on: torch.where(torch.rand(s, generator=g) < 0.5, off, on)  # noqa: E731
    st = SamplingInput.full(s)
    st.temperature = torch.rand(s, generator=g) * 1.5 + 0.1
    st.top_k = torch.randint(0, 12, (s,), generator=g).to(torch.int32)
    st.top_p = half(1.0, torch.rand(s, generator=g) * 0.9 + 0.05)
    st.min_p = half(0.0, torch.rand(s, generator=g) * 0.2)
    st.needs_top_k = st.needs_top_p = st.needs_min_p = True  # as the step builder sets them: some row needs each
    got = sampling_probs(logits, st)
    for row in range(s):  # one row at a time: the sampler runs only the filters that row asks for
        one = SamplingInput.full(1, float(st.temperature[row]), int(st.top_k[row]), float(st.top_p[row]),
                                 float(st.min_p[row]))
        want = torch.softmax(filter_logits(logits[row:row + 1], one), -1)
        assert torch.allclose(got[row:row + 1], want, atol=1e-6), row
    assert torch.allclose(got.sum(-1), torch.ones(s))


def test_temperature_only_rows_sort_nothing():
    """No row asks for top-k / top-p / min-p: the transform is softmax(x / T), with no sort of the vocabulary (the
    speculative rule's sampled steps ran one per verify row before)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 40, generator=g) * 2
    st = SamplingInput.full(8, temperature=0.7)
    with Ops() as ops:
        p = sampling_probs(logits, st)
    assert not {"sort", "cumsum", "topk"} & ops.names
    assert torch.allclose(p, torch.softmax(logits / 0.7, -1), atol=1e-6)


def test_greedy_rows_are_one_hot_argmax_and_none_is_softmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 10, generator=g)
    st = SamplingInput.full(6, temperature=0.8, top_p=0.5)
    st.temperature[::2] = 0.0
    p = sampling_probs(logits, st)
    assert torch.equal(p[::2], one_hot(logits[::2].argmax(-1), 10))
    assert ((p[1::2] > 0).sum(-1) >= 1).all() and ((p[1::2] > 0).sum(-1) < 10).all()
    assert torch.allclose(sampling_probs(logits, None), torch.softmax(logits, -1))


def test_draw_follows_the_distribution_and_never_picks_zero_mass():
    probs = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0]) * 7  # unnormalised on purpose
    n = 200_000
    tokens = draw(probs.expand(n, -1), torch.rand(n, generator=torch.Generator().manual_seed(2)))
    freq = torch.bincount(tokens, minlength=6).double() / n
    assert torch.allclose(freq, probs.double() / probs.sum(), atol=0.005)
    edge = torch.tensor([0.0, 1 - 2 ** -24, 0.999999, 0.5])
    picked = draw(probs.expand(4, -1), edge)
    assert picked.tolist()[:3] == [1, 4, 4] and bool((probs[picked] > 0).all())
