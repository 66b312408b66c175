"""The serving engine: paged KV cache, block manager, scheduler, model runner, sampler, engines.

Imports are lazy so that `import m3serve.engine.sampling_params` (the Triton stub, the CLI) stays light."""
from m3serve.engine.outputs import RequestOutput
from m3serve.engine.sampling_params import InvalidRequest, SamplingParams

__all__ = ["AsyncLLMEngine", "EngineDeadError", "InvalidRequest", "LLMEngine", "RequestOutput", "SamplingParams"]


def __getattr__(name):
    if name in ("AsyncLLMEngine", "EngineDeadError"):
        from m3serve.engine import async_engine
        return getattr(async_engine, name)
    if name == "LLMEngine":
        from m3serve.engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
