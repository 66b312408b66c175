"""The engine's view of its workers: set up the model and the page pool on every device, run each step on all
of them, hand back rank 0's sampled tokens. One worker in this process (`UniprocExecutor`), or with
tensor_parallel_size > 1 rank 0 here and worker processes for the other ranks (`multiproc_executor.py`)."""
from __future__ import annotations

from m3serve.config import EngineConfig, ModelConfig
from m3serve.engine.step import SamplerOutput, StepInput
from m3serve.executor.worker import Worker


class Executor:
    """`num_pages` (every rank's pool holds that many pages) is known once the constructor returns."""

    num_pages: int
    pin_memory: bool = False  # step inputs are built in pinned host memory (copied to a CUDA device without a sync)

    def execute(self, step: StepInput) -> SamplerOutput | None:
        raise NotImplementedError

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
        self.pin_memory = w.device.type == "cuda"

    def execute(self, step: StepInput) -> SamplerOutput | None:
        return self.worker.execute(step)


def create_executor(config: EngineConfig, model_config: ModelConfig, max_model_len: int, **kwargs) -> Executor:
    if config.tensor_parallel_size > 1:
        from m3serve.executor.multiproc_executor import MultiprocExecutor
        return MultiprocExecutor(config, model_config, max_model_len, **kwargs)
    return UniprocExecutor(config, model_config, max_model_len, **kwargs)
