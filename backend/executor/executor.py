"""The engine's view of its workers: set up the model and the page pool on every device, run each step on all
of them, hand back rank 0's sampled tokens. One worker in this process (`UniprocExecutor`), or with
tensor_parallel_size > 1 rank 0 here and worker processes for the other ranks (`multiproc_executor.py`)."""
from __future__ import annotations

from m3serve.config import EngineConfig, ModelConfig
from m3serve.step_io import SamplerOutput, StepInput
from m3serve.executor.worker import PendingOutput, Worker


class Executor:
    """`num_pages` (every rank's pool holds that many pages) is known once the constructor returns."""

    num_pages: int
    pin_memory: bool = False  # step inputs are built in pinned host memory (copied to a CUDA device without a sync)
    supports_async_scheduling: bool = False  # `launch` returns before the step's tokens are back, and a step may
    #   read the previous step's result on the device (`StepInput.prev_token_rows`). Not with tensor parallelism
    #   (multiproc_executor.py): a rank's step would need rank 0's result, which only rank 0 has

    def execute(self, step: StepInput) -> SamplerOutput | None:
        raise NotImplementedError

    def launch(self, step: StepInput, prev: SamplerOutput | None = None) -> PendingOutput:
        """Start the step; its tokens come from the returned object's `result()`. Here: run it to completion."""
        if prev is not None:
            raise ValueError("this executor does not take a step's inputs from the previous step's result")
        return PendingOutput.ready(self.execute(step))

    def check_health(self) -> None:
        """Raise if a worker is gone (the engine then reports itself dead)."""

    def shutdown(self) -> None:
        """Release the workers (idempotent)."""


class UniprocExecutor(Executor):
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int, *, model=None,
                 load_report=None):
        self.worker = Worker(config, model_config, model=model, load_report=load_report)
        w = self.worker
        self.num_pages = w.determine_num_pages(max_model_len)
        w.init_cache(self.num_pages, max_model_len)
        # speculative steps that replay graphs read the step on the host into their own page-locked buffers
        # (executor/speculative/graphs.py): pinning the step's tensors first would only add a host copy of each
        self.pin_memory = w.device.type == "cuda" and not w.use_speculative_graphs
        self.supports_async_scheduling = True

    def execute(self, step: StepInput) -> SamplerOutput | None:
        return self.worker.execute(step)

    def launch(self, step: StepInput, prev: SamplerOutput | None = None) -> PendingOutput:
        return self.worker.launch(step, prev)

