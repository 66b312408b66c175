"""A contiguous per-sequence cache of one layer (no paging): what the reference tests use (one per layer, bound
to the model's attention layers). Values are stored through the KV codec (quantized and read back), so its
numerics equal a quantized cache's. Sequence s of every step is the cache's sequence s."""
from __future__ import annotations

import torch

from m3serve.step_io import StepInput
from m3serve.model.kv_codec import KVCodec


class ContiguousCache:
    def __init__(self, kv_codec: KVCodec, index_codec: KVCodec | None = None):
        self.kv_codec, self.index_codec = kv_codec, index_codec or kv_codec
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.ik: dict[int, torch.Tensor] = {}

    def _append(self, store: dict, key, x: torch.Tensor, pos: torch.Tensor) -> None:
        old = store.get(key)
        start = 0 if old is None else old.shape[0]
        if int(pos[0]) != start or int(pos[-1]) != start + x.shape[0] - 1:
            raise ValueError(f"ContiguousCache: positions {int(pos[0])}..{int(pos[-1])} do not follow "
                             f"the {start} cached tokens")
        store[key] = x if old is None else torch.cat([old, x], 0)

    def store(self, seq, step: StepInput, k, v, ik) -> None:
        qsl = step.query_start_loc_cpu
        pos = step.positions[qsl[seq]:qsl[seq + 1]]
        self._append(self.k, seq, self.kv_codec.roundtrip(k), pos)
        self._append(self.v, seq, self.kv_codec.roundtrip(v), pos)
        if ik is not None:
            self._append(self.ik, seq, self.index_codec.roundtrip(ik), pos)

    def load(self, seq, step: StepInput):
        return self.k[seq], self.v[seq], self.ik.get(seq)
