"""Sandboxed Jinja rendering of HF-style chat templates."""

from __future__ import annotations

import copy
import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # HF semantics: plain json.dumps, no HTML escaping
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in an immutable sandbox (HF options); ValueError on syntax errors."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"chat template error: {e}") from e


def _normalize_messages(messages: list[dict]) -> list[dict]:
    """Deep-copy messages; decode JSON-string tool-call arguments into objects."""
    out = copy.deepcopy(list(messages))
    for m in out:
        for tc in (m.get("tool_calls") or []) if isinstance(m, dict) else []:
            fn = tc.get("function", tc) if isinstance(tc, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
                except ValueError:
                    pass  # leave as is; the template decides
    return out


def render_chat_template(source: str, messages: list[dict], tools: list[dict] | None = None,
                         add_generation_prompt: bool = True, **kwargs: Any) -> str:
    """Render `source` with messages/tools/kwargs; any template failure raises ValueError."""
    template = compile_template(source)
    try:
        return template.render(messages=_normalize_messages(messages), tools=tools,
                               add_generation_prompt=add_generation_prompt, **kwargs)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"chat template error: {e}") from e
    except (TypeError, AttributeError, KeyError, IndexError) as e:
        raise ValueError(f"chat template error: {type(e).__name__}: {e}") from e
