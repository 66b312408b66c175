"""Sandboxed Jinja rendering of HF-style chat templates, bounded in time.

Templates run in Jinja's immutable sandbox, with `*` and `**` on big operands refused (a one-line memory
bomb), and under a deadline: a trace function on the template's own frames checks the clock every few
hundred lines, so a template that loops 10^8 times (or nests loops) fails with `TemplateTimeout` after
`time_limit()` seconds instead of holding its thread for an hour; there it also yields the GIL, so a long render
does not stall the engine's and the server's threads (without the yield a 4-token request next to a looping
template took 0.97-0.99 s instead of 0.17 s). A single long builtin call (a filter over
a huge value) is not interruptible: templates from requests are refused unless the operator trusts them.
$M3SERVE_CHAT_TEMPLATE_TIMEOUT sets the limit in seconds (default 10).
"""

from __future__ import annotations

import copy
import json
import operator
import os
import sys
import time
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


TIMEOUT_ENV = "M3SERVE_CHAT_TEMPLATE_TIMEOUT"
DEFAULT_TIME_LIMIT_S = 10.0
MAX_REPEAT = 1 << 20  # longest string / list a template may build with `*`
MAX_POWER_BITS = 4096  # largest integer a template may build with `**`
_TEMPLATE_FILENAME = "<template>"  # what Jinja compiles from_string sources under
_CHECK_EVERY = 256  # trace events between two clock reads


class TemplateTimeout(ValueError):
    """The template did not finish rendering within the time limit."""


def time_limit() -> float:
    try:
        return max(0.001, float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIME_LIMIT_S)))
    except ValueError:
        return DEFAULT_TIME_LIMIT_S


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with repetition and powers kept small."""

    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context, op: str, left: Any, right: Any) -> Any:
        if op == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_REPEAT:
                    raise jinja2.exceptions.SecurityError(f"repetition longer than {MAX_REPEAT} refused")
            return operator.mul(left, right)
        if (isinstance(left, int) and isinstance(right, int) and right > 0
                and abs(left) > 1 and max(abs(left).bit_length(), 1) * right > MAX_POWER_BITS):
            raise jinja2.exceptions.SecurityError(f"a power above 2^{MAX_POWER_BITS} refused")
        return operator.pow(left, right)


def _render_bounded(template: jinja2.Template, limit: float, /, **context: Any) -> str:
    """template.render(**context), raising TemplateTimeout once `limit` seconds have passed."""
    deadline = time.monotonic() + limit
    count = 0

    def on_line(frame, event, arg):
        nonlocal count
        count += 1
        if count % _CHECK_EVERY == 0:
            if time.monotonic() > deadline:
                raise TemplateTimeout(f"the chat template did not finish rendering within {limit:g} s")
            time.sleep(0)  # hand the GIL over: a long render must not stall the engine and response threads
        return on_line

    def on_call(frame, event, arg):
        return on_line if frame.f_code.co_filename == _TEMPLATE_FILENAME else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        return template.render(**context)
    finally:
        sys.settrace(previous)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in an immutable sandbox (HF options); ValueError on syntax errors."""
    env = _ChatSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
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
    """Render `source` with messages/tools/kwargs within `time_limit()` seconds; any template failure
    (TemplateTimeout included) raises ValueError."""
    template = compile_template(source)
    try:
        return _render_bounded(template, time_limit(), messages=_normalize_messages(messages), tools=tools,
                               add_generation_prompt=add_generation_prompt, **kwargs)
    except TemplateTimeout:
        raise
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"chat template error: {e}") from e
    except (TypeError, AttributeError, KeyError, IndexError, ArithmeticError, RecursionError, MemoryError) as e:
        raise ValueError(f"chat template error: {type(e).__name__}: {e}") from e
