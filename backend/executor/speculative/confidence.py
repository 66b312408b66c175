"""How many drafted tokens to verify, from the draft's confidence head (design/dspark.md section 3).

Static threshold (DeepSpec's `--confidence-threshold`): verify the drafts before the first position whose
confidence c_k falls below the threshold; that token and all later ones are dropped (0 = verify all).
Lossless: keeping x_k depends only on c_1..c_k, which depend on x_0..x_{k-1}, never on x_k itself nor on
the target. The hardware-aware prefix scheduler (the paper's Algorithm 1) is not built yet.
"""
from __future__ import annotations

import torch


def confident_prefix_length(confidence: torch.Tensor, threshold: float | torch.Tensor) -> torch.Tensor:
    """confidence fp32 [S, K] in (0, 1), threshold (scalar or [S]) -> verify lengths L int64 [S], 0..K."""
    thr = threshold[:, None] if isinstance(threshold, torch.Tensor) and threshold.dim() == 1 else threshold
    return (confidence >= thr).long().cumprod(-1).sum(-1)  # a float threshold stays a scalar: no copy to the device
