"""`EngineClient`: what a caller of the engine (the Triton model, benchmarks, tests) may use, whichever engine it
holds: `AsyncLLMEngine` (engine/async_engine.py: the engine on threads of this process) or `EngineProcess`
(engine/process_client.py: the client of the engine in a process of its own, engine/engine_process.py). Both
implement every member with the same parameters (tests/unit/test_engine_client.py checks it).

A request is validated and tokenized once, by `prepare`, in the process that runs the engine; `submit` (outputs to a
callable) or `generate` (an async iterator) then run what `prepare` returned. The tokenizer is the engine's alone: a
caller never holds it. Text a caller needs besides the streamed deltas (the prompt decoded, the logprobs' tokens,
stop words given as token ids) it asks for with `TextOptions` (engine/sampling_params.py) and reads in the outputs.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, runtime_checkable


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
