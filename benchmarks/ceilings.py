"""The ceiling every benchmark's "% of copy" refers to, measured in the same run: device-to-device copy bandwidth."""
from __future__ import annotations

import time

import torch


def copy_bandwidth(device, nbytes: int = 2 << 30) -> float:
    """Bytes/s of a copy of `nbytes` (read + write counted): the median of triton's do_bench on a GPU, of 20 timed
    copies on the CPU (smoke runs)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    if a.is_cuda:
        import triton.testing
        ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=10, rep=100, return_mode="median")
        return 2 * nbytes / (ms * 1e-3)
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / sorted(times)[len(times) // 2]
