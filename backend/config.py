"""Model configuration (HF `config.json`, presets) and engine options (vLLM names)."""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from m3serve.errors import ConfigError

log = logging.getLogger(__name__)

SPARSE = "minimax_m3_sparse"
FULL = "full_attention"
GREEDY_TEMPERATURE = 1e-5  # a temperature below this is greedy (argmax): sampling params and the sampler
TEXT_MODEL_TYPES = ("minimax_m3_vl_text", "minimax_m3_text", "minimax_m3")
VL_MODEL_TYPES = ("minimax_m3_vl",)

# legacy `sparse_attention_config` keys -> flat names (transformers 5.25 MiniMaxM3VLTextConfig.__post_init__)
_LEGACY_SPARSE = {
    "index_n_heads": "sparse_num_index_heads",
    "index_head_dim": "sparse_index_dim",
    "index_block_size": "sparse_block_size",
    "index_topk_blocks": "sparse_topk_blocks",
    "index_local_blocks": "sparse_local_block",
}


@dataclass
class ModelConfig:
    """The MiniMax-M3 text backbone. Defaults are transformers 5.25's `MiniMaxM3VLTextConfig` defaults."""

    vocab_size: int = 200064
    hidden_size: int = 6144
    intermediate_size: int = 3072  # routed expert FFN
    num_hidden_layers: int = 60
    num_attention_heads: int = 64
    num_key_value_heads: int = 4
    head_dim: int = 128
    max_position_embeddings: int = 524288
    rms_norm_eps: float = 1e-6
    bos_token_id: int | None = 200034
    eos_token_id: list[int] = field(default_factory=lambda: [200020])
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False
    num_experts_per_tok: int = 4
    num_local_experts: int = 128
    rope_theta: float = 5_000_000.0
    partial_rotary_factor: float = 1.0
    dense_intermediate_size: int = 12288
    shared_intermediate_size: int = 3072
    routed_scaling_factor: float = 2.0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    mlp_layer_types: list[str] = field(default_factory=list)  # "sparse" (MoE) | "dense"
    layer_types: list[str] = field(default_factory=list)  # "minimax_m3_sparse" | "full_attention"
    index_n_heads: int = 4
    index_head_dim: int = 128
    index_block_size: int = 128
    index_topk_blocks: int = 16
    index_local_blocks: int = 1
    num_mtp_modules: int = 0
    dtype: str = "bfloat16"  # checkpoint dtype
    quantization_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.eos_token_id, int):
            self.eos_token_id = [self.eos_token_id]
        self.eos_token_id = list(self.eos_token_id or [])
        if not self.layer_types:
            self.layer_types = [FULL] * self.num_hidden_layers
        if not self.mlp_layer_types:
            self.mlp_layer_types = ["sparse"] * self.num_hidden_layers
        self.validate()

    # ---- derived geometry -------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_sparse_layers(self) -> int:
        return sum(t == SPARSE for t in self.layer_types)

    @property
    def num_moe_layers(self) -> int:
        return sum(t == "sparse" for t in self.mlp_layer_types)

    def is_sparse_attention(self, layer: int) -> bool:
        return self.layer_types[layer] == SPARSE

    def is_moe(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == "sparse"

    def validate(self) -> None:
        n = self.num_hidden_layers
        if len(self.layer_types) != n:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is {n}")
        if len(self.mlp_layer_types) != n:
            raise ConfigError(f"mlp_layer_types has {len(self.mlp_layer_types)} entries, num_hidden_layers is {n}")
        bad = {t for t in self.layer_types if t not in (SPARSE, FULL)}
        if bad:
            raise ConfigError(f"unknown layer_types {sorted(bad)} (expected {SPARSE!r} or {FULL!r})")
        bad = {t for t in self.mlp_layer_types if t not in ("sparse", "dense")}
        if bad:
            raise ConfigError(f"unknown mlp_layer_types {sorted(bad)} (expected 'sparse' or 'dense')")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_sparse_layers and self.index_n_heads != self.num_key_value_heads:
            raise ConfigError(
                f"index_n_heads ({self.index_n_heads}) must equal num_key_value_heads "
                f"({self.num_key_value_heads}): index head h selects blocks for KV head h"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ConfigError(f"rotary dim {self.rotary_dim} must be even and in (0, head_dim]")
        if self.num_experts_per_tok > self.num_local_experts:
            raise ConfigError("num_experts_per_tok exceeds num_local_experts")

    # ---- reading HF configs -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        d = dict(raw)
        model_type = d.get("model_type")
        quant = d.get("quantization_config")
        if model_type in VL_MODEL_TYPES or "text_config" in d:
            d = dict(d.get("text_config") or {})
            quant = d.get("quantization_config", quant)
        elif model_type is not None and model_type not in TEXT_MODEL_TYPES:
            raise ConfigError(f"model_type {model_type!r} is not a MiniMax-M3 model")

        sparse_cfg = d.pop("sparse_attention_config", None) or {}
        for flat, legacy in _LEGACY_SPARSE.items():
            if legacy in sparse_cfg:
                d[flat] = sparse_cfg[legacy]
        if not d.get("layer_types") and "sparse_attention_freq" in sparse_cfg:
            d["layer_types"] = [SPARSE if f else FULL for f in sparse_cfg["sparse_attention_freq"]]
        moe_freq = d.pop("moe_layer_freq", None)
        if not d.get("mlp_layer_types") and moe_freq is not None:
            d["mlp_layer_types"] = ["sparse" if f else "dense" for f in moe_freq]
        if sparse_cfg.get("sparse_score_type", "max") != "max":
            raise ConfigError(f"sparse_score_type {sparse_cfg['sparse_score_type']!r} is not supported (only 'max')")
        if sparse_cfg.get("sparse_disable_index_value") is False:
            raise ConfigError("sparse_disable_index_value=false (an index-value branch) is not supported")

        # RoPE: rope_parameters first, then the legacy top-level keys, then defaults (as transformers does)
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"rope_type {rope_type!r} is not supported (only 'default')")
        theta = rope.get("rope_theta", d.get("rope_theta", cls.rope_theta))
        prf = rope.get("partial_rotary_factor", d.get("partial_rotary_factor"))
        head_dim = d.get("head_dim") or cls.head_dim  # transformers 5.25: an explicit 128, not hidden/heads
        if prf is None:
            # transformers 5.25 rotates the whole head when no partial_rotary_factor is given,
            # whatever `rotary_dim` says: follow the reference, but say so.
            prf = 1.0
            if d.get("rotary_dim") not in (None, head_dim):
                log.warning("config has rotary_dim=%s but no partial_rotary_factor: rotating all %d channels "
                            "as transformers 5.25 does", d.get("rotary_dim"), head_dim)
        elif d.get("rotary_dim") not in (None, int(head_dim * prf)):
            log.warning("rotary_dim=%s disagrees with partial_rotary_factor=%s; using the factor",
                        d.get("rotary_dim"), prf)

        dtype = d.get("dtype") or d.get("torch_dtype") or "bfloat16"
        known = {f for f in cls.__dataclass_fields__}
        kwargs = {k: v for k, v in d.items() if k in known}
        if "num_experts" in d and "num_local_experts" not in d:
            kwargs["num_local_experts"] = d["num_experts"]
        kwargs.update(rope_theta=float(theta), partial_rotary_factor=float(prf), head_dim=head_dim,
                      dtype=str(dtype).replace("torch.", ""), quantization_config=quant)
        if "eos_token_id" in kwargs and kwargs["eos_token_id"] is None:
            kwargs["eos_token_id"] = []
        return cls(**kwargs)

    @classmethod
    def from_pretrained(cls, model_dir: str) -> "ModelConfig":
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"no config.json in {model_dir}")
        with open(path) as f:
            raw = json.load(f)
        cfg = cls.from_dict(raw)
        hf_quant = os.path.join(model_dir, "hf_quant_config.json")
        if cfg.quantization_config is None and os.path.isfile(hf_quant):
            with open(hf_quant) as f:
                cfg.quantization_config = json.load(f)
        return cfg

    def to_hf_dict(self) -> dict[str, Any]:
        """A `config.json` that transformers 5.25 reads as `MiniMaxM3VLTextConfig`."""
        d = asdict(self)
        d.pop("rope_theta"), d.pop("partial_rotary_factor"), d.pop("num_mtp_modules")
        quant = d.pop("quantization_config")
        d.update(
            model_type="minimax_m3_vl_text",
            architectures=["MiniMaxM3VLForCausalLM"],
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta,
                             "partial_rotary_factor": self.partial_rotary_factor},
            rotary_dim=self.rotary_dim,
            eos_token_id=self.eos_token_id[0] if len(self.eos_token_id) == 1 else self.eos_token_id,
        )
        if quant:
            d["quantization_config"] = quant
        return d


def _m3_geometry(**over: Any) -> ModelConfig:
    n = 60
    base = dict(
        num_hidden_layers=n,
        partial_rotary_factor=0.5,
        layer_types=[FULL] * 3 + [SPARSE] * (n - 3),
        mlp_layer_types=["dense"] * 3 + ["sparse"] * (n - 3),
    )
    base.update(over)
    return ModelConfig(**base)


# The published M3 text geometry (formats.md section 4). M3.1-Flash shares it; what differs is the
# formats: NVFP4 routed experts, MXFP8 shared expert, NVFP4 KV and indexer keys.
PRESETS = {
    "minimax-m3": lambda: _m3_geometry(),
    "minimax-m3.1-flash": lambda: _m3_geometry(
        quantization_config={"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
                             "routed_experts": "NVFP4", "shared_experts": "MXFP8",
                             "kv_cache_quant_algo": "NVFP4"}),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}") from None


KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "nvfp4")  # the option's accepted values

# how cached K / V / index keys can be stored, with bytes per element, scales included (NVFP4: half a byte +
# one E4M3 scale per 16); float32 / float16 follow a float32 / float16 model under "auto"
KV_BYTES_PER_ELEMENT = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "fp8": 1.0, "nvfp4": 0.5 + 1.0 / 16}
CACHE_DTYPES = tuple(KV_BYTES_PER_ELEMENT)


def normalize_kv_dtype(name: str, model_dtype: str = "bfloat16") -> str:
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype {name!r} is not one of {list(KV_CACHE_DTYPES)}")
    if name == "auto":
        return "bfloat16" if model_dtype in ("bfloat16", "float16") else model_dtype
    return "fp8" if name == "fp8_e4m3" else name


def kv_bytes_per_token(cfg: ModelConfig, kv_cache_dtype: str) -> int:
    """Main K+V cache bytes per token over all layers (the indexer keys are counted separately)."""
    per_elt = KV_BYTES_PER_ELEMENT[kv_cache_dtype]
    return int(round(cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 * per_elt))


def indexer_bytes_per_token(cfg: ModelConfig, indexer_kv_dtype: str) -> int:
    per_elt = KV_BYTES_PER_ELEMENT[indexer_kv_dtype]
    return int(round(cfg.num_sparse_layers * cfg.index_head_dim * per_elt))


def page_count(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)


@dataclass
class EngineConfig:
    """Engine options under vLLM's names (model.json, `LLM(...)`, CLI `--max-num-seqs` ...)."""

    model: str = ""
    tokenizer: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    kv_cache_dtype: str = "auto"
    block_size: int | None = None  # must equal the model's index_block_size (the page is the MSA block)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True  # False: a prompt's prefill runs in one step (needs budget >= max_model_len)
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1  # > 1: rank 0 in the engine process, a worker process per other rank
    enable_expert_parallel: bool = False  # routed experts: E/N whole experts per rank instead of each one split
    attention_config: dict[str, Any] = field(default_factory=dict)  # {"indexer_kv_dtype": ...}
    speculative_config: dict[str, Any] | None = None  # DSpark: backend/speculative_config.py
    seed: int = 0
    enforce_eager: bool = False  # True: no CUDA graphs (decode steps launch their kernels one by one)
    async_scheduling: bool = True  # queue the next decode step before this one's tokens are back (llm_engine.py)
    # gathering arrivals while decodes run (engine/scheduler.py; TGI's max_waiting_tokens, waiting_served_ratio):
    # 0 admits each request at the first step it fits
    max_waiting_steps: int = 0
    waiting_served_ratio: float = 1.2
    # prompt tokens a step that decodes may take (engine/scheduler.py): 0 the whole max_num_batched_tokens
    max_prefill_tokens_with_decodes: int = 0
    # prefill and mixed steps of up to N tokens replay CUDA graphs captured piece by piece around the eager attention
    # (executor/piecewise.py; CUDA, without speculative decoding): 0 runs them eagerly. A mixed step of 64 decodes and
    # 64 prompt tokens took 10.8 against 12.1 ms eagerly (4-layer geometry, H100, 2026-12-07, docs/performance.md)
    piecewise_graph_tokens: int = 512
    num_gpu_blocks_override: int | None = None  # fixes the page-pool size (tests, CPU)
    reasoning_parser: str | None = None
    disable_hybrid_kv_cache_manager: bool = False  # accepted for launch-line compatibility (one pool anyway)
    quantization_config: dict[str, Any] | None = None  # accepted for launch-line compatibility

    SUPPORTED_ATTENTION_KEYS = ("indexer_kv_dtype", "indexer_decode_cp")

    def validate(self) -> None:
        """Raise ConfigError naming every option that is invalid or not supported yet."""
        problems = []
        if not self.model:
            problems.append("model: a model directory is required")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            problems.append(f"dtype: {self.dtype!r} is not one of auto, float32, bfloat16, float16")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            problems.append(f"device: {self.device!r} is not auto, cpu or cuda[:N]")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            problems.append(f"kv_cache_dtype: {self.kv_cache_dtype!r} is not one of {list(KV_CACHE_DTYPES)}")
        unknown = set(self.attention_config) - set(self.SUPPORTED_ATTENTION_KEYS)
        if unknown:
            problems.append(f"attention_config: unknown key(s) {sorted(unknown)}")
        idx = self.attention_config.get("indexer_kv_dtype", "auto")
        if idx not in KV_CACHE_DTYPES:
            problems.append(f"attention_config.indexer_kv_dtype: {idx!r} is not one of {list(KV_CACHE_DTYPES)}")
        if self.attention_config.get("indexer_decode_cp"):
            problems.append("attention_config.indexer_decode_cp: decode context parallelism is not supported yet")
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            problems.append(f"tensor_parallel_size: must be an integer >= 1, got {tp!r}")
        elif tp > 1 and str(self.device).startswith("cuda:"):
            problems.append(f"device: {self.device!r} names one GPU; with tensor_parallel_size={tp} use 'cuda' "
                            "(rank r runs on cuda:r; pick the GPUs with CUDA_VISIBLE_DEVICES)")
        for name in ("enable_expert_parallel", "enforce_eager", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name}: must be true or false, got {getattr(self, name)!r}")
        if self.speculative_config:  # None or {}: off
            from m3serve.speculative_config import SpeculativeConfig

            speculative_problems = SpeculativeConfig.problems(self.speculative_config)
            problems += speculative_problems
            k = self.speculative_config.get("num_speculative_tokens") if not speculative_problems else None
            if k is not None and self.max_num_batched_tokens < k + 1:
                problems.append(f"max_num_batched_tokens: {self.max_num_batched_tokens} cannot hold one speculative "
                                f"step (num_speculative_tokens + 1 = {k + 1})")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                problems.append(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("max_waiting_steps", "max_prefill_tokens_with_decodes", "piecewise_graph_tokens"):
            w = getattr(self, name)
            if not isinstance(w, int) or isinstance(w, bool) or w < 0:
                problems.append(f"{name}: must be an integer >= 0, got {w!r}")
        r = self.waiting_served_ratio
        if not isinstance(r, (int, float)) or isinstance(r, bool) or not r > 0:
            problems.append(f"waiting_served_ratio: must be a number > 0, got {r!r}")
        for name in ("max_model_len", "num_gpu_blocks_override", "block_size"):
            v = getattr(self, name)
            if v is not None and v < 1:
                problems.append(f"{name}: must be >= 1, got {v}")
        if self.reasoning_parser not in (None, "minimax_m3"):
            problems.append(f"reasoning_parser: {self.reasoning_parser!r} is not supported (only 'minimax_m3')")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            problems.append(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if problems:
            raise ConfigError("; ".join(problems))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EngineConfig":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown engine option(s): {unknown}")
        return cls(**d)

    @property
    def indexer_kv_dtype(self) -> str:
        return self.attention_config.get("indexer_kv_dtype", "auto")

    @property
    def speculative(self):
        """The parsed `speculative_config` (backend/speculative_config.py `SpeculativeConfig`), or None (off)."""
        if not self.speculative_config:
            return None
        from m3serve.speculative_config import SpeculativeConfig

        return SpeculativeConfig.from_dict(self.speculative_config)
