"""Tensor / expert parallelism: the process group and collectives (`parallel.py`), and how each step reaches the
worker processes (`step_codec.py`: a step as one buffer; `shm_channel.py`: shared memory + doorbells)."""
from m3serve.distributed.parallel import Parallel

__all__ = ["Parallel"]
