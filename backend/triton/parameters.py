"""What a model's config.pbtxt may set, and what only the operator's environment may.

A model config reaches the server through the repository API too (a load with a config override), so nothing in
its `parameters` picks code or a path outside the model's folder: every parameter the backend reads is in
PARAMETERS; any other name is refused at load (a typo, or a hook such as the old `engine_factory`), before
anything is imported or built. The one path, `tokenizer_dir`, is a relative path without `..`, looked up under
the model's version folder or `$M3SERVE_MODEL_DIR` (the operator's).

Tests and benchmarks swap the engine through the server's environment only (test-only, never set it in
production): `$M3SERVE_TEST_ENGINE_FACTORY` = "module:function" or "/path/file.py:function" for every LLM model of
the server, or "MODEL=SPEC;MODEL=SPEC" per model; the function gets the EngineConfig and returns an object with
the `EngineClient` members the model calls (engine/client.py: `prepare`, `submit`, `abort_sync`, `stats`,
`is_healthy`, `shutdown`); engine_process.py builds it in the engine process.
"""
from __future__ import annotations

import os

from m3serve.config import ConfigError

TEST_FACTORY_ENV = "M3SERVE_TEST_ENGINE_FACTORY"

# name -> what it holds (model.py and model_repository/README.md say what each does)
PARAMETERS = {
    "m3serve_role": "text | ids | preprocessing | postprocessing",
    "default_max_tokens": "integer",
    "REPORT_CUSTOM_METRICS": "boolean",
    "cancellation_check_period_ms": "number",
    "stats_period_ms": "number",
    "coalesce_responses": "boolean",
    "engine_process": "boolean",
    "trust_request_chat_template": "boolean",
    "utf8_stream_boundaries": "boolean",
    "tokenizer_dir": "relative path inside the model folder or $M3SERVE_MODEL_DIR",
    "skip_special_tokens": "boolean",
    "max_model_len": "integer",
    "m3serve_engine_failed": "reason (set by the backend's own marking load)",
}


def check(params: dict[str, str]) -> None:
    """ConfigError naming every parameter the backend does not take (nothing is imported for any of them)."""
    unknown = sorted(set(params) - set(PARAMETERS))
    if not unknown:
        return
    hook = [k for k in unknown if k == "engine_factory" or ":" in params[k]]
    why = (f"; {', '.join(hook)}: a model config never picks code (tests set ${TEST_FACTORY_ENV} in the server's "
           "environment)") if hook else ""
    raise ConfigError(f"config parameter(s) {', '.join(unknown)} not taken by m3serve{why}; the parameters are: "
                      f"{', '.join(PARAMETERS)}")


def inside_path(value: str, bases: list[str], what: str) -> str:
    """The directory `value` names under one of `bases` (first that has it): relative, no `..`, no `~` or `$`."""
    norm = os.path.normpath(value) if value else ""
    if (not value or os.path.isabs(value) or value.startswith("~") or "$" in value
            or norm == ".." or norm.startswith(".." + os.sep)):
        raise ConfigError(f"parameter {what}: {value!r} must be a relative path inside the model folder or "
                          "$M3SERVE_MODEL_DIR (no absolute path, '..', '~' or '$')")
    tried = [os.path.join(b, norm) for b in bases if b]
    for cand in tried:
        if os.path.isdir(cand):
            return os.path.abspath(cand)
    raise ConfigError(f"parameter {what}: {value!r} not found; tried {tried}")


def test_engine_factory(model: str, environ=os.environ) -> str | None:
    """The engine factory $M3SERVE_TEST_ENGINE_FACTORY names for `model` (None: the real engine)."""
    value = (environ.get(TEST_FACTORY_ENV) or "").strip()
    for entry in filter(None, (e.strip() for e in value.split(";"))):
        name, eq, target = entry.partition("=")
        if not eq:
            return entry
        if name.strip() == model:
            return target.strip() or None
    return None
