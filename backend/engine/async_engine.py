"""`AsyncLLMEngine`: the `LLMEngine` step loop on its own daemon thread, asyncio streams in front.

    engine = AsyncLLMEngine(EngineConfig(model=DIR))
    async for out in engine.generate("r1", prompt="Hi", sampling_params=SamplingParams(max_tokens=8)):
        ...                      # RequestOutput deltas; the last one has finished=True
    engine.shutdown()

Only the engine thread touches the `LLMEngine`'s state; callers hand it commands (add, abort) through a
locked queue, and outputs go back to each caller's own event loop with `call_soon_threadsafe` (one call per loop
and step). A server with a response thread of its own can skip the event loop: `submit` hands each output to a
callable on the engine thread (the Triton model's path: no per-output hop through asyncio). Requests are
validated and tokenized (chat templates rendered, under their time bound) on a small worker pool, so a slow
prompt holds neither the caller's loop nor the step loop (it only shares the CPU with them).

Failures stay as small as they can (see engine/faults.py):
  * a bad request raises `InvalidRequest` before the first yield and disturbs nothing else;
  * a request that fails inside the engine (adding it, or its step) raises `RequestFailed` in its own
    stream; the other requests go on;
  * an exception the step could not attribute fails every request in flight; if the page pool is then
    whole again (every page free, nothing scheduled) the engine carries on;
  * a device fault, or an inconsistent state after such a failure, marks the engine dead: every pending
    stream, and every later call, raises `EngineDeadError`, and `is_healthy()` turns False.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from m3serve.config import EngineConfig
from m3serve.engine.client import PendingStarts
from m3serve.engine.faults import FailedOutput, RequestFailed, describe, is_device_fault
from m3serve.engine.llm_engine import LLMEngine, PreparedRequest
from m3serve.engine.outputs import RequestOutput
from m3serve.engine.sampling_params import InvalidRequest, SamplingParams, TextOptions

log = logging.getLogger(__name__)

PREPARE_WORKERS = 2


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


class _Sink:
    """A request whose outputs go to a callable on the engine thread (`AsyncLLMEngine.submit`)."""

    __slots__ = ("request_id", "fn")

    def __init__(self, request_id: str, fn: Callable[[object], None]):
        self.request_id, self.fn = request_id, fn

    def put(self, item) -> bool:
        try:
            self.fn(item)
            return True
        except Exception:  # the receiver's fault: its request is aborted, the engine goes on
            log.exception("the output receiver of request %s failed", self.request_id)
            return False


async def drain(queue: asyncio.Queue, on_stop: Callable[[], None]):
    """Yield a request's outputs from `queue` until one has finished=True; an exception put there ends the stream by
    being raised. `on_stop` runs when the caller stops listening before the end (closed, cancelled). Iterated from
    another async generator, wrap it in `contextlib.aclosing` so that `on_stop` runs when that one is closed."""
    finished = False
    try:
        while not finished:
            item = await queue.get()
            if isinstance(item, BaseException):
                finished = True
                raise item
            finished = item.finished
            yield item
    finally:
        if not finished:
            on_stop()


def _put_all(items: list[tuple[_Stream, object, RequestOutput]]) -> None:
    """On the callers' loop: queue a step's outputs on their streams."""
    for stream, item, _ in items:
        stream.queue.put_nowait(item)


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
        self.num_recovered_failures = 0  # step failures the engine carried on after
        # called on the engine thread after each round (commands applied, one step run): a `submit` receiver that
        # gathers outputs hands the round's over here at once (engine_process.py: one message per step)
        self.round_listeners: list[Callable[[], None]] = []
        self._prepare_pool = ThreadPoolExecutor(PREPARE_WORKERS, thread_name_prefix="m3serve-prepare")
        self._starts = PendingStarts(lambda: EngineDeadError("the engine is shut down"))
        self._thread = threading.Thread(target=self._run, name="m3serve-engine", daemon=True)
        self._thread.start()

    # ---- caller side -----------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine is dead: {self._error!r}")
        if self._stopping:
            raise EngineDeadError("the engine is shut down")

    def _check_new(self, request_id: str) -> None:
        """With `_cv` held: the engine is alive and `request_id` is not running."""
        self._check_alive()
        if request_id in self._streams:
            raise InvalidRequest.already_running(request_id)

    async def prepare(self, prompt=None, prompt_token_ids=None, sampling_params: SamplingParams | None = None,
                      reasoning_parser: str | None = None, chat_template_kwargs: dict | None = None,
                      text_options: TextOptions | None = None) -> PreparedRequest:
        """Validate and tokenize a request on the worker pool (InvalidRequest naming the option)."""
        self._check_alive()
        prepare = functools.partial(self.engine.prepare_request, prompt, prompt_token_ids, sampling_params,
                                    reasoning_parser, chat_template_kwargs, text_options)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._prepare_pool, prepare)
        except RuntimeError as e:
            if self._stopping or self._error is not None:  # the pool was shut down meanwhile
                raise EngineDeadError(str(e)) from None
            raise

    async def generate(self, request_id: str, prompt=None, prompt_token_ids=None,
                       sampling_params: SamplingParams | None = None, reasoning_parser: str | None = None,
                       chat_template_kwargs: dict | None = None, text_options: TextOptions | None = None,
                       prepared: PreparedRequest | None = None):
        """Yield the request's `RequestOutput` deltas until one has `finished=True`.

        `prompt` is a string or a list of chat messages (rendered with the model's chat template and
        `chat_template_kwargs`, `tools` included); or pass what `prepare` returned as `prepared`."""
        req = prepared if prepared is not None else await self.prepare(
            prompt, prompt_token_ids, sampling_params, reasoning_parser, chat_template_kwargs, text_options)
        stream = _Stream(request_id, asyncio.get_running_loop())
        self._add(request_id, stream, req)
        # a caller that stops listening (closed, cancelled) frees the request's pages
        async with contextlib.aclosing(drain(stream.queue, lambda: self._send(("abort", request_id, stream)))) as outs:
            async for item in outs:
                yield item

    def start(self, request_id: str, sink: Callable[[object], None], prompt=None, prompt_token_ids=None,
              sampling_params: SamplingParams | None = None, reasoning_parser: str | None = None,
              chat_template_kwargs: dict | None = None, text_options: TextOptions | None = None) -> None:
        """Thread-safe, no event loop, no wait: `prepare` on the worker pool, then `submit` (engine/client.py)."""
        with self._cv:
            self._check_new(request_id)
            self._starts.begin(request_id)
        try:
            fut = self._prepare_pool.submit(self.engine.prepare_request, prompt, prompt_token_ids, sampling_params,
                                            reasoning_parser, chat_template_kwargs, text_options)
        except RuntimeError as e:  # the pool was shut down: the engine is stopping
            fut = Future()
            fut.set_exception(EngineDeadError(str(e)))
        fut.add_done_callback(lambda f: self._starts.prepared(
            request_id, f, lambda prepared: self.submit(request_id, prepared, sink), sink,
            lambda: self.abort_sync(request_id)))

    def submit(self, request_id: str, prepared: PreparedRequest, sink: Callable[[object], None]) -> None:
        """Thread-safe, no event loop: start a request `prepare` returned. Its `RequestOutput` deltas (the last with
        finished=True), or the exception that ends it (`RequestFailed`, `EngineDeadError`), go to `sink` on the
        engine thread, in order, between steps: `sink` must be quick and must not block (a queue's put). Raises,
        without calling `sink`, `InvalidRequest` for an id already running and `EngineDeadError`."""
        self._add(request_id, _Sink(request_id, sink), prepared)

    def _add(self, request_id: str, stream: "_Stream | _Sink", req: PreparedRequest) -> None:
        with self._cv:
            self._check_new(request_id)
            self._streams[request_id] = stream
            self._commands.append(("add", request_id, req))
            self._cv.notify()

    async def abort(self, request_id: str) -> None:
        self.abort_sync(request_id)

    def abort_sync(self, request_id: str) -> None:
        """Thread-safe: abort the request (its stream gets a final output with finish_reason "abort")."""
        self._starts.abort(request_id)
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
    def dead_reason(self) -> str | None:
        """Why the engine died (None while it lives or after a plain shutdown)."""
        return None if self._error is None else describe(self._error)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    @property
    def max_model_len(self) -> int:
        """The longest sequence the engine serves (the config's, or what the page pool allows)."""
        return self.engine.max_model_len

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the loop, abort what is left (its streams get EngineDeadError), join the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._prepare_pool.shutdown(wait=False, cancel_futures=True)
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
                    self._guarded(self._apply, cmd)
                if self.engine.has_unfinished_requests():
                    self._guarded(self._step)
                for fn in self.round_listeners:
                    fn()
                with self._cv:
                    self._stats = self.engine.stats()
        except BaseException as e:  # noqa: BLE001 - a device fault or a state that cannot be trusted
            log.exception("engine step loop failed")
            self._fail_all(e, f"the engine step loop failed: {e!r}")
            self._prepare_pool.shutdown(wait=False, cancel_futures=True)
            return
        for rid in list(self.engine.scheduler.requests):
            self.engine.abort_request(rid)
        with self._cv:
            self._stats = self.engine.stats()
        self._fail_all(None, "the engine was shut down")

    def _step(self) -> None:
        self._deliver(self.engine.step())

    def _guarded(self, fn, *args) -> None:
        """Run one command or step; on an exception not attributable to one request, fail the requests in
        flight and carry on if the engine's state is whole again; re-raise (the engine dies) otherwise."""
        try:
            fn(*args)
        except Exception as e:
            if is_device_fault(e) or not self.engine.executor_alive():
                raise  # a device fault, or a worker (tensor parallel) gone: nothing to recover
            log.exception("engine step failed outside a request: failing the requests in flight")
            if not self._recover(e):
                raise

    def _recover(self, exc: BaseException) -> bool:
        """Abort every request in flight; True (their streams get RequestFailed) when the pool is then whole."""
        try:
            failed = list(self.engine.scheduler.requests)
            for rid in failed:
                self.engine.abort_request(rid)
            st = self.engine.stats()
        except Exception:
            log.exception("the engine state is inconsistent after a failed step")
            return False
        if not (st["num_running"] == st["num_waiting"] == 0 and st["num_free_pages"] == st["num_total_pages"]):
            log.error("the page pool is not whole after a failed step: %s", st)
            return False
        self.num_recovered_failures += 1
        error = RequestFailed(f"the engine step failed: {describe(exc)}")
        for rid in failed:
            with self._cv:
                stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.put(error)
        return True

    def _apply(self, cmd) -> None:
        kind, rid, arg = cmd
        if kind == "add":
            try:
                self.engine.add_prepared(rid, arg)
            except Exception as e:  # this request only (raised before it reached the scheduler)
                if is_device_fault(e):
                    raise
                if not isinstance(e, InvalidRequest):
                    log.exception("adding request %s failed", rid)
                    e = RequestFailed(f"the engine could not add the request: {describe(e)}")
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
        """Hand a step's outputs to their streams: one wake-up of each callers' event loop per step, not one per
        output (at 64 running requests, 64 cross-thread calls a step were host time the GIL serialised)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, object, RequestOutput]]] = {}
        direct: list[tuple[_Sink, object, RequestOutput]] = []
        with self._cv:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                if out.finished:
                    del self._streams[out.request_id]
                item = RequestFailed(out.error) if isinstance(out, FailedOutput) else out
                if isinstance(stream, _Sink):
                    direct.append((stream, item, out))
                else:
                    by_loop.setdefault(stream.loop, []).append((stream, item, out))
        lost = [out for sink, item, out in direct if not sink.put(item)]
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the callers' loop is closed: nobody listens to these requests
                lost += [out for _, _, out in items]
        for out in lost:
            if not out.finished:
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
