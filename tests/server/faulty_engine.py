"""Engine factory for the fault tests ($M3SERVE_TEST_ENGINE_FACTORY="m3=<this file>:make" in the
server's environment): the real engine,
whose model runner raises while the file named by $M3SERVE_FAULT_FILE holds a fault kind:
  "step"    a RuntimeError in one step (the file is consumed): that step's requests fail, the engine goes on
  "device"  a CUDA error (torch.AcceleratorError) in every step: a device fault, the engine dies."""
from __future__ import annotations

import os


def _kind(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def make(config):
    import torch

    from m3serve.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(config)
    flag = os.environ["M3SERVE_FAULT_FILE"]
    executor = engine.engine.executor
    launch = executor.launch

    def faulty_step(step, *prev):
        kind = _kind(flag) if os.path.exists(flag) else None
        if kind == "step":
            os.unlink(flag)
            raise RuntimeError("injected step fault")
        if kind == "device":
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered (injected)")
        return launch(step, *prev)

    executor.launch = faulty_step
    return engine
