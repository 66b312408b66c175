"""What a failure inside the engine means: one request's, one step's, or the device's.

  * a request fails on its own (preparing, adding, turning its sampled token into text): that request gets
    a `FailedOutput` (finish_reason "error") and the others go on;
  * a shared step fails (the forward or the sampler raised): the step's requests get a `FailedOutput`, their
    pages are freed, and the engine carries on, its scheduler consistent;
  * the device faults (a CUDA/HIP error: a sticky context error, an illegal address, an ECC error): nothing on
    that device can be trusted any more, the engine is dead (`is_device_fault`).

A host or device out-of-memory is not a device fault: the allocator refused, the context is intact. An
AssertionError is not contained in a step either: it leaves `LLMEngine.step`, and `AsyncLLMEngine` carries on
only if the page pool is whole once every request in flight is aborted.
"""
from __future__ import annotations

from dataclasses import dataclass

from m3serve.engine.outputs import RequestOutput

# substrings of the messages torch, the CUDA/HIP runtimes and NCCL raise for a faulted device
_DEVICE_FAULT_MARKERS = (
    "CUDA error", "CUDA driver error", "CUBLAS_STATUS_EXECUTION_FAILED", "CUBLAS_STATUS_INTERNAL_ERROR",
    "cuDNN error", "HIP error", "hipError", "illegal memory access", "illegal instruction",
    "device-side assert", "unspecified launch failure", "uncorrectable ECC error", "NCCL error",
)


def is_device_fault(exc: BaseException) -> bool:
    """True for an error of the device itself (the exception or any it was raised from)."""
    import torch

    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
            return False
        accel = getattr(torch, "AcceleratorError", None)
        if accel is not None and isinstance(e, accel):
            return True
        if isinstance(e, RuntimeError) and any(m in str(e) for m in _DEVICE_FAULT_MARKERS):
            return True
        e = e.__cause__ or e.__context__
    return False


def contained(exc: BaseException) -> bool:
    """True when a failure can stay with the requests it hit: neither a device fault nor a broken invariant
    (an AssertionError: a debugging check such as the shadow backend's, or a bug whose damage is unknown)."""
    return not isinstance(exc, AssertionError) and not is_device_fault(exc)


class RequestFailed(RuntimeError):
    """One request could not be served because of an internal error (not the client's input)."""


@dataclass
class FailedOutput(RequestOutput):
    """The final output of a request that failed inside the engine (finish_reason "error")."""

    error: str = ""


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
