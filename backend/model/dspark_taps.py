"""Capture a target's tapped hidden states (the DSpark draft's context features) with forward hooks, so
the target model itself stays untouched.

Layer ids follow the HF convention the draft checkpoints use: `l` = the output of decoder layer `l` (the
residual stream, before the final norm), `-1` = the embedding output, and the last layer's id = HF's last
hidden state, which is post-norm: the output of the target's final norm (= what its forward returns).
Rows accumulate over forward calls in call order; `take()` returns them as features [T, m*H] (the tapped
layers concatenated in increasing id order) and starts afresh.
"""
from __future__ import annotations

import torch


class TapRecorder:
    def __init__(self, target, layer_ids: list[int]):
        n = len(target.model.layers)
        if any(not -1 <= i < n for i in layer_ids):
            raise ValueError(f"tapped layer ids {layer_ids} must lie in -1..{n - 1}")
        self.layer_ids = list(layer_ids)
        self._modules = [target.model.embed_tokens if i == -1 else
                         target.model.norm if i == n - 1 else target.model.layers[i] for i in layer_ids]
        self._rows: list[list[torch.Tensor]] = [[] for _ in layer_ids]
        self._handles = []

    def __enter__(self) -> "TapRecorder":
        for slot, module in enumerate(self._modules):
            self._handles.append(module.register_forward_hook(
                lambda _m, _args, out, slot=slot: self._rows[slot].append(out.detach())))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def take(self) -> torch.Tensor:
        """The rows recorded since the last take: fp [T, m*H]."""
        out = torch.cat([torch.cat(rows, 0) for rows in self._rows], -1)
        self._rows = [[] for _ in self.layer_ids]
        return out
