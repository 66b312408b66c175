"""The main of a tensor-parallel worker process (ranks 1..N-1; rank 0 is the engine process).

Started by `MultiprocExecutor` as `python -c "<bootstrap>" m3serve-tp-worker rank=R parent=PID` with its arguments
in $M3SERVE_TP_WORKER (JSON, `sys.path` included: the parent may be Triton's Python backend stub, whose path is
not a plain interpreter's). It never outlives the engine process: PR_SET_PDEATHSIG (SIGKILL) plus a watchdog
thread on the parent pid. It clears the signal mask it inherited (the stub blocks some), exits cleanly on SIGTERM
and leaves SIGINT to the engine (a Ctrl-C in a terminal reaches the whole process group).

Protocol with rank 0 (`shm_channel`): load this rank's shard (while rank 0 loads its own) -> ready(num_pages) ->
INIT(the pool's pages: the minimum over ranks): join the process group, allocate the KV cache -> cache_ready ->
STEP ... -> SHUTDOWN. Any failure is reported as an `error` status (the traceback) and ends the process with exit
code 1.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
import traceback

ENV = "M3SERVE_TP_WORKER"
ARGV_TAG = "m3serve-tp-worker"
BOOTSTRAP = ("import json, os, sys; a = json.loads(os.environ.pop('M3SERVE_TP_WORKER')); sys.path[:] = a['sys_path']; "
             "from m3serve.executor.worker_process import main; main(a)")
PR_SET_PDEATHSIG = 1
POLL_S = 0.5

log = logging.getLogger("m3serve.tp_worker")


def bind_to_parent(parent_pid: int) -> None:
    """Die with the parent: the kernel's PR_SET_PDEATHSIG, and a thread that watches the parent pid (the signal
    alone misses a parent that died before the prctl, and is Linux-only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch():
        while True:
            time.sleep(POLL_S)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="m3serve-parent-watchdog", daemon=True).start()


def reset_signals() -> None:
    signal.pthread_sigmask(signal.SIG_SETMASK, set())

    def terminate(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def main(args: dict) -> None:
    bind_to_parent(args["parent_pid"])
    reset_signals()
    rank = args["rank"]
    logging.basicConfig(level=os.environ.get("M3SERVE_LOG_LEVEL", "WARNING"),
                        format=f"[tp rank {rank}] %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    from m3serve.distributed.shm_channel import Receiver
    channel = Receiver(args["shm_fd"], args["sock_fd"])
    try:
        code = _serve(args, channel)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, then the process ends
        message = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        sys.stderr.write(f"[tp rank {rank}] failed: {message}\n")
        try:
            channel.status("error", message=message)
        except OSError:
            pass
        code = 1
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: a broken process group must not hang the exit


def _serve(args: dict, channel) -> int:
    import torch

    from m3serve.config import EngineConfig, ModelConfig
    from m3serve.distributed import parallel as par
    from m3serve.distributed import shm_channel as ch
    from m3serve.executor.worker import Worker

    rank, size = args["rank"], args["world_size"]
    parent = args["parent_pid"]

    def alive() -> bool:
        return os.getppid() == parent

    torch.set_num_threads(args["num_threads"])
    device = torch.device(args["device"])
    parallel = par.Parallel(rank, size, args["expert_parallel"])  # the group joins after loading
    config = EngineConfig(**args["engine_config"])
    worker = Worker(config, ModelConfig(**args["model_config"]), parallel=parallel, device=device)
    channel.status("ready", num_pages=worker.determine_num_pages(args["max_model_len"]))
    cmd, num_pages, _ = channel.wait(POLL_S, alive)
    if cmd != ch.INIT:
        return 0
    par.join_group(parallel, par.connect_store(args["store_port"], size, args["timeout_s"]), device,
                   args["timeout_s"])
    worker.init_cache(num_pages, args["max_model_len"])
    channel.status("cache_ready")
    while True:
        cmd, _, step = channel.wait(POLL_S, alive)
        if cmd != ch.STEP:
            break
        worker.execute(step)
    par.destroy_group()
    return 0
