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
  draft_vocab_size         N >= 1: the draft proposes from the first N ids of its checkpoint's `draft_vocab_ids`
                           (most frequent first) only, reading N lm_head rows instead of the vocabulary's; checked
                           at load (model/dspark_vocab.py). Absent or null: the whole vocabulary.
  confidence_threshold     0 (off) .. 1: verify only the drafts before the first one whose confidence-head score
                           falls below it (DeepSpec's static threshold; lossless). Needs a confidence head.
  confidence_scheduling    false (default) | true: before each step the engine picks one verify width for every
                           speculating sequence (1, 2, 3, 5 or K) from the sequences' previous confidences and the
                           step's cost (executor/speculative/confidence.py; lossless). Needs a confidence head.
  confidence_cost_table    [[tokens, step time], ...] (>= 2 points; required with confidence_scheduling): the
                           speculative step's time at that many verify tokens on this machine (bench_spec prints it
                           as `cost_table`).
  draft_backoff            0 (off, default) | N >= 1: a greedy request whose speculative step accepted none of its
                           drafts decodes plainly for its next N x 2^(f-1) tokens (f: such steps in a row; at most
                           16 N), then drafts again (engine/speculative_scheduling.py). Exact: greedy tokens do not
                           depend on the drafts. For replies whose drafts rarely hold (a few tokens of random digits),
                           where a step that accepts nothing costs more than a plain one (docs/performance.md).
  prefill_apart            true (default) | false: a step whose decodes draft takes no prefill chunk; the prefill
                           work runs in the next step, alone (engine/scheduler.py). Speculating decodes alone
                           replay the speculative CUDA graphs, where a mixed step runs every phase eagerly (on an
                           H100 with the learned model at batch 8: 1.52x plain decoding apart, 0.95x mixed;
                           docs/performance.md). Exact: the same tokens, in other steps.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence as Seq

import os
from dataclasses import dataclass, fields
from typing import Any

from m3serve.errors import ConfigError

METHODS = ("dspark",)
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")  # as executor/speculative/proposer.py
REJECTION_SAMPLE_METHODS = ("standard", "block")  # as executor/speculative/verify.py
DRAFT_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "bfloat16", "float16", "float32")
DEFAULT_DRAFT_SUBDIR = "dspark"



class CostTable:
    """Step time (any unit) at B verify tokens: piecewise linear through the points, linear past the last two."""

    def __init__(self, points: Seq[Seq[float]]):
        pts = sorted((float(b), float(t)) for b, t in points)
        if len(pts) < 2 or any(t <= 0 for _, t in pts) or len({b for b, _ in pts}) != len(pts):
            raise ValueError(f"cost table {points!r}: needs >= 2 points [tokens, time] with distinct tokens, time > 0")
        self.tokens, self.times = [b for b, _ in pts], [t for _, t in pts]

    def __call__(self, tokens: float) -> float:
        b, t = self.tokens, self.times
        if tokens <= b[0]:
            return t[0]
        i = min(bisect.bisect_left(b, tokens), len(b) - 1)
        slope = (t[i] - t[i - 1]) / (b[i] - b[i - 1])
        return max(min(t), t[i - 1] + slope * (tokens - b[i - 1]))


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
    confidence_scheduling: bool = False
    confidence_cost_table: list | None = None
    draft_vocab_size: int | None = None
    draft_backoff: int = 0
    prefill_apart: bool = True

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
        n = g("draft_vocab_size")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            bad("draft_vocab_size", f"must be an integer >= 1 (or null: the whole vocabulary), got {n!r}")
        b = g("draft_backoff", 0)
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            bad("draft_backoff", f"must be an integer >= 0 (0: off), got {b!r}")
        thr = g("confidence_threshold", 0.0)
        if isinstance(thr, bool) or not isinstance(thr, (int, float)) or not 0.0 <= thr < 1.0:
            bad("confidence_threshold", f"must be a number in [0, 1), got {thr!r}")
        for key in ("confidence_scheduling", "prefill_apart"):
            if not isinstance(g(key, getattr(cls, key)), bool):
                bad(key, f"must be true or false, got {g(key)!r}")
        table = g("confidence_cost_table")
        if g("confidence_scheduling") is True and table is None:
            bad("confidence_cost_table", "confidence_scheduling needs the step-cost table measured on this machine "
                "(benchmarks/bench_spec.py prints one)")
        if table is not None:
            try:
                if not all(isinstance(p, (list, tuple)) and len(p) == 2 and not any(isinstance(v, bool) for v in p)
                           for p in table):
                    raise ValueError("each point must be [tokens, step time]")
                CostTable(table)
            except (TypeError, ValueError) as e:
                bad("confidence_cost_table", str(e))
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
