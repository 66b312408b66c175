"""A worker: one device's model, page pool and model runner. It receives `StepInput`s and returns sampled tokens
as host tensors; it holds no request state (that lives in the engine), so it can run in another process. With
tensor parallelism it is one rank (`parallel`): its shard of the model, its KV heads' pages; only rank 0 samples."""
from __future__ import annotations

import logging
import time

import torch

from m3serve.config import EngineConfig, ModelConfig, normalize_kv_dtype
from m3serve.distributed.parallel import Parallel
from m3serve.step_io import SamplerOutput, StepInput
from m3serve.executor.cuda_graph import graph_reserve_bytes
from m3serve.executor.piecewise import piecewise_reserve_bytes
from m3serve.kernels.dispatch import plain_pages_reserve_bytes
from m3serve.model.kv_cache import PagedKVCache, determine_num_pages
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
    def __init__(self, config: EngineConfig, model_config: ModelConfig, *, model=None, load_report=None,
                 parallel: Parallel | None = None, device: torch.device | None = None):
        self.config, self.model_config = config, model_config
        self.parallel = parallel or getattr(model, "parallel", None) or Parallel()  # a given model: its shard
        if model is None:
            from m3serve.model.loader import load_model
            self.device = device if device is not None else resolve_device(config.device)
            if self.device.type == "cuda" and self.device.index is not None:
                torch.cuda.set_device(self.device)
            dtype = resolve_dtype(config.dtype, model_config.dtype, self.device)
            model, load_report = load_model(config.model, self.device, dtype, model_config, progress=False,
                                            parallel=self.parallel)
        else:
            self.device = next(model.parameters()).device
        self.model, self.load_report = model, load_report
        model.prepare_for_inference()  # fused QKV GEMM, each linear / MoE layer's method for this device
        dtype_name = str(model.dtype).replace("torch.", "")
        self.kv_dtype = normalize_kv_dtype(config.kv_cache_dtype, dtype_name)
        idx = config.indexer_kv_dtype
        self.index_dtype = self.kv_dtype if idx == "auto" else normalize_kv_dtype(idx, dtype_name)
        kv0, kv1 = self.parallel.split_heads(model_config.num_key_value_heads, "num_key_value_heads")
        self.num_kv_heads = kv1 - kv0
        self.cache: PagedKVCache | None = None
        self.runner: ModelRunner | None = None
        self.drafter = None  # the DSpark draft and its speculative step (executor/speculative/decoder.py)
        self.warmup = None  # the warm-up's report (executor/warmup.py), CUDA only
        speculative = config.speculative
        if speculative is not None:
            from m3serve.executor.speculative.decoder import SpeculativeDecoder
            self.drafter = SpeculativeDecoder(speculative, config.model, model)

    @property
    def use_cuda_graphs(self) -> bool:
        """Decode graphs on CUDA unless enforce_eager, with tensor parallelism too (every rank captures the same
        graphs in the same order at `init_cache`, their all-reduces inside: NCCL calls are capturable); not with
        speculative decoding (every step also feeds the draft: its own graphs, `use_speculative_graphs`). gloo (CPU)
        steps run eagerly."""
        return self._graphs_allowed and self.drafter is None

    @property
    def use_speculative_graphs(self) -> bool:
        """With speculative decoding, its steps' graphs (executor/speculative/graphs.py) where decode graphs would be; on one
        GPU only (under tensor parallelism speculative steps run eagerly)."""
        return self._graphs_allowed and self.drafter is not None and self.parallel.size == 1

    @property
    def piecewise_tokens(self) -> int:
        """The largest prefill / mixed step the piecewise graphs serve (executor/piecewise.py): CUDA graphs on,
        no speculative decoding (its steps run the model their own way); 0: none."""
        c = self.config
        return min(c.piecewise_graph_tokens, c.max_num_batched_tokens) if self.use_cuda_graphs else 0

    @property
    def _graphs_allowed(self) -> bool:
        return self.device.type == "cuda" and not self.config.enforce_eager

    def determine_num_pages(self, max_model_len: int) -> int:
        c, m = self.config, self.model_config
        reserve = graph_reserve_bytes(c.max_num_seqs, m.hidden_size, m.vocab_size) if self.use_cuda_graphs else 0
        reserve += piecewise_reserve_bytes(self.piecewise_tokens, m.hidden_size)
        if self.device.type == "cuda":  # the MSA prefill kernel's fp16 copies of long chunks' quantized pages
            reserve += plain_pages_reserve_bytes(self.kv_dtype in ("nvfp4", "fp8"))
        draft_page = 0
        if self.drafter is not None:
            reserve += self.drafter.reserve_bytes(c.max_num_seqs)
            if self.use_speculative_graphs:  # a graphed step's pool: the forward of max_num_seqs x (K + 1) tokens
                k = self.drafter.config.num_speculative_tokens
                reserve += graph_reserve_bytes(c.max_num_seqs * (k + 1), m.hidden_size, m.vocab_size)
            draft_page = self.drafter.page_bytes(m.index_block_size)
        return determine_num_pages(
            m, self.kv_dtype, self.index_dtype, self.device,
            gpu_memory_utilization=c.gpu_memory_utilization, num_gpu_blocks_override=c.num_gpu_blocks_override,
            max_model_len=max_model_len, max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
            num_kv_heads=self.num_kv_heads, reserved_bytes=reserve, extra_page_bytes=draft_page)

    def init_cache(self, num_pages: int, max_model_len: int) -> None:
        """The page pool, the model runner, (CUDA, unless enforce_eager) its decode graphs, and (CUDA) the warm-up
        that compiles every kernel a served step can reach (executor/warmup.py)."""
        kv_scales = getattr(self.load_report, "kv_scales", None) or {}
        self.cache = PagedKVCache(self.model_config, num_pages, self.kv_dtype, self.index_dtype, self.device, kv_scales,
                                  num_kv_heads=self.num_kv_heads)
        self.runner = ModelRunner(self.model, self.cache, self.device)
        if self.drafter is not None:
            self.drafter.attach(self.runner, num_pages)
            if self.use_speculative_graphs:
                self.drafter.enable_graphs(self.config.max_num_seqs, max_model_len)
        if self.use_cuda_graphs:
            self.runner.capture_graphs(self.config.max_num_seqs, max_model_len)
        from m3serve.executor.warmup import warm_up  # every kernel a served step can reach, compiled now
        self.warmup = warm_up(self.runner, self.config, max_model_len, self.parallel.rank)
        if self.piecewise_tokens:
            self.runner.capture_piecewise(self.piecewise_tokens)

    def execute(self, step: StepInput, timeout_s: float | None = None) -> SamplerOutput | None:
        """The sampled tokens on the host (None when the step samples nothing, and on ranks other than 0). With
        `timeout_s` on CUDA, a step whose device work does not finish in time (a hung peer) raises TimeoutError."""
        out = self.runner.execute(step)
        if out is None:
            return None
        if timeout_s is not None and self.device.type == "cuda":
            _wait_device(timeout_s)
        return out.to("cpu")

    def launch(self, step: StepInput, prev: SamplerOutput | None = None) -> "PendingOutput":
        """Queue the step on the device and return at once (async scheduling): its tokens reach the host when
        `result()` is called. `prev`: the device result of the step launched before, which this step reads through
        `step.prev_token_rows` (executor/ahead.py)."""
        return PendingOutput(self.runner.execute(step, prev))


class PendingOutput:
    """A launched step's sampled tokens: on the device at once (`device`: what the next step may read as its input
    ids), on the host once `result()` returns (the copy is queued behind the step; `result` waits for it alone)."""

    def __init__(self, device_out: SamplerOutput | None):
        self.device = device_out
        self._host, self._done = device_out, None
        if device_out is not None and device_out.token_ids.is_cuda:
            self._host = device_out.to("cpu", non_blocking=True)  # into page-locked memory
            self._done = torch.cuda.Event()
            self._done.record()

    @classmethod
    def ready(cls, host_out: SamplerOutput | None) -> "PendingOutput":
        """An output already on the host (an executor that runs each step to completion)."""
        return cls(host_out)

    def result(self) -> SamplerOutput | None:
        if self._done is not None:
            self._done.synchronize()
            self._done = None
        return self._host


def _wait_device(timeout_s: float) -> None:
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + timeout_s
    while not done.query():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the step's device work did not finish within {timeout_s:.0f} s (a tensor-parallel "
                               "peer hangs?)")
        time.sleep(50e-6)
