"""The device side: executor -> worker(s) -> model runner. `create_executor` picks the executor for the config."""
from __future__ import annotations

from m3serve.config import EngineConfig, ModelConfig
from m3serve.executor.executor import Executor, UniprocExecutor


def create_executor(config: EngineConfig, model_config: ModelConfig, max_model_len: int, **kwargs) -> Executor:
    """One worker in this process, or with tensor_parallel_size > 1 worker processes for the other ranks."""
    if config.tensor_parallel_size > 1:
        from m3serve.executor.multiproc_executor import MultiprocExecutor
        return MultiprocExecutor(config, model_config, max_model_len, **kwargs)
    return UniprocExecutor(config, model_config, max_model_len, **kwargs)
