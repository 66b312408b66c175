"""The response thread: the ONLY thread that calls into the server after `initialize`.

Triton 2.51's stub crashed (boost::interprocess::lock_exception) when several threads called `send`,
`is_cancelled()` or metric updates at once, so every such call is made here, fed by a queue:

  execute() ──register/reject──▶ ┐
  engine event loop ──out/end──▶ ├─ queue ─▶ responder thread ─▶ send / is_cancelled / metrics
  finalize() ──abort_all/stop──▶ ┘

It also coalesces: whatever is queued for one stream when the thread gets to it goes out as ONE
response (deltas concatenated), so a busy server sends fewer, larger responses instead of falling
behind. Each `send` is a round trip to the server process (130-450 us, one at a time), so the thread
sends at most `DELTAS_PER_ROUND` deltas between two reads of its queue. A final response (which lets a
client send its next request) goes out as soon as it is read; a stream's first tokens go before every
other stream's deltas (they are its TTFT), then the streams that waited longest: neither waits behind a
sweep over every open stream (16 streams: ~2 ms of sends; 64: ~9 ms). Cancellation is
polled every `cancel_period` seconds per open request (not per token), engine stats are published every
`stats_period`, health checked every `health_period`.
"""
from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
from typing import Callable

from m3serve.triton.schema import CANCELLED, UNAVAILABLE

_STOP = object()
DELTAS_PER_ROUND = 8


def log(msg: str) -> None:
    # plain stderr (the server log): pb_utils.Logger is an IPC call, and IPC belongs to this thread only
    print(f"[m3serve] {msg}", file=sys.stderr, flush=True)


class Group:
    """One Triton request: its response sender and the engine requests (items) it fans out to."""

    __slots__ = ("sender", "requested", "client_id", "arrival", "items", "pending", "closed", "on_close")

    def __init__(self, sender, requested: frozenset = frozenset(), client_id: str = "",
                 on_close: Callable[["Group"], None] | None = None):
        self.sender = sender
        self.requested = requested
        self.client_id = client_id
        self.arrival = time.monotonic()
        self.items: list[Item] = []
        self.pending = 0
        self.closed = False
        self.on_close = on_close


class Item:
    """One engine request of a group; `builder` is its contract's response builder (TextStream / IdsStream)."""

    __slots__ = ("rid", "group", "builder", "t_first", "t_last", "done")

    def __init__(self, rid: str, group: Group, builder):
        self.rid = rid
        self.group = group
        self.builder = builder
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.done = False
        group.items.append(self)
        group.pending += 1


class Responder:
    def __init__(self, pb, metrics, *, abort: Callable[[str], None],
                 stats: Callable[[], dict] | None = None, healthy: Callable[[], bool] | None = None,
                 on_unhealthy: Callable[[], None] | None = None, cancel_period: float = 0.05,
                 stats_period: float = 0.25, health_period: float = 1.0, name: str = "m3serve",
                 coalesce: bool = True):
        self.pb = pb
        self.metrics = metrics
        self._abort = abort
        self._stats = stats
        self._healthy = healthy
        self._on_unhealthy = on_unhealthy
        self.cancel_period = cancel_period
        self.stats_period = stats_period
        self.health_period = health_period
        self.coalesce = coalesce
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._groups: dict[int, Group] = {}
        self.num_active = 0  # read by other threads (an int store is atomic)
        self.unhealthy = False
        self.num_responses = 0  # responses sent, and seconds spent building + sending them (metrics)
        self.send_seconds = 0.0
        self._codes = {c: getattr(pb.TritonError, c, pb.TritonError.INTERNAL)
                       for c in ("INVALID_ARG", "UNAVAILABLE", "CANCELLED", "INTERNAL", "UNSUPPORTED",
                                 "NOT_FOUND", "UNKNOWN")}
        now = time.monotonic()
        self._next_cancel = now + cancel_period
        self._next_stats = now
        self._next_health = now + health_period
        self._thread = threading.Thread(target=self._run, name=f"{name}-responder", daemon=True)

    # ---- producer side (any thread) ------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def register(self, group: Group) -> None:
        self._q.put(("new", group))

    def output(self, item: Item, out) -> None:
        self._q.put(("out", item, out))

    def end(self, item: Item, code: str | None = None, message: str | None = None) -> None:
        self._q.put(("end", item, code, message))

    def reject(self, sender, code: str, message: str) -> None:
        self._q.put(("reject", sender, code, message))

    def empty_final(self, sender) -> None:
        self._q.put(("empty", sender))

    def abort_all(self, code: str, message: str) -> None:
        self._q.put(("abort_all", code, message))

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            self._q.put(_STOP)
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        stop = False
        # streams with unsent deltas: `fresh` has sent no token yet (its first goes out first), `dirty` the rest, the
        # longest waiting first
        fresh: dict[Item, None] = {}
        dirty: dict[Item, None] = {}
        while not stop:
            timeout = 0.0 if fresh or dirty else \
                max(0.0, min(self._next_cancel, self._next_stats, self._next_health) - time.monotonic())
            batch = []
            try:
                batch.append(self._q.get(timeout=timeout) if timeout else self._q.get_nowait())
                while len(batch) < 4096:
                    batch.append(self._q.get_nowait())
            except queue.Empty:
                pass
            for msg in batch:
                if msg is _STOP:
                    stop = True
                    continue
                try:
                    self._handle(msg, fresh, dirty)
                except Exception:
                    log(f"response thread: {traceback.format_exc()}")
            for _ in range(len(fresh) + len(dirty) if stop else min(len(fresh) + len(dirty), DELTAS_PER_ROUND)):
                waiting = fresh or dirty
                item = next(iter(waiting))
                del waiting[item]
                try:
                    self._flush(item)
                except Exception:
                    log(f"response thread: {traceback.format_exc()}")
            try:
                self._timers()
            except Exception:
                log(f"response thread timers: {traceback.format_exc()}")
        self._fail_all(UNAVAILABLE, "the model is being unloaded")
        try:
            self._publish_stats()
        except Exception:
            pass

    def _handle(self, msg, fresh: dict, dirty: dict) -> None:
        kind = msg[0]
        if kind == "out":
            item, out = msg[1], msg[2]
            if item.done or item.group.closed:
                return
            first = False
            if out.new_token_ids:
                now = time.monotonic()
                if item.t_first is None:
                    item.t_first, first = now, True
                    self.metrics.first_token(now - item.group.arrival)
                item.t_last = now
            item.builder.add(out)
            if out.finished:
                fresh.pop(item, None)
                dirty.pop(item, None)
                self._finish(item)
            elif not self.coalesce:
                self._flush(item)
            elif first:
                dirty.pop(item, None)  # (a response without tokens may wait there)
                fresh[item] = None
            elif item not in fresh:
                dirty[item] = None
        elif kind == "new":
            g = msg[1]
            self._groups[id(g)] = g
            self.num_active = len(self._groups)
        elif kind == "end":
            item, code, message = msg[1], msg[2], msg[3]
            fresh.pop(item, None)
            dirty.pop(item, None)
            if item.done or item.group.closed:
                return
            if code is None:
                item.builder.finished = True
                self._finish(item)
            else:
                self._fail(item.group, code, message)
        elif kind == "reject":
            self._send_raw(msg[1], None, msg[2], msg[3])
        elif kind == "empty":
            self._send_raw(msg[1], {}, None, None)
        elif kind == "abort_all":
            self._fail_all(msg[1], msg[2])

    def _flush(self, item: Item) -> None:
        if item.done or item.group.closed:
            return
        tensors = item.builder.take(False)
        if tensors is not None:
            self._send(item.group, tensors, False)

    def _finish(self, item: Item) -> None:
        g = item.group
        item.done = True
        g.pending -= 1
        tensors = item.builder.take(True)
        self._send(g, tensors if tensors is not None else {}, g.pending <= 0)
        b = item.builder
        now = time.monotonic()
        self.metrics.request_done(now - g.arrival, b.num_input, b.num_output, b.finish_reason)
        if item.t_first is not None and item.t_last is not None and b.num_output > 1:
            self.metrics.inter_token((item.t_last - item.t_first) / (b.num_output - 1))

    def _fail(self, g: Group, code: str, message: str) -> None:
        """An error ends the whole Triton request: abort its other engine requests, one error FINAL."""
        self._abort_items(g, counted=lambda item: item.t_first is not None or code == CANCELLED)
        self._send(g, None, True, code, message)

    def _abort_items(self, g: Group, counted: Callable[[Item], bool]) -> None:
        """Stop the group's unfinished engine requests; those `counted` end as finished_reason "abort"
        in the metrics (cancelled, disconnected, or stopped after their first token)."""
        for item in g.items:
            if not item.done:
                item.done = True
                try:
                    self._abort(item.rid)
                except Exception:
                    log(f"abort {item.rid}: {traceback.format_exc()}")
                if counted(item):
                    b = item.builder
                    self.metrics.request_done(time.monotonic() - g.arrival, b.num_input, b.num_output, "abort")

    def _fail_all(self, code: str, message: str) -> None:
        for g in list(self._groups.values()):
            self._fail(g, code, message)

    def _timers(self) -> None:
        now = time.monotonic()
        if now >= self._next_cancel:
            self._next_cancel = now + self.cancel_period
            for g in list(self._groups.values()):
                try:
                    cancelled = g.sender.is_cancelled()
                except Exception:
                    cancelled = False
                if cancelled:
                    self._fail(g, CANCELLED, "Request was cancelled")
        if now >= self._next_health and self._healthy is not None:
            self._next_health = now + self.health_period
            if not self.unhealthy and not self._healthy():
                self.unhealthy = True
                log("the engine is not healthy: failing open requests with UNAVAILABLE")
                self._fail_all(UNAVAILABLE, "the engine is not healthy; the model is unavailable")
                if self._on_unhealthy is not None:
                    self._on_unhealthy()
        if now >= self._next_stats:
            self._next_stats = now + self.stats_period
            self._publish_stats()

    def _publish_stats(self) -> None:
        if self._stats is not None and self.metrics.enabled:
            self.metrics.engine_stats(self._stats(), len(self._groups))
            self.metrics.responder_stats(self.num_responses, self.send_seconds)

    # ---- sending ---------------------------------------------------------------------------------
    def _response(self, tensors: dict | None, requested: frozenset, code: str | None, message: str | None):
        pb = self.pb
        if code is not None:
            return pb.InferenceResponse(output_tensors=[], error=pb.TritonError(message, self._codes.get(code)))
        return pb.InferenceResponse(output_tensors=[pb.Tensor(k, v) for k, v in tensors.items()
                                                    if not requested or k in requested])

    def _send(self, g: Group, tensors: dict | None, final: bool, code: str | None = None,
              message: str | None = None) -> None:
        if g.closed:
            return
        flags = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        try:
            t0 = time.perf_counter()
            g.sender.send(self._response(tensors, g.requested, code, message), flags=flags)
            self.send_seconds += time.perf_counter() - t0
            self.num_responses += 1
        except Exception as e:
            log(f"send failed ({'final' if final else 'delta'}): {e}")
            if not final:  # the stream is broken (client gone): stop its work, count it aborted, close it
                self._abort_items(g, counted=lambda item: True)
                try:
                    g.sender.send(flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                except Exception:
                    pass
                final = True
        if final:
            g.closed = True
            self._groups.pop(id(g), None)
            self.num_active = len(self._groups)
            if g.on_close is not None:
                try:
                    g.on_close(g)
                except Exception:
                    log(f"on_close: {traceback.format_exc()}")

    def _send_raw(self, sender, tensors: dict | None, code: str | None, message: str | None) -> None:
        try:
            sender.send(self._response(tensors, frozenset(), code, message),
                        flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            self.num_responses += 1
        except Exception as e:
            log(f"send failed (error reply): {e}")
