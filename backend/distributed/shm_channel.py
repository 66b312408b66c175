"""Rank 0 -> worker processes: commands with a shared-memory payload, and worker -> rank 0 status messages.

- The payload (a step, `step_codec`) is written once into an anonymous shared-memory file (`memfd_create`) that
  every worker maps: no name in /dev/shm, so nothing can leak, whoever dies first. It grows when a step needs more
  (rank 0 `ftruncate`s it; a worker remaps when a message says the payload is larger than its mapping).
- Each worker has a Unix socketpair (SOCK_SEQPACKET) to rank 0. Rank 0 sends one 24-byte command per step
  (`cmd, arg, payload bytes`); the worker blocks on it (waking every `poll_s` to check its parent). Workers send
  JSON status messages back (ready, cache_ready, error). `MSG_NOSIGNAL`: a dead peer is an exception, never SIGPIPE.

One payload slot is enough: a worker copies the step out before its first collective, and rank 0 cannot finish a
step (so cannot write the next one) before every worker has joined that step's collectives.
"""
from __future__ import annotations

import json
import mmap
import os
import select
import socket
import struct

import torch

from m3serve.distributed import step_codec

CMD = struct.Struct("<qqq")  # command, argument, payload bytes (0: none)
INIT, STEP, SHUTDOWN = 1, 2, 3  # INIT(num_pages): join the process group, allocate the KV cache
INITIAL_BYTES = 4 << 20
MAX_STATUS_BYTES = 60_000


def _socket_send(sock: socket.socket, data: bytes) -> None:
    sock.sendmsg([data], [], socket.MSG_NOSIGNAL)


class _Mapping:
    """A read-write mapping of the shared-memory file, remapped when the file grows."""

    def __init__(self, fd: int):
        self.fd, self.mm, self.size = fd, None, 0
        self.buf: torch.Tensor | None = None

    def ensure(self, size: int) -> torch.Tensor:
        if size > self.size:
            self.close()
            self.size = os.fstat(self.fd).st_size
            self.mm = mmap.mmap(self.fd, self.size)
            self.buf = torch.frombuffer(self.mm, dtype=torch.uint8)
        return self.buf

    def close(self) -> None:
        self.buf = None
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # a view is still alive: the mapping goes with it
                pass
            self.mm = None


class Broadcaster:
    """Rank 0's side, for `num_workers` workers (ranks 1..num_workers)."""

    def __init__(self, num_workers: int, initial_bytes: int = INITIAL_BYTES):
        self.fd = os.memfd_create("m3serve-step", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, initial_bytes)
        self.map = _Mapping(self.fd)
        self.map.ensure(initial_bytes)
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(num_workers)]
        self.socks = [a for a, _ in pairs]
        self.worker_socks = [b for _, b in pairs]  # handed to the children, then closed here

    def worker_fds(self, worker: int) -> tuple[int, int]:
        """(shared-memory fd, socket fd) to pass to worker `worker` (0-based) at spawn."""
        return self.fd, self.worker_socks[worker].fileno()

    def spawned(self) -> None:
        """The children hold their ends now: close ours (so a dead child shows as a closed socket)."""
        for s in self.worker_socks:
            s.close()
        self.worker_socks = []

    def send(self, cmd: int, arg: int = 0, obj=None) -> None:
        """Write `obj` (a step) to shared memory, then send the command to every worker."""
        nbytes = 0
        if obj is not None:
            enc = step_codec.encode(obj)
            nbytes = enc.nbytes
            if nbytes > self.map.size:
                os.ftruncate(self.fd, max(nbytes, 2 * self.map.size))
            enc.write_into(self.map.ensure(nbytes))
        msg = CMD.pack(cmd, arg, nbytes)
        for rank, s in enumerate(self.socks, start=1):
            try:
                _socket_send(s, msg)
            except OSError as e:
                raise ConnectionError(f"tensor-parallel worker rank {rank} is gone ({e})") from None

    def poll_status(self, timeout: float) -> list[tuple[int, dict]]:
        """Status messages that arrive within `timeout` s: [(rank, message)]; a closed socket reads as
        {"event": "closed"}."""
        ready, _, _ = select.select(self.socks, [], [], timeout)
        out = []
        for s in ready:
            rank = self.socks.index(s) + 1
            try:
                data = s.recv(MAX_STATUS_BYTES + 1024)
            except OSError:
                data = b""
            out.append((rank, json.loads(data) if data else {"event": "closed"}))
        return out

    def close(self) -> None:
        for s in self.socks + self.worker_socks:
            s.close()
        self.socks, self.worker_socks = [], []
        self.map.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Receiver:
    """A worker's side, from the fds it inherited."""

    def __init__(self, shm_fd: int, sock_fd: int):
        self.map = _Mapping(shm_fd)
        self.sock = socket.socket(fileno=sock_fd)

    def status(self, event: str, **fields) -> None:
        msg = dict(event=event, **fields)
        if len(msg.get("message", "")) > MAX_STATUS_BYTES:
            msg["message"] = "..." + msg["message"][-MAX_STATUS_BYTES:]
        _socket_send(self.sock, json.dumps(msg).encode())

    def wait(self, poll_s: float, alive) -> tuple[int, int, object]:
        """Block until the next command: (cmd, arg, decoded payload or None). Every `poll_s` seconds `alive()` is
        asked whether to keep waiting; a closed socket (rank 0 gone) reads as SHUTDOWN."""
        while True:
            ready, _, _ = select.select([self.sock], [], [], poll_s)
            if not ready:
                if not alive():
                    return SHUTDOWN, 0, None
                continue
            data = self.sock.recv(CMD.size)
            if len(data) != CMD.size:
                return SHUTDOWN, 0, None
            cmd, arg, nbytes = CMD.unpack(data)
            obj = step_codec.decode(self.map.ensure(nbytes)) if nbytes else None
            return cmd, arg, obj

    def close(self) -> None:
        self.sock.close()
        self.map.close()
