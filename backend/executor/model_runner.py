"""One step on the device: the step input copied in once, the model run over the worker's paged cache, the logits of
the sampled rows (a finished prefill chunk or a decode), sampling on the device."""
from __future__ import annotations

import logging

import torch

from m3serve.step_io import SamplerOutput, StepInput
from m3serve.model.kv_cache import PagedKVCache
from m3serve.executor.sampler import Sampler
from m3serve.model.layers.attention import TorchAttention

log = logging.getLogger(__name__)


def select_attention_backend(model, cache: PagedKVCache, device: torch.device):
    """The Triton kernel backend on CUDA when it imports; else the torch reference attention."""
    if device.type == "cuda":
        try:
            from m3serve.model.layers.triton_attention import TritonAttention
        except ImportError as e:
            log.warning("Triton attention backend unavailable (%s); using the torch reference attention", e)
        else:
            log.info("attention backend: Triton kernels (block-sparse MSA over the paged cache)")
            cfg, par = model.config, model.parallel  # this rank's heads
            h0, h1 = par.split_heads(cfg.index_n_heads, "index_n_heads")
            return TritonAttention(model.attention_spec, cache, cfg.num_attention_heads // par.size, h1 - h0)
    return TorchAttention(model.attention_spec, cache)


class ModelRunner:
    def __init__(self, model, cache: PagedKVCache, device: torch.device, backend=None):
        self.model, self.cache, self.device = model, cache, torch.device(device)
        self.backend = backend if backend is not None else select_attention_backend(model, cache, self.device)
        self.sampler = Sampler()
        self.graphs = None  # a CudaGraphRunner once `capture_graphs` ran
        self.spec = None  # a SpeculativeDecoder (executor/speculative/decoder.py) runs every step when set

    def capture_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture the decode graphs (CUDA only); decode steps replay them from then on."""
        from m3serve.executor.cuda_graph import CudaGraphRunner
        graphs = CudaGraphRunner(self, max_num_seqs, -(-max_model_len // self.cache.block_size))
        graphs.capture()
        self.graphs = graphs

    @torch.inference_mode()
    def forward(self, step: StepInput) -> torch.Tensor:
        """Final hidden states [T, H] of a step already on the device (its tile maps planned here unless a CUDA
        graph's static step already carries them)."""
        plan = getattr(self.backend, "plan", None)
        if plan is not None and step.attn_tiles is None:
            plan(step)
        return self.model(step, self.backend)

    @torch.inference_mode()
    def execute(self, step: StepInput, prev_token_ids: torch.Tensor | None = None) -> SamplerOutput | None:
        """Run one step; the sampled tokens (on the device), or None when the step samples nothing. Tensor-parallel
        ranks other than 0 get the step without its sampling fields: they compute their logits' share (gathered
        to rank 0) and return None. Decode steps replay the CUDA graphs when they were captured; speculative
        decoding runs its own step (executor/speculative/decoder.py). `prev_token_ids`: the previous step's sampled ids on
        the device, where a step launched ahead of them (`step.prev_token_rows`) takes its input ids."""
        if (step.prev_token_rows is None) != (prev_token_ids is None):
            raise ValueError("a step reads the previous step's tokens exactly when it is given them")
        if self.spec is not None:
            if prev_token_ids is not None:
                raise ValueError("speculative steps take their input ids from the host")
            return self.spec.execute(step)
        if self.graphs is not None and self.graphs.supports(step):
            return self.graphs.execute(step, prev_token_ids)
        step = step.to(self.device, non_blocking=True)
        if prev_token_ids is not None:
            step.input_ids = prev_token_ids[step.prev_token_rows]
        hidden = self.forward(step)
        if step.logits_indices is None or step.logits_indices.numel() == 0:
            return None
        logits = self.model.compute_logits(hidden[step.logits_indices])
        if logits is None or step.sampling is None:
            return None
        return self.sampler(logits, step.sampling)
