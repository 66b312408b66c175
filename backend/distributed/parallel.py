"""Which rank of a tensor-parallel engine this process is, and the collectives the layers call.

A model is built with a `Parallel`: its rank, the group size, whether the routed experts are expert-parallel, and
(once `join_group` has run) the torch.distributed group the collectives go over: NCCL on CUDA, gloo on CPU (the
same calls). Without a group at size 1 every collective is the identity, so one model code serves one process and
N; a group of size 1 (a GPU test of the collective path on one device) runs them all the same. A `Parallel` of
size > 1 without a group only says which shard to load (tests load rank r of N in one process).

The collectives are the ones NCCL lets a CUDA graph capture (all-reduce, all-gather): the decode graphs of every
rank hold them (`executor/cuda_graph.py`).

Every collective of a group times out (`timeout_s`, $M3SERVE_TP_TIMEOUT_S): a rank that dies or hangs turns
into an exception on the others, never a wait without end. One tensor-parallel engine per process (the default
torch.distributed group).
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from m3serve.config import ConfigError

STORE_HOST = "127.0.0.1"  # the workers run on the engine's host


def default_timeout_s(device_type: str) -> float:
    """How long a rank waits for the others in one collective (gloo) or for one step's result (NCCL: the host waits
    on the GPU, where NCCL kernels may first wait for a peer's lazy kernel compilation, hence the longer default)."""
    env = os.environ.get("M3SERVE_TP_TIMEOUT_S")
    if env:
        return float(env)
    return 60.0 if device_type == "cuda" else 5.0


@dataclass
class Parallel:
    rank: int = 0
    size: int = 1
    expert_parallel: bool = False
    group: Any = None  # a torch.distributed ProcessGroup; None with size 1 or for loading only

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def split(self, n: int, what: str) -> tuple[int, int]:
        """[start, stop) of this rank's equal part of `n` (raises ConfigError when `n` does not divide)."""
        if n % self.size:
            raise ConfigError(f"{what}={n} is not divisible by tensor_parallel_size={self.size}")
        part = n // self.size
        return self.rank * part, (self.rank + 1) * part

    def part(self, n: int, what: str) -> int:
        start, stop = self.split(n, what)
        return stop - start

    def split_heads(self, n: int, what: str) -> tuple[int, int]:
        """[start, stop) of this rank's heads: an equal part of `n` heads, or, with fewer heads than ranks (KV heads
        at TP8), one head that size/n ranks share (replicated, as vLLM does)."""
        if n >= self.size or self.size % n:
            return self.split(n, what)
        head = self.rank // (self.size // n)
        return head, head + 1

    # ---- collectives (identity at size 1 without a group) ---------------------------------------
    @property
    def collective(self) -> bool:
        return self.size > 1 or self.group is not None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns x."""
        if self.collective:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim` in rank order, on every rank."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim)

    def gather_first(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Every rank's `x` concatenated along `dim` in rank order, on rank 0; None on the others. An all-gather
        (a point-to-point gather is not among what a CUDA graph captures for certain)."""
        if not self.collective:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim) if self.is_first else None


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def create_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store, served by the engine process on a free port (read it back from `.port`)."""
    return dist.TCPStore(STORE_HOST, 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def connect_store(port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(STORE_HOST, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def join_group(parallel: Parallel, store, device: torch.device, timeout_s: float) -> Parallel:
    """Join the engine's process group (every rank calls it at about the same time, after loading its shard) and
    give `parallel` (shared by all the model's layers) the group; returns it."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group: one tensor-parallel engine "
                           "per process (shut the other one down first)")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (see docs: it needs fabric setup)
    backend = backend_for(device)
    # gloo: the host blocks in each collective, so its timeout is the hang detector. NCCL: the host does not
    # block (rank 0 bounds its wait on the step's result itself); NCCL's watchdog only cleans up much later.
    pg_timeout = timeout_s if backend == "gloo" else max(5 * timeout_s, 600.0)
    dist.init_process_group(backend, store=store, rank=parallel.rank, world_size=parallel.size,
                            timeout=datetime.timedelta(seconds=pg_timeout))
    parallel.group = dist.group.WORLD
    return parallel


def destroy_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
