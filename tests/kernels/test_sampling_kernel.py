"""The sampling kernel (interpreter here, compiled in tests/gpu) draws exactly the tokens of the sampler's torch
path: the same counter-based uniforms, greedy rows' argmax (first index on ties, also across splits), the raw
logprob; with the vocabulary in one split or in several (boundaries inside a BLOCK, a split shorter than a BLOCK,
a vocabulary that is a multiple of nothing)."""
import pytest
import torch

from m3serve.kernels import platform
from m3serve.kernels.sampling import vocab_splits
from support.sampling import check_sampling_kernel


@pytest.mark.parametrize("n,v,splits", [(7, 300, None), (3, 64, None), (7, 331, 4), (6, 331, 7), (5, 1031, 5)])
def test_sampling_kernel_matches_the_sampler(n, v, splits):
    check_sampling_kernel(n, v, splits=splits)


def test_vocab_splits_keep_their_contracts(monkeypatch):
    """The split counts are tuning (measured on the H200: `vocab_splits`' docstring) and are not pinned here; what the
    kernel needs of them is: a split length that is a multiple of 16 (aligned loads) and every split non-empty, by
    default and when a test forces the count."""
    monkeypatch.setattr(platform, "num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    cases = [(rows, v, None) for rows in (1, 3, 64, 600) for v in (5, 331, 1031, 200064)]
    for rows, v, forced in cases + [(1, 331, 4), (3, 5, 3), (2, 1031, 7)]:
        splits, chunk = vocab_splits(rows, v, cuda, forced)
        assert chunk % 16 == 0 and (splits - 1) * chunk < v <= splits * chunk, (rows, v, forced)  # none empty
