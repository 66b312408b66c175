"""Start-up check of the m3serve images (docker/entrypoint.sh runs it before the server): can the host's GPU driver
run this image's torch? A driver too old for the wheels' CUDA otherwise shows up minutes later as a CUDA error deep
in a model load, or as torch silently falling back to the CPU.

* CUDA build of torch: the driver's CUDA version (``cuDriverGetVersion`` of ``libcuda.so.1``, which the NVIDIA
  container toolkit mounts with ``--gpus``) must be at least the wheels' (CUDA 13.0: driver R580 or newer). No
  driver in the container (started without ``--gpus``): a note, and the engine runs on the CPU (the tiny model).
* ROCm build: ``/dev/kfd`` and ``/dev/dri`` passed in and openable by this user (``--group-add`` the host's video
  and render groups), else a note (absent) or a failure (present but not openable).

Exit 1 with one message on a failure; ``M3SERVE_DEVICE_CHECK=0`` skips the check. Reads torch's build from
``torch/version.py`` without importing torch (a second, not ten).
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pins import DRIVER_FOR_CUDA  # noqa: E402  (the same table the image is described with)


def torch_build() -> tuple[str | None, str | None]:
    """(CUDA version, HIP version) torch was built for, from torch/version.py (None, None: a CPU build)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None, None
    text = Path(spec.submodule_search_locations[0], "version.py").read_text()

    def field(name: str) -> str | None:
        m = re.search(rf"^{name}\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
        return m.group(1) if m else None

    return field("cuda"), field("hip")


def cuda_driver_version() -> int | None:
    """The CUDA version the driver supports (1000 x major + 10 x minor), None without a driver."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    v = ctypes.c_int(0)
    return v.value if lib.cuDriverGetVersion(ctypes.byref(v)) == 0 else None


def check_cuda(torch_cuda: str, driver: int | None) -> tuple[bool, str]:
    major, minor = (int(x) for x in torch_cuda.split(".")[:2])
    series = DRIVER_FOR_CUDA.get(f"{major}.{minor}")
    need = f"an NVIDIA host driver of the R{series} series or newer" if series else "a newer NVIDIA host driver"
    if driver is None:
        return True, ("m3serve: no NVIDIA driver in the container (start it with --gpus / a GPU reservation): "
                      f"the engine runs on the CPU. This image's torch uses CUDA {torch_cuda}: {need}.")
    if driver < 1000 * major + 10 * minor:
        return False, (f"m3serve: this image's torch is built for CUDA {torch_cuda}, which needs {need}; the host "
                       f"driver supports CUDA {driver // 1000}.{driver % 1000 // 10}. Update the host driver, or "
                       "build the image with a torch whose CUDA the driver supports (docker/pins.py IMAGES).")
    return True, f"m3serve: CUDA driver {driver // 1000}.{driver % 1000 // 10} runs torch's CUDA {torch_cuda}"


def check_rocm(hip: str, dev: str = "/dev") -> tuple[bool, str]:
    kfd, dri = Path(dev, "kfd"), Path(dev, "dri")
    if not kfd.exists():
        return True, (f"m3serve: no {kfd} in the container: the engine runs on the CPU (for the GPUs: --device="
                      f"{kfd} --device={dri} --group-add video --group-add render)")
    if not os.access(kfd, os.R_OK | os.W_OK):
        return False, (f"m3serve: {kfd} is present but user {os.getuid()} cannot open it: add the host's video and "
                       "render groups (--group-add video --group-add render, or their numeric GIDs from the host's "
                       "/etc/group when the names differ in the image)")
    return True, f"m3serve: ROCm devices present (torch built for HIP {hip})"


def main() -> int:
    if os.environ.get("M3SERVE_DEVICE_CHECK", "1") == "0":
        return 0
    cuda, hip = torch_build()
    if hip:
        ok, msg = check_rocm(hip)
    elif cuda:
        ok, msg = check_cuda(cuda, cuda_driver_version())
    else:
        return 0
    print(msg, file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
