"""Engine factory for the fault tests ($M3SERVE_ENGINE_FACTORY=<this file>:make): the real engine, whose
step loop raises once the file named by $M3SERVE_FAULT_FILE exists (the engine then reports unhealthy)."""
from __future__ import annotations

import os


def make(config):
    from m3serve.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(config)
    flag = os.environ["M3SERVE_FAULT_FILE"]
    step = engine.engine.step

    def faulty_step():
        if os.path.exists(flag):
            raise RuntimeError("injected engine fault")
        return step()

    engine.engine.step = faulty_step
    return engine
