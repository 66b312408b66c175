"""Finding the tensor-parallel worker processes of an engine (their argv carries `m3serve-tp-worker parent=PID`)
and the engine processes of a server (`m3serve-engine parent=PID`), and telling whether a process is still alive
(a zombie is not)."""
from __future__ import annotations

import os
import time

TAG = b"m3serve-tp-worker"
ENGINE_TAG = b"m3serve-engine"


def cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def worker_pids(parent: int | None = None, tag: bytes = TAG) -> list[int]:
    """Live worker processes started by engine process `parent` (any engine's: None); with `tag=ENGINE_TAG`, the
    engine processes a server's stub started."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            args = cmdline(int(d)).split(b"\0")
            if tag in args and (parent is None or f"parent={parent}".encode() in args) and alive(int(d)):
                out.append(int(d))
    return sorted(out)


def engine_pids(stub: int) -> list[int]:
    return worker_pids(stub, ENGINE_TAG)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_until(cond, timeout: float, period: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(period)
    return bool(cond())
