"""The DSpark draft's configuration: DeepSeek's `config.json` format (DeepSpec `Qwen3DSparkModel`), read
against the target it drafts for (design/dspark.md 1.7).

A draft config copies the target's fields and adds the DSpark ones: `num_hidden_layers` (draft depth),
`block_size` (gamma), `target_layer_ids`, `mask_token_id`, `markov_rank`, `markov_head_type`,
`enable_confidence_head`, `confidence_head_with_markov`, `layer_types`, `num_target_layers`.

Decisions marked [I] in design/dspark.md, made here:
- A MiniMax-M3-family draft is shaped like DeepSpec's Qwen3 draft: dense decoder layers (QK-norm GQA
  attention, SiLU-gated MLP, plain `x * w` RMSNorm), full attention over the context, a bidirectional
  block. Any geometry field the draft config leaves out (heads, KV heads, head_dim, RoPE theta and
  partial factor, eps) is the target's, so by default the draft has the target's attention widths; the
  MLP width falls back to the target's dense-MLP width. `rms_norm_unit_offset: true` switches the draft's
  norms to the target's Gemma-style `x * (1 + w)`; `hidden_act: "swiglu_oai"` to the target's MLP.
- The tapped layers: `m = fc.weight.shape[1] / hidden` is the truth. Layer ids follow the HF convention
  (`l` = output of decoder layer `l`, `-1` = the embedding output); id `num_target_layers - 1` is HF's
  last hidden state, which is post-norm, i.e. the target forward's return value. A checkpoint whose `m`
  is one more than its ids (speculators' "implicit final layer") gets that final id appended.
- Sliding layers (`layer_types` "sliding_attention", `sliding_window`) see context positions
  `[t - W, t)` and a causal block unless `sliding_window_non_causal` is set (speculators' convention).
- No `d2t` reduced draft vocabulary (an EAGLE-3-style lm_head of N rows), no attention biases, no Gemma4 flavour:
  refused by name. A draft vocabulary in this project's own form is the checkpoint tensor `draft_vocab_ids`, used
  with `speculative_config.draft_vocab_size` (model/dspark_vocab.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from m3serve.config import ConfigError, ModelConfig

ARCHITECTURES = ("Qwen3DSparkModel", "DSparkModel", "MiniMaxM3DSparkModel")
MARKOV_TYPES = ("vanilla", "gated", "rnn")
FULL, SLIDING = "full_attention", "sliding_attention"
ACTIVATIONS = ("silu", "swiglu_oai")


@dataclass
class DSparkConfig:
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int  # draft layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int  # gamma: block slots = drafts per backbone pass (sample-from-anchor)
    target_layer_ids: list[int]
    num_target_layers: int
    mask_token_id: int
    markov_rank: int = 256  # 0 = no Markov head (pure DFlash)
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    partial_rotary_factor: float = 1.0
    hidden_act: str = "silu"
    rms_norm_unit_offset: bool = False
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    sliding_window_non_causal: bool = False
    swiglu_alpha: float = 1.702  # only for hidden_act "swiglu_oai" (the target's values)
    swiglu_limit: float = 7.0
    architecture: str = "Qwen3DSparkModel"

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = [FULL] * self.num_hidden_layers
        self.validate()

    @property
    def num_taps(self) -> int:
        """m: tapped target layers per context row (fc takes m * hidden features)."""
        return len(self.target_layer_ids)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def attention_window(self, layer: int) -> tuple[int | None, bool]:
        """(context window W or None, causal block) of draft layer `layer`."""
        if self.layer_types[layer] == SLIDING:
            return self.sliding_window, not self.sliding_window_non_causal
        return None, False

    def validate(self) -> None:
        problems = []
        if self.num_hidden_layers < 1:
            problems.append(f"num_hidden_layers must be >= 1, got {self.num_hidden_layers}")
        if self.block_size < 1:
            problems.append(f"block_size must be >= 1, got {self.block_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            problems.append(f"rotary dim {self.rotary_dim} must be even and in (0, head_dim]")
        if not 0 <= self.mask_token_id < self.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} is outside the vocabulary ({self.vocab_size})")
        if self.markov_rank < 0:
            problems.append(f"markov_rank must be >= 0, got {self.markov_rank}")
        if self.markov_rank and self.markov_head_type not in MARKOV_TYPES:
            problems.append(f"markov_head_type {self.markov_head_type!r} is not one of {list(MARKOV_TYPES)}")
        if self.enable_confidence_head and self.confidence_head_with_markov and not self.markov_rank:
            problems.append("confidence_head_with_markov needs a Markov head (markov_rank > 0)")
        if self.hidden_act not in ACTIVATIONS:
            problems.append(f"hidden_act {self.hidden_act!r} is not one of {list(ACTIVATIONS)}")
        if len(self.layer_types) != self.num_hidden_layers:
            problems.append(f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is "
                            f"{self.num_hidden_layers}")
        bad = sorted({t for t in self.layer_types if t not in (FULL, SLIDING)})
        if bad:
            problems.append(f"unknown layer_types {bad} (expected {FULL!r} or {SLIDING!r})")
        if SLIDING in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
            problems.append("sliding_attention layers need a positive sliding_window")
        ids = self.target_layer_ids
        if not ids:
            problems.append("target_layer_ids is empty")
        elif any(b <= a for a, b in zip(ids, ids[1:])):
            problems.append(f"target_layer_ids {ids} must be strictly increasing")
        elif ids[0] < -1 or ids[-1] >= self.num_target_layers:
            problems.append(f"target_layer_ids {ids} must lie in -1..{self.num_target_layers - 1} "
                            f"(num_target_layers={self.num_target_layers})")
        if problems:
            raise ConfigError("DSpark draft config: " + "; ".join(problems))

    # ---- reading ------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], target: ModelConfig) -> "DSparkConfig":
        """A DeepSeek-format draft config, completed from (and checked against) the target's config."""
        d = dict(raw)
        if d.get("speculators_model_type") or "speculators_config" in d:
            raise ConfigError("DSpark draft config: the speculators format is not supported; use the DeepSeek "
                              "(DeepSpec) format")
        archs = d.get("architectures") or ["Qwen3DSparkModel"]
        if archs[0] not in ARCHITECTURES:
            raise ConfigError(f"DSpark draft config: architecture {archs[0]!r} is not supported "
                              f"(supported: {list(ARCHITECTURES)})")
        for key, why in (("d2t", "a reduced draft vocabulary"), ("draft_vocab_size", "a reduced draft vocabulary"),
                         ("attention_bias", "attention biases")):
            if d.get(key) not in (None, False) and not (key == "draft_vocab_size" and d[key] == target.vocab_size):
                raise ConfigError(f"DSpark draft config: {key} ({why}) is not supported")
        missing = [k for k in ("block_size", "target_layer_ids", "mask_token_id") if d.get(k) is None]
        if missing:
            raise ConfigError(f"DSpark draft config: missing field(s) {missing}")
        for key in ("hidden_size", "vocab_size"):
            if d.get(key, getattr(target, key)) != getattr(target, key):
                raise ConfigError(f"DSpark draft config: {key} {d[key]} differs from the target's "
                                  f"{getattr(target, key)} (the embedding and lm_head are the target's)")
        n_target = int(d.get("num_target_layers") or target.num_hidden_layers)
        if n_target != target.num_hidden_layers:
            raise ConfigError(f"DSpark draft config: num_target_layers {n_target} differs from the target's "
                              f"{target.num_hidden_layers} layers")
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ConfigError(f"DSpark draft config: rope_type {rope.get('rope_type', rope.get('type'))!r} "
                              "is not supported (only 'default')")

        def pick(key: str, fallback: Any) -> Any:
            v = d.get(key)
            return fallback if v is None else v

        return cls(
            hidden_size=target.hidden_size, vocab_size=target.vocab_size,
            num_hidden_layers=int(d.get("num_hidden_layers") or 1),
            num_attention_heads=int(pick("num_attention_heads", target.num_attention_heads)),
            num_key_value_heads=int(pick("num_key_value_heads", target.num_key_value_heads)),
            head_dim=int(pick("head_dim", target.head_dim)),
            intermediate_size=int(pick("intermediate_size", target.dense_intermediate_size)),
            block_size=int(d["block_size"]),
            target_layer_ids=[int(i) for i in d["target_layer_ids"]],
            num_target_layers=n_target,
            mask_token_id=int(d["mask_token_id"]),
            markov_rank=int(pick("markov_rank", 0)),
            markov_head_type=str(pick("markov_head_type", "vanilla")).lower(),
            enable_confidence_head=bool(pick("enable_confidence_head", False)),
            confidence_head_with_markov=bool(pick("confidence_head_with_markov", False)),
            rms_norm_eps=float(pick("rms_norm_eps", target.rms_norm_eps)),
            rope_theta=float(rope.get("rope_theta", pick("rope_theta", target.rope_theta))),
            partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                                 pick("partial_rotary_factor", target.partial_rotary_factor))),
            hidden_act=str(pick("hidden_act", "silu")),
            rms_norm_unit_offset=bool(pick("rms_norm_unit_offset", False)),
            layer_types=list(pick("layer_types", [])),
            sliding_window=d.get("sliding_window"),
            sliding_window_non_causal=bool(pick("sliding_window_non_causal", False)),
            swiglu_alpha=float(pick("swiglu_alpha", target.swiglu_alpha)),
            swiglu_limit=float(pick("swiglu_limit", target.swiglu_limit)),
            architecture=archs[0],
        )

    def with_taps_from_fc(self, fc_in_features: int) -> "DSparkConfig":
        """Check (and complete) the tapped layers against `fc.weight.shape[1]`, the checkpoint's truth."""
        h = self.hidden_size
        if fc_in_features % h:
            raise ConfigError(f"DSpark draft: fc.weight has {fc_in_features} input features, not a multiple of "
                              f"hidden_size {h}")
        m, ids = fc_in_features // h, list(self.target_layer_ids)
        last = self.num_target_layers - 1
        if m == len(ids) + 1 and ids[-1] < last:  # speculators' implicit final layer
            ids.append(last)
        if m != len(ids):
            raise ConfigError(f"DSpark draft: fc.weight takes {m} tapped layers (shape[1] {fc_in_features} / "
                              f"hidden {h}) but target_layer_ids lists {len(self.target_layer_ids)}: "
                              f"{self.target_layer_ids}")
        self.target_layer_ids = ids
        self.validate()
        return self

    def to_dict(self) -> dict[str, Any]:
        """A DeepSeek-format `config.json` (what `make-tiny` writes)."""
        return {
            "architectures": [self.architecture], "model_type": "qwen3",
            "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size, "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "partial_rotary_factor": self.partial_rotary_factor, "attention_bias": False,
            "tie_word_embeddings": False, "block_size": self.block_size,
            "target_layer_ids": list(self.target_layer_ids), "num_target_layers": self.num_target_layers,
            "mask_token_id": self.mask_token_id, "markov_rank": self.markov_rank,
            "markov_head_type": self.markov_head_type, "enable_confidence_head": self.enable_confidence_head,
            "confidence_head_with_markov": self.confidence_head_with_markov,
            "layer_types": list(self.layer_types), "sliding_window": self.sliding_window,
            "rms_norm_unit_offset": self.rms_norm_unit_offset, "num_anchors": 512,
        }
