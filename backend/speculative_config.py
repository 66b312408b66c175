"""`speculative_config`: the engine option that turns DSpark speculative decoding on, under vLLM's names, so a
published launch line moves over unchanged (design/m3.1-flash.md):

    {"method": "dspark", "num_speculative_tokens": 7, "attention_backend": "FLASHINFER_TS",
     "kv_cache_dtype": "fp8", "draft_sample_method": "probabilistic"}

Keys:
  method                   "dspark" (the only method)
  num_speculative_tokens   K >= 1 drafted tokens per step (at most the draft's block_size; checked at load)
  draft_sample_method      "greedy" (vLLM's default: argmax drafts) | "probabilistic" (drafts drawn from the
                           draft's distribution under the request's temperature / top-k / top-p / min-p)
  rejection_sample_method  "standard" (token-level rejection sampling, default) | "block" (block verification)
  kv_cache_dtype           the draft's context cache: "auto" (the model dtype) | "fp8" | "fp8_e4m3" | "bfloat16" |
                           "float16" | "float32"
  attention_backend        accepted and recorded (the draft's context attention: the paged decode kernel on CUDA)
  model                    the draft checkpoint directory (default: <model>/dspark)
  confidence_threshold     0 (off) .. 1: verify only the drafts before the first one whose confidence-head score
                           falls below it (DeepSpec's static threshold; lossless). Needs a confidence head.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from m3serve.errors import ConfigError

METHODS = ("dspark",)
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")  # as executor/speculative/proposer.py
REJECTION_SAMPLE_METHODS = ("standard", "block")  # as executor/speculative/verify.py
DRAFT_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "bfloat16", "float16", "float32")
DEFAULT_DRAFT_SUBDIR = "dspark"


@dataclass
class SpeculativeConfig:
    method: str = "dspark"
    num_speculative_tokens: int = 0
    draft_sample_method: str = "greedy"
    rejection_sample_method: str = "standard"
    kv_cache_dtype: str = "auto"
    attention_backend: str | None = None
    model: str | None = None
    confidence_threshold: float = 0.0

    @classmethod
    def problems(cls, raw: Any) -> list[str]:
        """Every problem of a `speculative_config` value, each naming its key (empty: valid)."""
        if not isinstance(raw, dict):
            return [f"speculative_config: must be a JSON object, got {type(raw).__name__}"]
        known = {f.name for f in fields(cls)}
        out = [f"speculative_config: unknown key(s) {sorted(set(raw) - known)} (known: {sorted(known)})"
               ] if set(raw) - known else []
        g = raw.get

        def bad(key: str, msg: str) -> None:
            out.append(f"speculative_config.{key}: {msg}")

        if g("method") not in METHODS:
            bad("method", f"{g('method')!r} is not supported (only {list(METHODS)})")
        k = g("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            bad("num_speculative_tokens", f"must be an integer >= 1, got {k!r}")
        for key, allowed in (("draft_sample_method", DRAFT_SAMPLE_METHODS),
                             ("rejection_sample_method", REJECTION_SAMPLE_METHODS),
                             ("kv_cache_dtype", DRAFT_KV_CACHE_DTYPES)):
            if key in raw and raw[key] not in allowed:
                bad(key, f"{raw[key]!r} is not one of {list(allowed)}")
        for key in ("attention_backend", "model"):
            if g(key) is not None and not (isinstance(g(key), str) and g(key)):
                bad(key, f"must be a non-empty string, got {g(key)!r}")
        thr = g("confidence_threshold", 0.0)
        if isinstance(thr, bool) or not isinstance(thr, (int, float)) or not 0.0 <= thr < 1.0:
            bad("confidence_threshold", f"must be a number in [0, 1), got {thr!r}")
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "SpeculativeConfig":
        problems = cls.problems(raw)
        if problems:
            raise ConfigError("; ".join(problems))
        return cls(**{**raw, "confidence_threshold": float(raw.get("confidence_threshold", 0.0))})

    def draft_dir(self, model_dir: str) -> str:
        """The draft checkpoint directory: `model`, else <model>/dspark."""
        if self.model is None:
            return os.path.join(model_dir, DEFAULT_DRAFT_SUBDIR)
        return os.path.expanduser(self.model)
