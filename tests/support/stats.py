"""Goodness of fit for the speculative-decoding distribution tests."""
from __future__ import annotations

import torch


def chi_square_p(cells: torch.Tensor, probs: torch.Tensor, min_expected: float = 0.0) -> tuple[float, float, int]:
    """(p-value, chi2, dof) of the histogram of sampled cell ids `cells` against the cell probabilities `probs`.
    A sample in a zero-probability cell fails outright; cells expected fewer than `min_expected` times are pooled."""
    probs = probs.flatten().double()
    obs = torch.bincount(cells.flatten(), minlength=probs.numel()).double()
    exp = probs * cells.numel()
    live = exp > 0
    assert obs[~live].sum() == 0, "a sample the target gives probability 0 was emitted"
    small = live & (exp < min_expected)
    if small.any():
        live = live & ~small
        obs = torch.cat([obs[live], obs[small].sum()[None]])
        exp = torch.cat([exp[live], exp[small].sum()[None]])
    else:
        obs, exp = obs[live], exp[live]
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    df = int(exp.numel()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(chi2 / 2, dtype=torch.float64))), chi2, df
