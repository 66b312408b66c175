"""A worker: one device's model, page pool and model runner. It receives `StepInput`s and returns sampled tokens
as host tensors; it holds no request state (that lives in the engine), so it can run in another process."""
from __future__ import annotations

import logging

import torch

from m3serve.config import EngineConfig, ModelConfig, normalize_kv_dtype
from m3serve.engine.step import SamplerOutput, StepInput
from m3serve.executor.cuda_graph import graph_reserve_bytes
from m3serve.executor.kv_cache import PagedKVCache, determine_num_pages
from m3serve.executor.model_runner import ModelRunner

log = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, model_dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        dtype = model_dtype if device.type == "cuda" else "float32"
    return getattr(torch, dtype)


class Worker:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, *, model=None, load_report=None):
        self.config, self.model_config = config, model_config
        if model is None:
            from m3serve.model.loader import load_model
            self.device = resolve_device(config.device)
            if self.device.type == "cuda" and self.device.index is not None:
                torch.cuda.set_device(self.device)
            dtype = resolve_dtype(config.dtype, model_config.dtype, self.device)
            model, load_report = load_model(config.model, self.device, dtype, model_config, progress=False)
        else:
            self.device = next(model.parameters()).device
        self.model, self.load_report = model, load_report
        model.prepare_for_inference()  # fused QKV GEMM, each linear / MoE layer's method for this device
        dtype_name = str(model.dtype).replace("torch.", "")
        self.kv_dtype = normalize_kv_dtype(config.kv_cache_dtype, dtype_name)
        idx = config.indexer_kv_dtype
        self.index_dtype = self.kv_dtype if idx == "auto" else normalize_kv_dtype(idx, dtype_name)
        self.cache: PagedKVCache | None = None
        self.runner: ModelRunner | None = None
        self.drafter = None  # the DSpark draft and its speculative step (executor/spec_decode.py)
        spec = config.speculative
        if spec is not None:
            from m3serve.executor.spec_decode import SpeculativeDecoder
            self.drafter = SpeculativeDecoder(spec, config.model, model)

    @property
    def use_cuda_graphs(self) -> bool:
        """Decode graphs: CUDA, not enforce_eager, no speculative decoding (its steps are multi-token, eager)."""
        return self.device.type == "cuda" and not self.config.enforce_eager and self.drafter is None

    def determine_num_pages(self, max_model_len: int) -> int:
        c, m = self.config, self.model_config
        reserve = graph_reserve_bytes(c.max_num_seqs, m.hidden_size, m.vocab_size) if self.use_cuda_graphs else 0
        draft_page = 0
        if self.drafter is not None:
            reserve += self.drafter.reserve_bytes(c.max_num_seqs)
            draft_page = self.drafter.page_bytes(m.index_block_size)
        return determine_num_pages(
            m, self.kv_dtype, self.index_dtype, self.device,
            gpu_memory_utilization=c.gpu_memory_utilization, num_gpu_blocks_override=c.num_gpu_blocks_override,
            max_model_len=max_model_len, max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
            reserved_bytes=reserve, extra_page_bytes=draft_page)

    def init_cache(self, num_pages: int, max_model_len: int) -> None:
        """The page pool, the model runner and (CUDA, unless enforce_eager) its decode graphs."""
        kv_scales = getattr(self.load_report, "kv_scales", None) or {}
        self.cache = PagedKVCache(self.model_config, num_pages, self.kv_dtype, self.index_dtype, self.device, kv_scales)
        self.runner = ModelRunner(self.model, self.cache, self.device)
        if self.drafter is not None:
            self.drafter.attach(self.runner, num_pages)
        if self.use_cuda_graphs:
            self.runner.capture_graphs(self.config.max_num_seqs, max_model_len)

    def execute(self, step: StepInput) -> SamplerOutput | None:
        out = self.runner.execute(step)
        return None if out is None else out.to("cpu")
