"""m3serve: serving the MiniMax-M3 model family on Triton Inference Server."""
from m3serve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name):  # lazy: importing m3serve stays light for the Triton stub and the CLI
    if name == "LLM":
        from m3serve.llm import LLM
        return LLM
    raise AttributeError(name)
