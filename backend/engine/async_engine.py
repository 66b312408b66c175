"""`AsyncLLMEngine`: the `LLMEngine` step loop on its own daemon thread, asyncio streams in front.

    engine = AsyncLLMEngine(EngineConfig(model=DIR))
    async for out in engine.generate("r1", prompt="Hi", sampling_params=SamplingParams(max_tokens=8)):
        ...                      # RequestOutput deltas; the last one has finished=True
    engine.shutdown()

Only the engine thread touches the `LLMEngine`; callers hand it commands (add, abort) through a locked
queue, and outputs go back to each caller's own event loop with `call_soon_threadsafe`. A bad request
raises `InvalidRequest` before the first yield and disturbs nothing else. An exception in the step loop
marks the engine dead: every pending stream, and every later call, raises `EngineDeadError`.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque

from m3serve.config import EngineConfig
from m3serve.engine.llm_engine import LLMEngine, PreparedRequest
from m3serve.engine.outputs import RequestOutput
from m3serve.engine.sampling_params import InvalidRequest, SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (failed or shut down); no request can be served."""


class _Stream:
    __slots__ = ("request_id", "loop", "queue")

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id, self.loop, self.queue = request_id, loop, asyncio.Queue()

    def put(self, item) -> bool:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
            return True
        except RuntimeError:  # the caller's loop is closed
            return False


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, *, engine: LLMEngine | None = None, **engine_kwargs):
        self.engine = engine if engine is not None else LLMEngine(config, **engine_kwargs)
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self._cv = threading.Condition()
        self._commands: deque = deque()
        self._streams: dict[str, _Stream] = {}
        self._error: BaseException | None = None
        self._stopping = False
        self._stats = self.engine.stats()
        self._thread = threading.Thread(target=self._run, name="m3serve-engine", daemon=True)
        self._thread.start()

    # ---- caller side -----------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine is dead: {self._error!r}")
        if self._stopping:
            raise EngineDeadError("the engine is shut down")

    async def generate(self, request_id: str, prompt=None, prompt_token_ids=None,
                       sampling_params: SamplingParams | None = None, reasoning_parser: str | None = None,
                       chat_template_kwargs: dict | None = None):
        """Yield the request's `RequestOutput` deltas until one has `finished=True`."""
        self._check_alive()
        req: PreparedRequest = self.engine.prepare_request(prompt, prompt_token_ids, sampling_params,
                                                           reasoning_parser, chat_template_kwargs)
        stream = _Stream(request_id, asyncio.get_running_loop())
        with self._cv:
            self._check_alive()
            if request_id in self._streams:
                raise InvalidRequest("request_id", f"request {request_id!r} is already running")
            self._streams[request_id] = stream
            self._commands.append(("add", request_id, req))
            self._cv.notify()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # the caller stopped listening (closed, cancelled): free its pages
                self._send(("abort", request_id, stream))

    async def abort(self, request_id: str) -> None:
        self.abort_sync(request_id)

    def abort_sync(self, request_id: str) -> None:
        """Thread-safe: abort the request (its stream gets a final output with finish_reason "abort")."""
        self._send(("abort", request_id, None))

    def _send(self, cmd) -> None:
        with self._cv:
            self._commands.append(cmd)
            self._cv.notify()

    def stats(self) -> dict:
        with self._cv:
            return dict(self._stats)

    def is_healthy(self) -> bool:
        return (self._error is None and not self._stopping and self._thread.is_alive()
                and self._executor_healthy())

    # ---- hook (issue #14): the executor's worker processes --------------------------------------------
    def _executor_healthy(self) -> bool:
        """A tensor-parallel worker that died while the engine was idle: mark the engine dead (the step loop marks
        it dead itself when a step fails). Called by `is_healthy`, so by the Triton model's health check."""
        try:
            self.engine.check_health()
        except Exception as e:  # noqa: BLE001 - any failure of a worker is fatal to the engine
            self._fail_all(e, f"the engine is not healthy: {e}")
            with self._cv:
                self._cv.notify_all()
            return False
        return True

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the loop, abort what is left (its streams get EngineDeadError), join the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self.engine.shutdown()  # hook (issue #14): the executor's worker processes go with the engine

    # ---- engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._commands or self._stopping or self.engine.has_unfinished_requests()):
                        self._cv.wait()
                    if self._stopping:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                for cmd in commands:
                    self._apply(cmd)
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
                with self._cv:
                    self._stats = self.engine.stats()
        except BaseException as e:  # noqa: BLE001 - anything here kills the engine
            log.exception("engine step loop failed")
            self._fail_all(e, f"the engine step loop failed: {e!r}")
            return
        for rid in list(self.engine.scheduler.requests):
            self.engine.abort_request(rid)
        with self._cv:
            self._stats = self.engine.stats()
        self._fail_all(None, "the engine was shut down")

    def _apply(self, cmd) -> None:
        kind, rid, arg = cmd
        if kind == "add":
            try:
                self.engine.add_prepared(rid, arg)
            except InvalidRequest as e:
                with self._cv:
                    stream = self._streams.pop(rid, None)
                if stream is not None:
                    stream.put(e)
            return
        with self._cv:
            stream = self._streams.get(rid)
        if arg is not None and stream is not arg:
            return  # an abort for an earlier request of the same id
        out = self.engine.abort_request(rid)
        if out is not None:
            self._deliver([out])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            with self._cv:
                stream = self._streams.get(out.request_id)
                if stream is not None and out.finished:
                    del self._streams[out.request_id]
            if stream is not None and not stream.put(out) and not out.finished:
                self.engine.abort_request(out.request_id)
                with self._cv:
                    self._streams.pop(out.request_id, None)

    def _fail_all(self, error: BaseException | None, message: str) -> None:
        with self._cv:
            if error is not None:
                self._error = error
            self._stopping = self._stopping or error is not None
            streams = list(self._streams.values())
            self._streams.clear()
            self._commands.clear()
        for s in streams:
            s.put(EngineDeadError(message))
