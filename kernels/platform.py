"""Platform facts and gates, asked once: is the Triton interpreter on, which device and capability, ROCm or CUDA,
is Gluon present, how many SMs. Every kernel file asks here (through the module: ``platform.num_sms(...)``, so
that a test can stand in for the device), never keeps its own copy.

Gates (what may run where):

* ``nvfp4_mma_ok``: the Gluon ``mma.sync`` NVFP4 kernels (`nvfp4_mma`): compiled CUDA (not ROCm, not the
  interpreter), compute capability 8.9 or 9.x (e4m3 converts, mma.sync; measured on the H200), Gluon present, and
  not switched off with ``M3SERVE_NVFP4_MMA=0``.
* ``markov_kernel_ok``: the fused greedy Markov kernels (`markov`, portable Triton): a GPU, CUDA or ROCm (not the
  interpreter), not switched off with ``M3SERVE_MARKOV_KERNEL=0``.
* ``nvfp4_asm_allowed``: the inline-PTX NVFP4 decoder inside the portable kernels: compiled CUDA, sm_89+, not
  switched off with ``M3SERVE_NVFP4_ASM=0`` (`codecs.nvfp4_asm_ok` adds its one-time exactness self-check).
"""
from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    """``TRITON_INTERPRET`` is set: kernels run on the CPU through the interpreter (read at every call)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def rocm() -> bool:
    return bool(getattr(torch.version, "hip", None))


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def compiled_cuda(device: torch.device) -> bool:
    """Kernels on this device are compiled for an NVIDIA GPU (PTX): CUDA, not ROCm, not the interpreter."""
    return device.type == "cuda" and not interpreting() and not rocm()


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def capability(device: torch.device) -> tuple[int, int]:
    """Compute capability of a CUDA device (cached per device)."""
    return _capability(device_index(device))


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 elsewhere (the interpreter: a few programs per split)."""
    if device.type == "cuda":
        return _cuda_sms(device_index(device))
    return 4


@functools.lru_cache(maxsize=None)
def gluon_present() -> bool:
    """This Triton has Gluon with the Ampere mma (older builds and some ROCm builds have not)."""
    try:
        from triton.experimental import gluon  # noqa: F401
        from triton.experimental.gluon.language.nvidia.ampere import mma_v2  # noqa: F401
    except ImportError:
        return False
    return True


def _switched_on(name: str) -> bool:
    return os.environ.get(name, "1") != "0"


def nvfp4_mma_ok(device: torch.device) -> bool:
    """May the Gluon mma.sync NVFP4 kernels run on this device? (See the module docstring.)"""
    if not compiled_cuda(device) or not _switched_on("M3SERVE_NVFP4_MMA") or not gluon_present():
        return False
    cap = capability(device)
    return cap == (8, 9) or cap[0] == 9


def moe_mma_ok(device: torch.device) -> bool:
    """May the Gluon mma.sync grouped-GEMM kernels (`grouped_gemm_mma`: the MoE layer, quantized linears) run here?
    As `nvfp4_mma_ok`, switched off with ``M3SERVE_MOE_MMA=0``."""
    if not compiled_cuda(device) or not _switched_on("M3SERVE_MOE_MMA") or not gluon_present():
        return False
    cap = capability(device)
    return cap == (8, 9) or cap[0] == 9


def markov_kernel_ok(device: torch.device) -> bool:
    """May the fused greedy Markov kernels run here? (See the module docstring.)"""
    return device.type == "cuda" and not interpreting() and _switched_on("M3SERVE_MARKOV_KERNEL")


def nvfp4_asm_allowed(device: torch.device) -> bool:
    """May the portable kernels use the inline-PTX NVFP4 decoder here (before its self-check)?"""
    return compiled_cuda(device) and _switched_on("M3SERVE_NVFP4_ASM") and capability(device) >= (8, 9)
