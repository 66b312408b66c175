"""Comparing typed step objects (`StepInput`, `SamplingInput`, `SamplerOutput`) field by field."""
from __future__ import annotations

import dataclasses

import torch


def assert_same(x, y) -> None:
    """Equal types, and equal fields all the way down (tensors: dtype and values)."""
    assert type(x) is type(y)
    if isinstance(x, torch.Tensor):
        assert x.dtype == y.dtype and torch.equal(x, y)
    elif dataclasses.is_dataclass(x):
        for f in dataclasses.fields(x):
            assert_same(getattr(x, f.name), getattr(y, f.name))
    else:
        assert x == y
