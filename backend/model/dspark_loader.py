"""Load a DSpark draft checkpoint (DeepSeek format, design/dspark.md 1.7) next to a loaded target.

- `config.json` + safetensors (sharded with an index, or not); never pickle.
- Tensor names as DeepSpec saves them (no prefix), or with vLLM's `model.` prefix.
- `fc.weight [H, m*H]` fixes the number of tapped layers m; the config's `target_layer_ids` must agree.
- `embed_tokens.weight` / `lm_head.weight` are frozen copies of the target's: never loaded (the draft
  uses the target's modules), but checked for shape, and a few rows compared with the target's (a
  mismatch is logged: the draft was trained for another target and will rarely be accepted).
- Optional per-layer `self_attn.k_scale` / `v_scale` are returned for the FP8 draft cache.
- An optional `draft_vocab_ids` (int64 [M], most frequent first): with `draft_vocab_size` N the draft proposes from
  its first N ids only (model/dspark_vocab.py); without, it is ignored.
- A missing, unexpected, misshapen or non-float tensor is an error naming it.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from m3serve.config import ConfigError
from m3serve.model.dspark import DSparkDraft, SharedTargetParts
from m3serve.model.dspark_config import DSparkConfig
from m3serve.model.dspark_vocab import DRAFT_VOCAB_TENSOR, OPTION, select_draft_vocab
from m3serve.model.loader import CheckpointError, list_tensors, read_headers
from m3serve.model.m3 import Rotary

log = logging.getLogger(__name__)

SHARED = ("embed_tokens.weight", "lm_head.weight")
_FLOATS = {"F32", "BF16", "F16", "F64"}
_IDS = {"I64", "I32"}
_ROWS_COMPARED = 4


@dataclass
class DSparkLoadReport:
    num_tensors: int = 0
    kv_scales: dict[int, tuple[float, float]] = field(default_factory=dict)  # draft layer -> (k, v)
    shared_checked: list[str] = field(default_factory=list)  # embed/lm_head copies compared with the target's
    shared_mismatch: list[str] = field(default_factory=list)


def _canonical(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def _dense_weight(module) -> torch.Tensor | None:
    """The plain weight of an nn.Embedding / nn.Linear / m3serve Linear (None if quantized)."""
    w = getattr(module, "w", None)
    if w is not None:
        return w.weight if w.fmt == "dense" else None
    return getattr(module, "weight", None)


def load_dspark(draft_dir: str, target, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                draft_vocab_size: int | None = None) -> tuple[DSparkDraft, DSparkLoadReport]:
    """Load the draft in `draft_dir` for `target` (an `M3ForCausalLM`: its config, embedding and lm_head);
    `draft_vocab_size` N: propose from the first N of the checkpoint's `draft_vocab_ids` only."""
    path = os.path.join(draft_dir, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"no config.json in the DSpark draft directory {draft_dir}")
    with open(path) as f:
        cfg = DSparkConfig.from_dict(json.load(f), target.config)
    dtype = dtype or target.dtype
    weight_map = list_tensors(draft_dir)
    meta = read_headers(draft_dir, weight_map)
    names: dict[str, str] = {}  # canonical -> stored name
    for name in weight_map:
        canon = _canonical(name)
        if canon in names:
            raise CheckpointError(f"tensor {name} appears twice (as {names[canon]} too)")
        names[canon] = name
    if "fc.weight" not in names:
        raise CheckpointError(f"DSpark checkpoint {draft_dir} is missing tensor fc.weight")
    fc_shape = meta[names["fc.weight"]][1]
    if len(fc_shape) != 2 or fc_shape[0] != cfg.hidden_size:
        raise CheckpointError(f"fc.weight: expected shape [{cfg.hidden_size}, m * {cfg.hidden_size}], found {fc_shape}")
    cfg.with_taps_from_fc(fc_shape[1])

    shared = SharedTargetParts(target.model.embed_tokens, target.lm_head, getattr(target, "parallel", None))
    with torch.device("meta"):
        draft = DSparkDraft(cfg, shared, dtype)
    draft.to_empty(device=device)
    draft.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta).to(device)
    params = draft.state_dict(keep_vars=True)
    report = DSparkLoadReport()
    scale_names = {f"layers.{i}.self_attn.{kind}_scale": (i, kind)
                   for i in range(cfg.num_hidden_layers) for kind in ("k", "v")}
    problems = []
    for canon, name in sorted(names.items()):
        dt, shape = meta[name]
        if canon == DRAFT_VOCAB_TENSOR:
            if dt not in _IDS or len(shape) != 1:
                problems.append(f"{name}: expected a 1-D int64 tensor, found {dt} {shape}")
        elif canon not in params and canon not in SHARED and canon not in scale_names:
            problems.append(f"unexpected tensor {name}")
        elif dt not in _FLOATS:
            problems.append(f"{name}: expected a floating-point tensor, found {dt}")
        elif canon in SHARED and list(shape) != [cfg.vocab_size, cfg.hidden_size]:
            problems.append(f"{name}: expected shape [{cfg.vocab_size}, {cfg.hidden_size}], found {shape}")
        elif canon in params and list(shape) != list(params[canon].shape):
            problems.append(f"{name}: expected shape {list(params[canon].shape)}, found {shape}")
    missing = [k for k in params if k not in names]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        problems.append("missing tensor(s): " + ", ".join(missing[:5]) + more)
    if problems:
        raise CheckpointError(f"DSpark checkpoint {draft_dir}: " + "; ".join(problems))
    if draft_vocab_size and DRAFT_VOCAB_TENSOR not in names:
        raise ConfigError(f"{OPTION}: {draft_vocab_size} asks for a draft vocabulary, but the DSpark checkpoint "
                          f"{draft_dir} has no {DRAFT_VOCAB_TENSOR} tensor")
    vocab_ids = None

    by_shard: dict[str, list[str]] = {}
    for canon, name in names.items():
        by_shard.setdefault(weight_map[name], []).append(canon)
    with torch.no_grad():
        for shard, canons in sorted(by_shard.items()):
            with safe_open(os.path.join(draft_dir, shard), "pt", device="cpu") as s:
                for canon in canons:
                    name = names[canon]
                    if canon == DRAFT_VOCAB_TENSOR:
                        vocab_ids = s.get_tensor(name) if draft_vocab_size else None
                    elif canon in SHARED:
                        _compare_shared(canon, s.get_slice(name), shared, report)
                    elif canon in scale_names:
                        layer, kind = scale_names[canon]
                        k, v = report.kv_scales.get(layer, (1.0, 1.0))
                        val = float(s.get_tensor(name).reshape(-1)[0])
                        report.kv_scales[layer] = (val, v) if kind == "k" else (k, val)
                    else:
                        params[canon].copy_(s.get_tensor(name))
    report.num_tensors = len(names)
    if vocab_ids is not None:
        head = _dense_weight(shared.lm_head)
        if head is None:
            raise ConfigError(f"{OPTION}: the draft vocabulary needs a dense (unquantized) lm_head")
        draft.use_draft_vocab(select_draft_vocab(vocab_ids, draft_vocab_size, cfg.vocab_size), head)
    draft.eval()
    log.info("loaded DSpark draft from %s: %d layers, block %d, taps %s, Markov %s rank %d, confidence head %s, "
             "draft vocabulary %s", draft_dir, cfg.num_hidden_layers, cfg.block_size, cfg.target_layer_ids,
             cfg.markov_head_type, cfg.markov_rank, cfg.enable_confidence_head,
             "all" if draft.draft_vocab is None else f"{draft.draft_vocab.size} of {cfg.vocab_size}")
    return draft, report


def _compare_shared(canon: str, stored, shared: SharedTargetParts, report: DSparkLoadReport) -> None:
    module = shared.embed_tokens if canon.startswith("embed") else shared.lm_head
    ours = _dense_weight(module)
    if ours is None:
        return
    v, par = ours.shape[0], shared.parallel
    first = par.rank * v if par is not None and par.size > 1 else 0  # a tensor-parallel rank holds rows of its part
    for rows in (slice(0, _ROWS_COMPARED), slice(v - _ROWS_COMPARED, v)):
        theirs = stored[first + rows.start:first + rows.stop].float()
        if not torch.allclose(theirs, ours[rows].detach().float().cpu(), rtol=1e-2, atol=1e-3):
            report.shared_mismatch.append(canon)
            log.warning("the DSpark draft's %s differs from the target's: the draft was trained for another "
                        "target (its drafts will rarely be accepted)", canon)
            return
    report.shared_checked.append(canon)
