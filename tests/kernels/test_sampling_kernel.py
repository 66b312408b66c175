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


def test_vocab_splits_fill_the_gpu_at_batch_1(monkeypatch):
    monkeypatch.setattr(platform, "num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    assert vocab_splits(1, 200064, cuda) == (196, 1024)  # 196 programs of 1024 logits for one row
    assert vocab_splits(64, 200064, cuda) == (9, 22240)  # ~4 programs per SM
    assert vocab_splits(600, 200064, cuda) == (1, 200064)
    for rows, v, forced in [(1, 331, 4), (3, 5, 3), (2, 1031, 7)]:
        splits, chunk = vocab_splits(rows, v, cuda, forced)
        assert chunk % 16 == 0 and (splits - 1) * chunk < v <= splits * chunk  # every split non-empty
