"""The pins of every platform resolve (docker/pins.py): pip's resolver in dry-run mode over the CPU / CI set, the
CUDA image's and the ROCm image's, for each one's Python and platform, against the package index (needs PyPI: an
index that cannot be reached fails, it is not skipped, unless $M3SERVE_TEST_OPTIONAL names `index`). A conflicting
pair fails the same check."""
import importlib.util
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from support.required import missing

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("m3serve_pins", ROOT / "docker" / "pins.py")
pins = sys.modules["m3serve_pins"] = importlib.util.module_from_spec(_spec)  # (dataclasses look it up there)
_spec.loader.exec_module(pins)


@pytest.fixture(scope="module")
def resolved():
    """Every set and the conflicting pair, resolved concurrently (about a minute: pip reads wheel metadata only)."""
    with ThreadPoolExecutor(2) as pool:
        everything = pool.submit(pins.check_all)
        conflict = pool.submit(pins.resolve, "conflict", ["torch==2.13.0", "triton==3.6.0"], "3.12")
        results, pair = {r.name: r for r in everything.result()}, conflict.result()
    unreachable = [r.detail for r in (*results.values(), pair) if r.detail.startswith("cannot reach the package index")]
    if unreachable:  # a failure, unless $M3SERVE_TEST_OPTIONAL names `index` (a GPU host without network)
        missing(unreachable[0], "index", "the pin check resolves against the package index")
    return results, pair


@pytest.mark.timeout(240)
def test_every_platform_set_resolves(resolved):
    results, _ = resolved
    failed = [f"{r.name}: {r.detail}" for r in results.values() if not r.ok]
    assert not failed, "\n".join(failed)
    assert {"cpu", "cuda", "rocm", "stub 3.12"} <= set(results)
    cuda = results["cuda"].installs
    assert (cuda["torch"], cuda["triton"]) == ("2.11.0", "3.6.0")  # the pair the kernels run with on the H200
    assert cuda["nvidia-cuda-runtime"].startswith("13.0.")  # CUDA 13.0 wheels: the driver the image states
    assert pins.DRIVER_FOR_CUDA[pins.IMAGES["cuda"].cuda] == 580
    assert results["cpu"].installs["triton"] == "3.6.0" and "+cpu" in results["cpu"].installs["torch"]
    assert "numpy" in results["rocm"].installs and "rocm pair" in results  # the pair: see test_rocm_pair_...


@pytest.mark.timeout(240)
def test_a_conflicting_pair_fails_the_check(resolved):
    """torch 2.13.0's Linux wheel requires triton 3.7.1: pinned with 3.6.0 (the old requirements.txt on the CUDA
    image) the resolver refuses, and the check reports it."""
    _, conflict = resolved
    assert not conflict.ok
    assert "conflict" in conflict.detail.lower() and "triton" in conflict.detail, conflict.detail


def test_an_unreachable_index_fails_clearly():
    r = pins.resolve("cuda", ["numpy==1.26.4"], "3.12", index="http://127.0.0.1:9/simple")
    assert not r.ok and r.detail.startswith("cannot reach the package index http://127.0.0.1:9/simple"), r.detail


def test_an_old_pip_fails_clearly(monkeypatch):
    """pip < 25.3 would download every CUDA wheel whole from an index without metadata files."""
    import importlib.metadata
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "23.2.1")
    r = pins.resolve("cuda", ["numpy==1.26.4"], "3.12")
    assert not r.ok and "pip 23.2.1 is too old" in r.detail


def test_image_requirements_replace_the_cpu_pair():
    base = [x for x in pins.req_lines(ROOT / "requirements.txt") if pins.req_name(x) not in ("torch", "triton")]
    cuda = pins.image_requirements(pins.IMAGES["cuda"])
    assert cuda == base + ["torch==2.11.0", "triton==3.6.0", "tritonclient[grpc]==2.73.0"]
    rocm = pins.image_requirements(pins.IMAGES["rocm"])
    assert rocm[0] == "--extra-index-url https://download.pytorch.org/whl/rocm7.2"
    assert rocm[1:] == base + ["torch==2.11.0+rocm7.2", "pytorch-triton-rocm==3.6.0", "tritonclient[grpc]==2.73.0"]
    assert pins.pytriton_pin() == "nvidia-pytriton==0.7.0"  # build.sh's PYTRITON_VERSION
    py312 = pins.sys.version_info[:2] == (3, 12)
    assert pins.main(["requirements", "cuda", "--base", pins.IMAGES["cuda"].base + "@sha256:0"]) == (0 if py312 else 1)
    assert pins.main(["requirements", "rocm", "--base", pins.IMAGES["cuda"].base]) == 1  # the wrong base


def test_rocm_pair_is_checked_against_the_torch_of_its_version():
    requires = ['triton==3.6.0; platform_system == "Linux"', "filelock"]  # PyPI's torch 2.11.0 wheel
    image = pins.IMAGES["rocm"]
    assert pins.check_rocm_pair(image, requires).ok
    stale = pins.Image("rocm", image.base, "3.12", ("torch==2.11.0+rocm7.2", "pytorch-triton-rocm==3.5.0"))
    r = pins.check_rocm_pair(stale, requires)
    assert not r.ok and "requires Triton 3.6.0; the pair pins 3.5.0" in r.detail


def test_the_server_wheel_has_no_stub_for_other_pythons():
    assert pins.python_stub("3.12").ok
    r = pins.python_stub("3.7")
    assert not r.ok and "3.12" in r.detail
