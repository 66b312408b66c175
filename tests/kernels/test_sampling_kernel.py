"""The one-pass sampling kernel (interpreter here, compiled in tests/gpu) draws exactly the tokens of the sampler's
torch path: the same counter-based uniforms, greedy rows' argmax (first index on ties), the raw logprob."""
import pytest

from support.sampling import check_sampling_kernel


@pytest.mark.parametrize("n,v", [(7, 300), (3, 64)])
def test_sampling_kernel_matches_the_sampler(n, v):
    check_sampling_kernel(n, v)
