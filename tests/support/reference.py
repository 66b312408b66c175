"""The reference forward: the model over a contiguous (unpaged) cache per layer with the torch attention."""
from __future__ import annotations

import torch

from m3serve.step_io import StepInput
from m3serve.model.kv_codec import KVCodec
from m3serve.model.layers.attention import TorchAttention
from m3serve.model.simple_cache import ContiguousCache


class ReferenceRunner:
    """One sequence fed chunk by chunk through `model` over its own ContiguousCaches (kv_dtype codec), one per
    layer; the model (maybe an engine's too) is bound to them for each call and then bound back as it was."""

    def __init__(self, model, kv_dtype: str = "float32"):
        self.model = model
        codec = KVCodec(kv_dtype)
        self.backends = tuple(TorchAttention(model.attention_geometry, ContiguousCache(codec, codec))
                              for _ in model.model.layers)
        self.done = 0

    def hidden(self, ids: list[int]) -> torch.Tensor:
        """Final hidden states [len(ids), H] of the next `ids` of the sequence."""
        device = self.model.model.embed_tokens.weight.device
        step = StepInput.contiguous([list(ids)], [self.done], device)
        self.done += len(ids)
        bound = self.model.attention_backends()
        self.model.bind_attention(self.backends)
        try:
            return self.model(step)
        finally:
            if bound:
                self.model.bind_attention(bound)

    def logits(self, ids: list[int]) -> torch.Tensor:
        """fp32 logits [len(ids), V] after each of the next `ids`."""
        return self.model.compute_logits(self.hidden(ids))


def reference_logits(model, ids, kv_dtype: str = "float32") -> torch.Tensor:
    """Logits [len(ids), V] of one prompt, in one pass."""
    return ReferenceRunner(model, kv_dtype).logits([int(t) for t in ids])
