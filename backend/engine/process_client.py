"""`EngineProcess`: the client of the engine in a process of its own (engine/engine_process.py), an `EngineClient`.

Inside Triton's Python backend stub the engine's step loop shares one interpreter lock with the response thread
and the request threads, and that interpreter is the stub's embedded libpython: on the H200 (2026-12-03) it ran a
fixed pure-Python workload in 28 ms where python3 took 18 ms (`benchmarks/geometry.python_speed`). With 64 streams on
the 4-layer M3.1-Flash geometry the engine thread in the stub waited for the GPU 17% of the time against 39%
engine-direct, and the server streamed 0.79 of engine-direct's tokens/s; with the engine in its own process, same
run, 41% and 0.90 (docs/performance.md). vLLM does the same: its engine core runs in a process of its own; the
server process keeps the requests and the responses. The process is started from a plain interpreter
(`multiproc_executor.python_executable`: the stub's Python, or $M3SERVE_WORKER_PYTHON).

    engine = EngineProcess(config)                 # spawns the process; returns once the engine is ready
    prepared = await engine.prepare(prompt_token_ids=[...], sampling_params=sp)
    engine.submit("r1", prepared, sink)            # sink(RequestOutput | exception), on the receiver thread
    engine.start("r2", sink, prompt_token_ids=[...], sampling_params=sp)   # both in one message, no round trip
    engine.abort_sync("r1"); engine.stats(); engine.is_healthy(); engine.shutdown()

`generate` (async) is there too, as on `AsyncLLMEngine`.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection

from m3serve.config import EngineConfig
from m3serve.engine.async_engine import EngineDeadError, drain
from m3serve.engine.engine_process import ARGV_TAG, BOOTSTRAP, ENV, unpack_output
from m3serve.engine.faults import describe
from m3serve.engine.sampling_params import InvalidRequest

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = float(os.environ.get("M3SERVE_ENGINE_STARTUP_TIMEOUT_S", "3600"))  # imports + weights
EXIT_GRACE_S = 10.0


class EngineProcess:
    """The engine in a process of its own, as an `EngineClient` (engine/client.py)."""

    def __init__(self, config: EngineConfig, *, factory: str | None = None,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S):
        from m3serve.executor.multiproc_executor import Spawner, python_executable

        self.config = config
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # the tables below; the receiver thread and the callers share them
        self._sinks: dict[str, Callable[[object], None]] = {}
        self._pending: dict[int, Future] = {}
        self._tokens = itertools.count()
        self._stats: dict = {}
        self._child_healthy = True
        self._error: str | None = None
        self._stopping = False
        ours, theirs = socket.socketpair()
        self._conn = Connection(ours.detach())
        self._spawner = Spawner(name="m3serve-engine-spawner")
        self._spawner.start()
        args = dict(parent_pid=os.getpid(), fd=theirs.fileno(), sys_path=list(sys.path))
        env = dict(os.environ, **{ENV: json.dumps(args)})
        argv = [python_executable(), "-c", BOOTSTRAP, ARGV_TAG, f"parent={os.getpid()}"]
        try:
            self.proc = self._spawner.spawn(argv, env, (theirs.fileno(),))
        except BaseException:
            self._spawner.stop()
            self._conn.close()
            raise
        finally:
            theirs.close()
        try:
            self._send(("init", config, factory))
            info = self._await_ready(startup_timeout_s)
        except BaseException:
            self._kill()
            raise
        self._max_model_len = info["max_model_len"]
        self._stats = info["stats"]
        self._receiver = threading.Thread(target=self._receive, name="m3serve-engine-receiver", daemon=True)
        self._receiver.start()
        log.info("engine process pid %d ready (%s)", self.proc.pid, argv[0])

    def _await_ready(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(0.2):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the engine process exited while starting ({self._exit_note()})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine process was not ready after {timeout_s:.0f}s")
        try:
            msg = self._conn.recv()
        except (EOFError, OSError):
            self.proc.wait(5)
            raise RuntimeError(f"the engine process exited while starting ({self._exit_note()})") from None
        if msg[0] != "ready":
            raise RuntimeError(f"the engine process failed to start:\n{msg[1]}")
        return msg[1]

    def _exit_note(self) -> str:
        code = self.proc.poll()
        if code is None:
            return "still running"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    # ---- the interface ---------------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine is dead: {self._error}")
        if self._stopping:
            raise EngineDeadError("the engine is shut down")

    def _send(self, msg) -> None:
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, ValueError) as e:  # the process is gone (the receiver says why)
            raise EngineDeadError(f"the engine process is gone: {e}") from None

    async def prepare(self, prompt=None, prompt_token_ids=None, sampling_params=None, reasoning_parser=None,
                      chat_template_kwargs=None, text_options=None):
        """Validate and tokenize a request in the engine process (InvalidRequest naming the option)."""
        self._check_alive()
        fut: Future = Future()
        with self._lock:
            token = next(self._tokens)
            self._pending[token] = fut
        self._send(("prepare", token, dict(prompt=prompt, prompt_token_ids=prompt_token_ids,
                                            sampling_params=sampling_params, reasoning_parser=reasoning_parser,
                                            chat_template_kwargs=chat_template_kwargs, text_options=text_options)))
        if self._error is not None:  # died while it was being sent: the receiver may have failed the table first
            self._fail_pending()
        return await asyncio.wrap_future(fut)

    def submit(self, request_id: str, prepared, sink: Callable[[object], None]) -> None:
        """As `AsyncLLMEngine.submit`: `sink` gets the request's outputs (or the exception that ends it) in order,
        on this object's receiver thread; it must be quick and must not block."""
        self._run(request_id, sink, ("submit", request_id, prepared))

    def start(self, request_id: str, sink: Callable[[object], None], prompt=None, prompt_token_ids=None,
              sampling_params=None, reasoning_parser=None, chat_template_kwargs=None, text_options=None) -> None:
        """`prepare` and `submit` in one message, prepared in the engine process (engine/client.py); `sink` as
        `submit`'s, an invalid request's InvalidRequest its one event."""
        self._run(request_id, sink, ("start", request_id, dict(
            prompt=prompt, prompt_token_ids=prompt_token_ids, sampling_params=sampling_params,
            reasoning_parser=reasoning_parser, chat_template_kwargs=chat_template_kwargs, text_options=text_options)))

    def _run(self, request_id: str, sink: Callable[[object], None], msg: tuple) -> None:
        with self._lock:
            self._check_alive()
            if request_id in self._sinks:
                raise InvalidRequest.already_running(request_id)
            self._sinks[request_id] = sink
        try:
            self._send(msg)
        except EngineDeadError:
            with self._lock:
                self._sinks.pop(request_id, None)
            raise

    async def generate(self, request_id: str, prompt=None, prompt_token_ids=None, sampling_params=None,
                       reasoning_parser=None, chat_template_kwargs=None, text_options=None, prepared=None):
        """Yield the request's `RequestOutput` deltas until one has finished=True (as `AsyncLLMEngine.generate`)."""
        if prepared is None:
            prepared = await self.prepare(prompt, prompt_token_ids, sampling_params, reasoning_parser,
                                          chat_template_kwargs, text_options)
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        self.submit(request_id, prepared, lambda item: loop.call_soon_threadsafe(queue.put_nowait, item))
        async with contextlib.aclosing(drain(queue, lambda: self.abort_sync(request_id))) as outs:
            async for item in outs:
                yield item

    async def abort(self, request_id: str) -> None:
        self.abort_sync(request_id)

    def abort_sync(self, request_id: str) -> None:
        """Thread-safe: abort the request (its sink gets a final output with finish_reason "abort")."""
        if self._error is None and not self._stopping:
            try:
                self._send(("abort", request_id))
            except EngineDeadError:
                pass

    def stats(self) -> dict:
        return dict(self._stats)

    def is_healthy(self) -> bool:
        return (self._error is None and not self._stopping and self._child_healthy and self.proc.poll() is None
                and self._receiver.is_alive())

    @property
    def dead_reason(self) -> str | None:
        return self._error

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def is_running(self) -> bool:
        return self.proc.poll() is None

    def shutdown(self, timeout: float | None = EXIT_GRACE_S) -> None:
        """Ask the engine to stop (its open requests end with EngineDeadError), wait for the process, kill it if it
        does not exit in `timeout` seconds, join the receiver."""
        with self._lock:
            self._stopping = True
        if self.proc.poll() is None:
            try:
                self._send(("shutdown",))
            except EngineDeadError:
                pass
            try:
                self.proc.wait(timeout)
            except Exception:  # noqa: BLE001 - TimeoutExpired: it is killed below
                pass
        self._kill()
        if threading.current_thread() is not self._receiver:
            self._receiver.join(5.0)
        self._fail_open("the engine was shut down")

    def _kill(self) -> None:
        """SIGKILL (the process ignores SIGTERM: its graceful end is the shutdown command) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(5.0)
            except Exception:  # noqa: BLE001
                log.error("the engine process (pid %d) did not exit after SIGKILL", self.proc.pid)
        self._spawner.stop()
        if threading.current_thread() is not self._spawner:
            self._spawner.join(5.0)
        self._conn.close()

    # ---- the receiver thread ---------------------------------------------------------------------------------
    def _receive(self) -> None:
        try:
            while True:
                batch = self._conn.recv()
                for msg in batch:
                    self._dispatch(msg)
        except (EOFError, OSError, ValueError):
            pass
        except BaseException as e:  # noqa: BLE001 - a message that cannot be read: the connection is unusable
            log.exception("reading from the engine process failed")
            self._error = self._error or f"the connection to the engine process broke: {describe(e)}"
        if not self._stopping:
            try:
                self.proc.wait(2.0)
            except Exception:  # noqa: BLE001
                pass
            self._error = self._error or f"the engine process exited ({self._exit_note()})"
            log.error("%s", self._error)
        self._fail_open(self._error or "the engine was shut down")

    def _dispatch(self, msg) -> None:
        kind = msg[0]
        if kind == "out":
            rid, item = msg[1], unpack_output(msg[2])
            with self._lock:
                final = isinstance(item, BaseException) or item.finished
                sink = self._sinks.pop(rid, None) if final else self._sinks.get(rid)
            if sink is not None:
                try:
                    sink(item)
                except Exception:  # the receiver's fault: its request is aborted, the others go on
                    log.exception("the output receiver of request %s failed", rid)
                    if not final:
                        with self._lock:
                            self._sinks.pop(rid, None)
                        self.abort_sync(rid)
        elif kind == "prepared":
            with self._lock:
                fut = self._pending.pop(msg[1], None)
            if fut is not None and not fut.done():
                if isinstance(msg[2], BaseException):
                    fut.set_exception(msg[2])
                else:
                    fut.set_result(msg[2])
        elif kind == "stats":
            self._stats, self._child_healthy = msg[1], msg[2]
            if msg[3] is not None and self._error is None:
                self._error = msg[3]

    def _fail_pending(self) -> None:
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for fut in pending:
            if not fut.done():
                fut.set_exception(EngineDeadError(f"the engine is dead: {self._error}" if self._error is not None
                                                  else "the engine is shut down"))

    def _fail_open(self, message: str) -> None:
        with self._lock:
            sinks, self._sinks = list(self._sinks.items()), {}
        for rid, sink in sinks:
            try:
                sink(EngineDeadError(message))
            except Exception:  # noqa: BLE001
                log.exception("the output receiver of request %s failed", rid)
        self._fail_pending()
