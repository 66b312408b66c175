"""`MultiprocExecutor`: tensor (or expert) parallelism over N ranks behind the `Executor` interface.

Rank 0 is a `Worker` in the engine process (the engine schedules and samples there); ranks 1..N-1 are worker
processes (`worker_process.py`), spawned here, so also from inside Triton's Python backend stub. Each step:
the `StepInput` (sampling fields stripped but for speculative steps: only rank 0 samples; every rank drafts) is written once to shared memory and a 24-byte
command wakes every worker (`distributed/shm_channel.py`); all ranks run the same forward, their collectives go
over the process group (NCCL on CUDA, gloo on CPU); the logits are gathered to rank 0, which samples.

Faults: a worker that exits breaks the next collective at once (gloo: connection reset); one that hangs makes
rank 0's collective time out (gloo) or its wait for the step's result time out (NCCL), after `timeout_s`. The
step then raises, the other workers are killed, the engine marks itself dead and fails every running request; `check_health` also notices a
worker that died while the engine was idle. `shutdown` (also run when the executor is garbage collected or the
interpreter exits) asks the workers to exit, then terminates and kills what is left; the workers also die with
the engine process (PR_SET_PDEATHSIG + a parent watchdog), so nothing outlives it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
import weakref

import torch

from m3serve.config import ConfigError, EngineConfig, ModelConfig
from m3serve.distributed import parallel as par
from m3serve.distributed import shm_channel as ch
from m3serve.step_io import SamplerOutput, StepInput
from m3serve.executor.executor import Executor
from m3serve.executor.worker import Worker
from m3serve.executor.worker_process import ARGV_TAG, BOOTSTRAP, ENV
from m3serve.model.sharding import check_divisible

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = float(os.environ.get("M3SERVE_TP_STARTUP_TIMEOUT_S", "3600"))  # imports + loading a shard
EXIT_GRACE_S = 5.0


def python_executable() -> str:
    """The interpreter for the workers: this one, unless it is an embedding binary (Triton's backend stub)."""
    exe = os.environ.get("M3SERVE_WORKER_PYTHON") or sys.executable
    if exe and os.path.basename(exe).startswith("python") and os.access(exe, os.X_OK):
        return exe
    v = sys.version_info
    for name in (f"python{v.major}.{v.minor}", "python3", "python"):
        cand = os.path.join(sys.exec_prefix, "bin", name)
        if os.access(cand, os.X_OK):
            return cand
    raise RuntimeError(f"no Python interpreter for the tensor-parallel workers (sys.executable={sys.executable!r}, "
                       f"prefix {sys.exec_prefix}): set $M3SERVE_WORKER_PYTHON")


class Spawner(threading.Thread):
    """Forks the workers (or the engine process) and lives exactly as long as they may: PR_SET_PDEATHSIG fires when
    the *thread* that forked a child ends, so forking from a caller's thread (which may end first) would kill them
    early."""

    def __init__(self, name: str = "m3serve-tp-spawner"):
        super().__init__(name=name, daemon=True)
        self.requests: queue.Queue = queue.Queue()

    def spawn(self, argv, env, pass_fds) -> subprocess.Popen:
        done: queue.Queue = queue.Queue()
        self.requests.put((argv, env, pass_fds, done))
        result = done.get()
        if isinstance(result, BaseException):
            raise result
        return result

    def stop(self) -> None:
        self.requests.put(None)

    def run(self) -> None:
        while True:
            item = self.requests.get()
            if item is None:
                return
            argv, env, pass_fds, done = item
            try:
                done.put(subprocess.Popen(argv, env=env, pass_fds=pass_fds, stdin=subprocess.DEVNULL))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                done.put(e)


def _release(procs: list[subprocess.Popen], channel: ch.Broadcaster, spawner: Spawner, grace: float,
             group: dict) -> None:
    """Ask the workers to exit, then SIGTERM, then SIGKILL; wait for every one (no zombie, no orphan); close the
    channel; leave the process group if this executor joined it (`group["joined"]`)."""
    try:
        channel.send(ch.SHUTDOWN)
    except (ConnectionError, OSError, ValueError):
        pass
    deadline = time.monotonic() + grace
    for sig in ("terminate", "kill"):
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        alive = [p for p in procs if p.poll() is None]
        if not alive:
            break
        for p in alive:
            getattr(p, sig)()
        deadline = time.monotonic() + 2.0
    for p in procs:
        try:
            p.wait(5.0)
        except subprocess.TimeoutExpired:
            log.error("tensor-parallel worker pid %d did not exit after SIGKILL", p.pid)
    channel.close()
    spawner.stop()
    if group.get("joined"):
        group["joined"] = False
        par.destroy_group()


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int, *, model=None,
                 load_report=None):
        if model is not None:
            raise ConfigError("tensor_parallel_size > 1 loads each rank's shard itself: a preloaded model "
                              "cannot be used")
        self.size = n = config.tensor_parallel_size
        check_divisible(model_config, n, config.enable_expert_parallel)
        self.devices = self._devices(config.device, n)
        self.timeout_s = par.default_timeout_s(self.devices[0].type)
        self.procs: list[subprocess.Popen] = []
        self.failure: str | None = None
        self._lock = threading.Lock()  # held by a step; shutdown waits for it (briefly) before destroying the group
        self._closed = False
        self._group = {"joined": False}  # shared with the finalizer
        self._store = par.create_store(n, STARTUP_TIMEOUT_S)
        self.channel = ch.Broadcaster(n - 1)
        self._spawner = Spawner()
        self._spawner.start()
        self._finalizer = weakref.finalize(self, _release, self.procs, self.channel, self._spawner, EXIT_GRACE_S,
                                           self._group)
        try:
            self._spawn(config, model_config, max_model_len)
            self._startup(config, model_config, max_model_len)
        except BaseException:
            self.shutdown()
            raise
        log.info("tensor parallelism: %d ranks (%s, %s), worker pids %s", n, par.backend_for(self.devices[0]),
                 "expert-parallel MoE" if config.enable_expert_parallel else "tensor-parallel MoE",
                 [p.pid for p in self.procs])

    @staticmethod
    def _devices(device: str, n: int) -> list[torch.device]:
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            return [torch.device("cpu")] * n
        if device != "cuda":
            raise ConfigError(f"device {device!r}: with tensor_parallel_size={n} use 'cuda' (rank r runs on cuda:r; "
                              "choose the GPUs with CUDA_VISIBLE_DEVICES), 'cpu' or 'auto'")
        if torch.cuda.device_count() < n:
            raise ConfigError(f"tensor_parallel_size={n} needs {n} GPUs, {torch.cuda.device_count()} visible")
        return [torch.device("cuda", r) for r in range(n)]

    # ---- startup ---------------------------------------------------------------------------------
    def _spawn(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int) -> None:
        python = python_executable()
        log.info("starting %d tensor-parallel worker processes (%s)", self.size - 1, python)
        threads = max(1, torch.get_num_threads() // self.size) if self.devices[0].type == "cpu" else 1
        for rank in range(1, self.size):
            shm_fd, sock_fd = self.channel.worker_fds(rank - 1)
            args = dict(rank=rank, world_size=self.size, parent_pid=os.getpid(), store_port=self._store.port,
                        device=str(self.devices[rank]), expert_parallel=config.enable_expert_parallel,
                        timeout_s=self.timeout_s, shm_fd=shm_fd, sock_fd=sock_fd, num_threads=threads,
                        max_model_len=max_model_len, engine_config=dataclasses.asdict(config),
                        model_config=dataclasses.asdict(model_config), sys_path=list(sys.path))
            env = dict(os.environ, **{ENV: json.dumps(args)})
            env.setdefault("NCCL_NVLS_ENABLE", "0")
            argv = [python, "-c", BOOTSTRAP, ARGV_TAG, f"rank={rank}", f"parent={os.getpid()}"]
            self.procs.append(self._spawner.spawn(argv, env, (shm_fd, sock_fd)))
        self.channel.spawned()

    def _await(self, event: str, what: str) -> dict[int, dict]:
        """Each worker's next status, which must be `event`; raise naming the rank on an error or an exit."""
        got: dict[int, dict] = {}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(got) < self.size - 1:
            for rank, msg in self.channel.poll_status(0.2):
                if msg["event"] != event:
                    raise RuntimeError(f"tensor-parallel rank {rank} failed while {what}: "
                                       f"{msg.get('message') or self._exit_note(rank)}")
                got[rank] = msg
            for rank, p in enumerate(self.procs, start=1):
                if rank not in got and p.poll() is not None:
                    raise RuntimeError(f"tensor-parallel rank {rank} failed while {what}: {self._exit_note(rank)}")
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, self.size)) - set(got))
                raise TimeoutError(f"tensor-parallel ranks {missing} took longer than {STARTUP_TIMEOUT_S:.0f} s "
                                   f"({what}; $M3SERVE_TP_STARTUP_TIMEOUT_S)")
        return got

    def _exit_note(self, rank: int) -> str:
        p = self.procs[rank - 1]
        try:
            code = p.wait(0.5)
        except subprocess.TimeoutExpired:
            return f"its connection closed (pid {p.pid} still running)"
        return f"the process (pid {p.pid}) exited with code {code} (its stderr is above)"

    def _startup(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int) -> None:
        """Every rank loads its shard (rank 0 here, while the workers start and load theirs), then all join the
        process group and allocate the pool with the pages the fullest rank allows."""
        self.parallel = par.Parallel(0, self.size, config.enable_expert_parallel)
        self.worker = w = Worker(config, model_config, parallel=self.parallel, device=self.devices[0])
        own = w.determine_num_pages(max_model_len)
        ready = self._await("ready", "loading its shard")
        pages = {0: own, **{r: m["num_pages"] for r, m in ready.items()}}
        self.num_pages = min(pages.values())
        log.info("KV pages per rank %s: the pool has %d pages on every rank", pages, self.num_pages)
        self.channel.send(ch.INIT, self.num_pages)
        par.join_group(self.parallel, self._store, self.devices[0], self.timeout_s)
        self._group["joined"] = True
        w.init_cache(self.num_pages, max_model_len)
        self._await("cache_ready", "joining the process group and allocating its KV cache")

    # ---- steps ---------------------------------------------------------------------------------------
    def execute(self, step: StepInput) -> SamplerOutput | None:
        with self._lock:
            if self.failure is not None or self._closed:
                raise RuntimeError(f"the tensor-parallel executor is down: {self.failure or 'shut down'}")
            try:
                # a speculative step keeps its sampling fields: every rank draws the same drafts from them
                self.channel.send(ch.STEP, obj=step if step.speculative is not None
                                  else dataclasses.replace(step, sampling=None))
                return self.worker.execute(step, timeout_s=self.timeout_s)
            except BaseException as e:
                self._fail(self._diagnose(e))
                raise RuntimeError(f"tensor-parallel step failed: {self.failure}") from e

    def _diagnose(self, e: BaseException) -> str:
        time.sleep(0.2)  # a worker that crashed: let its exit be seen
        gone = [f"rank {r} (pid {p.pid}) exited with code {p.returncode}"
                for r, p in enumerate(self.procs, start=1) if p.poll() is not None]
        return "; ".join(gone) + f" ({type(e).__name__}: {e})" if gone else f"{type(e).__name__}: {e}"

    def _fail(self, why: str) -> None:
        """The group is broken for good: record why and end the other workers now (their memory, a hung NCCL
        kernel); `shutdown` reaps them."""
        self.failure = self.failure or why
        for p in self.procs:
            if p.poll() is None:
                p.kill()

    def check_health(self) -> None:
        if self.failure is not None:
            raise RuntimeError(f"tensor-parallel executor failed: {self.failure}")
        for rank, p in enumerate(self.procs, start=1):
            if p.poll() is not None:
                self._fail(f"rank {rank} (pid {p.pid}) exited with code {p.returncode}")
                raise RuntimeError(f"tensor-parallel worker {self.failure}")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        # leave the group only once no step is in flight (one still running after the wait is left alone)
        if self._lock.acquire(timeout=self.timeout_s + 5.0):
            try:
                self._finalizer()
            finally:
                self._lock.release()
        else:
            self._group["joined"] = False
            self._finalizer()
        self._store = None
