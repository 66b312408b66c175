"""One step on the device: the step input copied in once, the model run (its layers bound to the worker's paged cache
when the runner is made), the logits of the sampled rows (a finished prefill chunk or a decode), sampling on the
device."""
from __future__ import annotations

import logging

import torch

from m3serve.step_io import SamplerOutput, StepInput
from m3serve.model.kv_cache import PagedKVCache
from m3serve.executor.ahead import follow_previous
from m3serve.executor.sampler import Sampler

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model, cache: PagedKVCache, device: torch.device, attention: str = "auto"):
        """Binds each of the model's attention layers to its page-pool layer (`M3ForCausalLM.bind_kv_cache`; the
        Triton kernels on CUDA, the torch reference elsewhere, or as `attention` says): the runner never hands
        the cache to the model again."""
        self.model, self.cache, self.device = model, cache, torch.device(device)
        model.bind_kv_cache(cache, attention)
        self.attention = model.attention_backends()  # this runner's binding (a model may be shared: tests)
        self.sampler = Sampler()
        self.graphs = None  # a CudaGraphRunner once `capture_graphs` ran
        self.piecewise = None  # a PiecewiseGraphs once `capture_piecewise` ran: prefill and mixed steps replay it
        self.drafter = None  # a SpeculativeDecoder (executor/speculative/decoder.py) runs every step when set

    def capture_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture the decode graphs (CUDA only); decode steps replay them from then on."""
        from m3serve.executor.cuda_graph import CudaGraphRunner
        graphs = CudaGraphRunner(self, max_num_seqs, -(-max_model_len // self.cache.block_size))
        graphs.capture()
        self.graphs = graphs

    def capture_piecewise(self, max_tokens: int) -> None:
        """Capture the piecewise graphs of prefill and mixed steps up to `max_tokens` tokens (CUDA only; a model whose
        layers' projections are not fused keeps running those steps eagerly)."""
        from m3serve.executor.piecewise import PiecewiseGraphs
        pieces = PiecewiseGraphs(self.model, max_tokens, self.device)
        if not pieces.ok:
            log.warning("piecewise graphs: a layer's QKV projections are not fused (quantized); steps stay eager")
            return
        pieces.capture()
        self.piecewise = pieces

    def bind_attention(self, backends) -> None:
        """Run the model's layers through `backends` (one per layer, each over that layer's cache: a test's shadow
        or reference) from now on. Not once graphs are captured: they replay the backends bound at capture."""
        if self.graphs is not None or getattr(self.drafter, "graphs", None) is not None:
            raise RuntimeError("the CUDA graphs were captured with the attention bound before: build the runner "
                               "with the backends instead, or run with enforce_eager")
        self.model.bind_attention(backends)
        self.attention = self.model.attention_backends()

    @torch.inference_mode()
    def forward(self, step: StepInput) -> torch.Tensor:
        """Final hidden states [T, H] of a step already on the device (the model plans its tile maps once, unless
        a CUDA graph's static step already carries them). A model another runner bound since (several engines
        over one model, in tests) is bound back to this runner's cache first: one identity check a step."""
        if self.model.attention_backends() is not self.attention:
            self.model.bind_attention(self.attention)
        if self.piecewise is not None and self.piecewise.supports(step):
            return self.piecewise.forward(step)
        return self.model(step)

    @torch.inference_mode()
    def execute(self, step: StepInput, prev: SamplerOutput | None = None) -> SamplerOutput | None:
        """Run one step; the sampled tokens (on the device), or None when the step samples nothing. Tensor-parallel
        ranks other than 0 get the step without its sampling fields: they compute their logits' share (gathered
        to rank 0) and return None. Decode steps replay the CUDA graphs when they were captured; speculative
        decoding runs its own step (executor/speculative/decoder.py). `prev`: the previous step's result on the
        device, which a step launched ahead of it (`step.prev_token_rows`) reads (executor/ahead.py)."""
        if (step.prev_token_rows is None) != (prev is None):
            raise ValueError("a step reads the previous step's result exactly when it is given it")
        if self.drafter is not None:
            return self.drafter.execute(step, prev)
        if self.graphs is not None and self.graphs.supports(step):
            return self.graphs.execute(step, None if prev is None else prev.token_ids)
        step = self.on_device(step, prev)
        hidden = self.forward(step)
        if step.logits_indices is None or step.logits_indices.numel() == 0:
            return None
        logits = self.model.compute_logits(hidden[step.logits_indices])
        if logits is None or step.sampling is None:
            return None
        return self.sampler(logits, step.sampling)

    def on_device(self, step: StepInput, prev: SamplerOutput | None) -> StepInput:
        """The step on the runner's device for an eager run; launched ahead, completed from `prev` (its own copy:
        the host's step stays as built)."""
        step = step.to(self.device, non_blocking=True, copy=prev is not None)
        if prev is not None:
            follow_previous(step, prev, step.prev_token_rows, self.cache.block_size, step.num_seqs)
        return step
