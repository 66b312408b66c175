"""The engine in a process of its own: its main loop, and the wire to its client (`EngineProcess`,
engine/process_client.py).

The wire: one socket pair, `multiprocessing.connection` framing, pickles. To the engine: ("prepare", token, kwargs),
("submit", request id, prepared), ("start", request id, kwargs: prepare and submit), ("abort", request id),
("shutdown",). From it: batches of events, one message per batch (a step's outputs travel together): ("out",
request id, output as a tuple of its fields, or exception), ("prepared", token, prepared or exception), ("stats",
stats, healthy, dead reason). The engine process runs `AsyncLLMEngine` (or what the $M3SERVE_TEST_ENGINE_FACTORY
builds) unchanged: its own main thread reads commands, one thread writes events.

Faults: an engine that dies (a device fault) says so in its next stats and its streams end with `EngineDeadError`
as in process; a process that exits or is killed ends the connection: every open request gets `EngineDeadError`,
`is_healthy()` turns False, and `dead_reason` has the exit status. The process dies with its parent
(PR_SET_PDEATHSIG + a watchdog, as the tensor-parallel workers do), and spawns those workers itself.
"""
from __future__ import annotations

import asyncio
import dataclasses
import importlib
import importlib.util
import logging
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

from m3serve.config import EngineConfig
from m3serve.engine.async_engine import EngineDeadError
from m3serve.engine.faults import RequestFailed, describe
from m3serve.engine.outputs import RequestOutput
from m3serve.engine.sampling_params import InvalidRequest

log = logging.getLogger(__name__)

ENV = "M3SERVE_ENGINE_PROCESS"
ARGV_TAG = "m3serve-engine"
BOOTSTRAP = ("import json, os, sys; a = json.loads(os.environ.pop('M3SERVE_ENGINE_PROCESS')); "
             "sys.path[:] = a['sys_path']; from m3serve.engine.engine_process import child_main; child_main(a)")
STATS_PERIOD_S = 0.1
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


def pack_output(item):
    """An output as a tuple of its fields (a dataclass pickles ~5x slower: 64 per step), or a wire error."""
    if isinstance(item, BaseException):
        return _wire_error(item)
    return tuple(getattr(item, name) for name in _OUTPUT_FIELDS)


def unpack_output(item):
    return item if isinstance(item, BaseException) else RequestOutput(*item)


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
            self.engine.submit(rid, prepared, lambda item: put(("out", rid, pack_output(item))))
        except Exception as e:  # noqa: BLE001 - its own failure (an id already running, a dead engine)
            self._fail(rid, e)

    def _fail(self, rid: str, e: BaseException) -> None:
        self.outbox.put(("out", rid, pack_output(e)), now=True)

    def _start(self, rid: str, kwargs: dict) -> None:
        """The engine's own `start` (prepared on its pool, then submitted; no hop through this process's event
        loop): outputs gather for the round's message, a failure to start is the request's one event, sent at once
        (it may come outside any round)."""
        put = self.outbox.put

        def sink(item) -> None:
            put(("out", rid, pack_output(item)), now=isinstance(item, BaseException))
        try:
            self.engine.start(rid, sink, **kwargs)
        except Exception as e:  # noqa: BLE001 - an id already running or starting, a dead engine
            self._fail(rid, e)

    def _abort(self, rid: str) -> None:
        self.engine.abort_sync(rid)  # one that is still being prepared is aborted once it is submitted (`start`)


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
        conn.send(("ready", dict(stats=engine.stats(),  # not its tokenizer: text is decoded here, in the engine
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
