"""`EngineProcess`: the engine in a process of its own, behind the interface the Triton model drives.

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
    engine.abort_sync("r1"); engine.stats(); engine.is_healthy(); engine.shutdown()

`generate` (async) is there too, as on `AsyncLLMEngine`.

The wire: one socket pair, `multiprocessing.connection` framing, pickles. To the engine: ("prepare", token, kwargs),
("submit", request id, prepared), ("abort", request id), ("shutdown",). From it: batches of events, one message per
batch (a step's outputs travel together): ("out", request id, output as a tuple of its fields, or exception),
("prepared", token, prepared or exception), ("stats", stats, healthy, dead reason). The engine process runs `AsyncLLMEngine` (or what the
$M3SERVE_TEST_ENGINE_FACTORY builds) unchanged: its own main thread reads commands, one thread writes events.

Faults: an engine that dies (a device fault) says so in its next stats and its streams end with `EngineDeadError`
as in process; a process that exits or is killed ends the connection: every open request gets `EngineDeadError`,
`is_healthy()` turns False, and `dead_reason` has the exit status. The process dies with its parent
(PR_SET_PDEATHSIG + a watchdog, as the tensor-parallel workers do), and spawns those workers itself.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import importlib.util
import itertools
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection

from m3serve.config import EngineConfig
from m3serve.engine.async_engine import EngineDeadError, drain
from m3serve.engine.faults import RequestFailed, describe
from m3serve.engine.outputs import RequestOutput
from m3serve.engine.sampling_params import InvalidRequest

log = logging.getLogger(__name__)

ENV = "M3SERVE_ENGINE_PROCESS"
ARGV_TAG = "m3serve-engine"
BOOTSTRAP = ("import json, os, sys; a = json.loads(os.environ.pop('M3SERVE_ENGINE_PROCESS')); "
             "sys.path[:] = a['sys_path']; from m3serve.engine.engine_process import child_main; child_main(a)")
STARTUP_TIMEOUT_S = float(os.environ.get("M3SERVE_ENGINE_STARTUP_TIMEOUT_S", "3600"))  # imports + weights
STATS_PERIOD_S = 0.1
EXIT_GRACE_S = 10.0
# exceptions that cross as they are; any other becomes RequestFailed (it may not pickle, or not mean anything here)
_WIRE_ERRORS = (InvalidRequest, RequestFailed, EngineDeadError)


def build_engine(config: EngineConfig, factory: str | None = None):
    """The engine for `config`: `AsyncLLMEngine`, or what ``factory`` ("package.module:function" or
    "/path/to/file.py:function", called with the config) returns (tests and benchmarks: an engine with injected
    faults, random weights of a real geometry, a zero-cost engine)."""
    if not factory:
        from m3serve.engine.async_engine import AsyncLLMEngine
        return AsyncLLMEngine(config)
    mod, _, fn = factory.rpartition(":")
    if mod.endswith(".py"):
        spec = importlib.util.spec_from_file_location(os.path.basename(mod)[:-3], mod)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(mod)
    return getattr(module, fn)(config)


def _wire_error(e: BaseException) -> BaseException:
    return e if isinstance(e, _WIRE_ERRORS) else RequestFailed(describe(e))


_OUTPUT_FIELDS = tuple(f.name for f in dataclasses.fields(RequestOutput))


def _pack(item):
    """An output as a tuple of its fields (a dataclass pickles ~5x slower: 64 per step), or a wire error."""
    if isinstance(item, BaseException):
        return _wire_error(item)
    return tuple(getattr(item, name) for name in _OUTPUT_FIELDS)


def _unpack(item):
    return item if isinstance(item, BaseException) else RequestOutput(*item)


# ---- the server process's side ------------------------------------------------------------------------------
class EngineProcess:
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
        self.tokenizer = info["tokenizer"]
        self.max_model_len = info["max_model_len"]
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
                      chat_template_kwargs=None):
        """Validate and tokenize a request in the engine process (InvalidRequest naming the option)."""
        self._check_alive()
        fut: Future = Future()
        with self._lock:
            token = next(self._tokens)
            self._pending[token] = fut
        self._send(("prepare", token, dict(prompt=prompt, prompt_token_ids=prompt_token_ids,
                                            sampling_params=sampling_params, reasoning_parser=reasoning_parser,
                                            chat_template_kwargs=chat_template_kwargs)))
        if self._error is not None:  # died while it was being sent: the receiver may have failed the table first
            self._fail_pending()
        return await asyncio.wrap_future(fut)

    def submit(self, request_id: str, prepared, sink: Callable[[object], None]) -> None:
        """As `AsyncLLMEngine.submit`: `sink` gets the request's outputs (or the exception that ends it) in order,
        on this object's receiver thread; it must be quick and must not block."""
        with self._lock:
            self._check_alive()
            if request_id in self._sinks:
                raise InvalidRequest("request_id", f"request {request_id!r} is already running")
            self._sinks[request_id] = sink
        try:
            self._send(("submit", request_id, prepared))
        except EngineDeadError:
            with self._lock:
                self._sinks.pop(request_id, None)
            raise

    async def generate(self, request_id: str, prompt=None, prompt_token_ids=None, sampling_params=None,
                       reasoning_parser=None, chat_template_kwargs=None, prepared=None):
        """Yield the request's `RequestOutput` deltas until one has finished=True (as `AsyncLLMEngine.generate`)."""
        if prepared is None:
            prepared = await self.prepare(prompt, prompt_token_ids, sampling_params, reasoning_parser,
                                          chat_template_kwargs)
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
            rid, item = msg[1], _unpack(msg[2])
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


# ---- the engine process --------------------------------------------------------------------------------------
class _Outbox:
    """Events for the server process, written by one thread. Outputs gather until the engine's round ends
    (`flush`, an `AsyncLLMEngine.round_listeners` entry): a step's outputs travel as one message, and the engine thread
    wakes this one once per step, not once per output. Other events (a prepared request, a command's failure) go at
    once; the engine's stats every STATS_PERIOD_S (which also sends what an engine that died left here)."""

    def __init__(self, conn: Connection, engine):
        self.conn, self.engine = conn, engine
        self._cv = threading.Condition()
        self._items: list = []
        self._due = False
        self._closed = False
        self.eager = False  # every event goes at once (an engine without `round_listeners`)
        self._thread = threading.Thread(target=self._run, name="m3serve-engine-outbox", daemon=True)
        self._thread.start()

    def put(self, msg, now: bool = False) -> None:
        with self._cv:
            self._items.append(msg)
            if now or self.eager:
                self._due = True
                self._cv.notify()

    def flush(self) -> None:
        with self._cv:
            if self._items:
                self._due = True
                self._cv.notify()

    def close(self) -> None:
        """Send what is left (and the last stats), then stop."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(10.0)

    def _stats_msg(self) -> tuple:
        healthy = self.engine.is_healthy()
        reason = getattr(self.engine, "dead_reason", None)
        return ("stats", self.engine.stats(), healthy, reason if not healthy else None)

    def _run(self) -> None:
        next_stats = 0.0
        while True:
            with self._cv:
                while not self._due and not self._closed and time.monotonic() < next_stats:
                    self._cv.wait(max(0.0, next_stats - time.monotonic()))
                batch, self._items, self._due = self._items, [], False
                closed = self._closed
            if time.monotonic() >= next_stats or closed:
                next_stats = time.monotonic() + STATS_PERIOD_S
                try:
                    batch.append(self._stats_msg())
                except Exception:  # noqa: BLE001 - an engine torn down under it: the outputs still go
                    log.exception("reading the engine's stats failed")
            if not self._write(batch) or closed:
                return

    def _write(self, batch: list) -> bool:
        """Send one batch; False once the server process is gone. An item that does not pickle ends its request
        (RequestFailed); the others go."""
        try:
            self.conn.send(batch)
            return True
        except OSError:
            return False
        except Exception:  # noqa: BLE001 - pickling failed (nothing was written): one by one
            for msg in batch:
                try:
                    self.conn.send([msg])
                except OSError:
                    return False
                except Exception as e:  # noqa: BLE001
                    if msg[0] in ("out", "prepared") and not self._write([(msg[0], msg[1], RequestFailed(
                            f"its output could not be sent: {describe(e)}"))]):
                        return False
            return True


class _Serve:
    """The engine process's main loop: commands in, events out (`_Outbox`)."""

    def __init__(self, conn: Connection, engine):
        self.conn, self.engine = conn, engine
        self.outbox = _Outbox(conn, engine)
        listeners = getattr(engine, "round_listeners", None)
        if listeners is not None:
            listeners.append(self.outbox.flush)
        else:  # an engine without rounds (a test double): each output goes on its own
            self.outbox.eager = True
        self.loop = asyncio.new_event_loop()  # runs `prepare` (a coroutine on every engine)
        threading.Thread(target=self.loop.run_forever, name="m3serve-engine-prepare", daemon=True).start()

    def run(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                break  # the server process is gone
            kind = msg[0]
            if kind == "shutdown":
                break
            try:
                getattr(self, "_" + kind)(*msg[1:])
            except Exception:  # noqa: BLE001 - a command that failed outside any request
                log.exception("engine process: command %s failed", kind)
        self.engine.shutdown()
        self.outbox.close()
        self.loop.call_soon_threadsafe(self.loop.stop)

    def _prepare(self, token: int, kwargs: dict) -> None:
        fut = asyncio.run_coroutine_threadsafe(self.engine.prepare(**kwargs), self.loop)

        def done(f):
            e = f.exception()
            self.outbox.put(("prepared", token, _wire_error(e) if e is not None else f.result()), now=True)
        fut.add_done_callback(done)

    def _submit(self, rid: str, prepared) -> None:
        put = self.outbox.put
        try:
            self.engine.submit(rid, prepared, lambda item: put(("out", rid, _pack(item))))
        except Exception as e:  # noqa: BLE001 - its own failure (an id already running, a dead engine)
            put(("out", rid, _pack(e)), now=True)

    def _abort(self, rid: str) -> None:
        self.engine.abort_sync(rid)


def child_main(args: dict) -> None:
    """The engine process: bound to its parent's life, builds the engine the first message describes, serves."""
    from m3serve.executor.worker_process import bind_to_parent, reset_signals

    bind_to_parent(args["parent_pid"])
    reset_signals()
    # the server process ends this one (`shutdown`, from the model's finalize) after its requests are answered: a
    # SIGTERM to the whole process group (a terminal, a benchmark) must not end the engine under the server first
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=os.environ.get("M3SERVE_LOG_LEVEL", "WARNING"),
                        format="[m3serve engine] %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    conn = Connection(args["fd"])
    try:
        _, config, factory = conn.recv()
        engine = build_engine(config, factory)
        conn.send(("ready", dict(tokenizer=getattr(engine, "tokenizer", None), stats=engine.stats(),
                                 max_model_len=getattr(engine, "max_model_len", None) or config.max_model_len)))
    except BaseException as e:  # noqa: BLE001 - reported to the server process, then this process ends
        try:
            conn.send(("failed", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        except (OSError, ValueError):
            pass
        sys.stderr.write(f"[m3serve engine] failed to start: {traceback.format_exc()}\n")
        os._exit(1)
    _Serve(conn, engine).run()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: the engine's daemon threads and CUDA state go with the process
