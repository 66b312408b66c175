"""Engine arguments for a Triton model: `model.json` in the version folder, vLLM names.

`model` (and `tokenizer`) may be absolute, or relative to the version folder, or relative to
`$M3SERVE_MODEL_DIR`; `$VARS` and `~` are expanded; so may `speculative_config.model` (the draft; default
`<model>/dspark`). Options vLLM accepts that change nothing here are dropped with a note; unknown options
and unsupported ones fail the model load with a message naming them. `tensor_parallel_size` and
`enable_expert_parallel` pass through to the engine, which starts its worker processes from the stub
(executor/multiproc_executor.py).
"""
from __future__ import annotations

import json
import os
from typing import Any

from m3serve.config import ConfigError, EngineConfig

MODEL_JSON = "model.json"
MODEL_DIR_ENV = "M3SERVE_MODEL_DIR"

# vLLM engine arguments with no effect in m3serve (accepted so a vLLM model.json moves over)
IGNORED_VLLM_KEYS = ("disable_log_requests", "disable_log_stats", "trust_remote_code",
                     "distributed_executor_backend", "disable_custom_all_reduce", "tokenizer_mode",
                     "swap_space")


def resolve_path(value: str, version_dir: str, what: str = "model") -> str:
    path = os.path.expanduser(os.path.expandvars(value))
    if os.path.isabs(path):
        if not os.path.isdir(path):
            raise ConfigError(f"{what}: directory {path} does not exist")
        return path
    tried = [os.path.join(version_dir, path)]
    base = os.environ.get(MODEL_DIR_ENV)
    if base:
        tried.append(os.path.join(os.path.expanduser(base), path))
    for cand in tried:
        if os.path.isdir(cand):
            return os.path.abspath(cand)
    hint = "" if base else f" (set ${MODEL_DIR_ENV} to the folder that holds it)"
    raise ConfigError(f"{what}: {value!r} not found; tried {tried}{hint}")


def load_model_json(version_dir: str) -> dict[str, Any]:
    path = os.path.join(version_dir, MODEL_JSON)
    if not os.path.isfile(path):
        raise ConfigError(f"{path} is missing: it holds the engine arguments (vLLM names), e.g. "
                          '{"model": "/path/to/MiniMax-M3"}')
    with open(path, encoding="utf-8") as f:
        try:
            raw = json.load(f)
        except ValueError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return raw


def engine_config(version_dir: str) -> tuple[EngineConfig, list[str]]:
    """(validated EngineConfig, notes) from the version folder's model.json.

    ConfigError names every problem at once: a missing model directory and unsupported options alike."""
    raw = load_model_json(version_dir)
    notes = []
    for k in IGNORED_VLLM_KEYS:
        if k in raw:
            notes.append(f"model.json: {k!r} has no effect in m3serve, ignored")
            raw.pop(k)
    if "model" not in raw:
        raise ConfigError("model.json: 'model' (the model directory) is required")
    problems = []
    draft = raw.get("speculative_config")
    for holder, key, what in ((raw, "model", "model"), (raw, "tokenizer", "tokenizer"),
                              (draft if isinstance(draft, dict) else {}, "model", "speculative_config.model")):
        if holder.get(key):
            try:
                holder[key] = resolve_path(str(holder[key]), version_dir, what)
            except ConfigError as e:
                problems.append(str(e))
    try:
        cfg = EngineConfig.from_dict(raw)
        cfg.validate()
    except (ConfigError, TypeError) as e:
        problems.append(str(e))
    if problems:
        raise ConfigError("model.json: " + "; ".join(problems))
    return cfg, notes
