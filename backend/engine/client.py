"""`EngineClient`: what a caller of the engine (the Triton model, benchmarks, tests) may use, whichever engine it
holds: `AsyncLLMEngine` (engine/async_engine.py: the engine on threads of this process) or `EngineProcess`
(engine/process_client.py: the client of the engine in a process of its own, engine/engine_process.py). Both
implement every member with the same parameters (tests/unit/test_engine_client.py checks it).

A request is validated and tokenized once, by `prepare`, in the process that runs the engine; `submit` (outputs to a
callable) or `generate` (an async iterator) then run what `prepare` returned. `start` does both where the engine
runs, from one call that does not wait (`PendingStarts` keeps an abort that comes while the request is prepared).
The tokenizer is the engine's alone: a caller never holds it. Text a caller needs besides the streamed deltas (the
prompt decoded, the logprobs' tokens, stop words given as token ids) it asks for with `TextOptions`
(engine/sampling_params.py) and reads in the outputs.
"""
from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

from m3serve.engine.sampling_params import InvalidRequest


@runtime_checkable
class EngineClient(Protocol):
    @property
    def max_model_len(self) -> int: ...

    async def prepare(self, prompt=None, prompt_token_ids=None, sampling_params=None, reasoning_parser=None,
                      chat_template_kwargs=None, text_options=None) -> Any:
        """Validate and tokenize a request (InvalidRequest naming the option); the result goes to submit/generate."""

    def submit(self, request_id: str, prepared: Any, sink: Callable[[object], None]) -> None:
        """Run a prepared request: `sink` gets its `RequestOutput` deltas, then the final one (or the exception that
        ends it), in order, on an engine thread; it must be quick and must not block."""

    def start(self, request_id: str, sink: Callable[[object], None], prompt=None, prompt_token_ids=None,
              sampling_params=None, reasoning_parser=None, chat_template_kwargs=None, text_options=None) -> None:
        """`prepare` then `submit` where the engine runs, without waiting for either: the caller sends one message
        (no round trip before the engine sees the request). An invalid request's InvalidRequest, or any other
        failure to start it, reaches `sink` as the request's only event; an abort meanwhile is applied once it is
        submitted. Raises, without calling `sink`, InvalidRequest for an id already running or starting and
        EngineDeadError."""

    def generate(self, request_id: str, prompt=None, prompt_token_ids=None, sampling_params=None,
                 reasoning_parser=None, chat_template_kwargs=None, text_options=None, prepared=None
                 ) -> AsyncIterator:
        """Yield the request's `RequestOutput` deltas until one has finished=True."""

    async def abort(self, request_id: str) -> None: ...

    def abort_sync(self, request_id: str) -> None:
        """Thread-safe: abort the request (it ends with finish_reason "abort")."""

    def stats(self) -> dict:
        """The engine's counters (vLLM's names)."""

    def is_healthy(self) -> bool: ...

    @property
    def dead_reason(self) -> str | None:
        """Why the engine died (None while it lives)."""

    def shutdown(self, timeout: float | None = ...) -> None:
        """Stop the engine; open requests end with EngineDeadError."""


class PendingStarts:
    """Requests `start`ed whose preparation has not ended. An abort meanwhile would find no request in the engine: it
    is kept here and applied right after the request is submitted (so no tokens are made for a caller gone).
    `cancelled` makes the error of a preparation cancelled (the engine shutting down)."""

    def __init__(self, cancelled: Callable[[], BaseException]):
        self._lock = threading.Lock()
        self._aborted: dict[str, bool] = {}
        self._cancelled = cancelled

    def begin(self, request_id: str) -> None:
        """InvalidRequest if `request_id` is starting already."""
        with self._lock:
            if request_id in self._aborted:
                raise InvalidRequest.already_running(request_id)
            self._aborted[request_id] = False

    def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._aborted:
                self._aborted[request_id] = True

    def prepared(self, request_id: str, fut: Future, submit: Callable[[Any], None],
                 fail: Callable[[BaseException], None], abort: Callable[[], None]) -> None:
        """The preparation `fut` ended: `submit` its result, then `abort()` if one came; a failure to prepare (or a
        cancelled preparation) or to submit goes to `fail`."""
        with self._lock:
            aborted = self._aborted.pop(request_id, False)
        error = self._cancelled() if fut.cancelled() else fut.exception()
        if error is None:
            try:
                submit(fut.result())
            except Exception as e:  # noqa: BLE001 - an id already running, a dead engine: the request's one event
                error = e
        if error is not None:
            fail(error)
        elif aborted:
            abort()
