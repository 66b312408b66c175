"""What each platform installs, and a check that pip's resolver accepts each set (issue 25).

The three sets:

* ``cpu``: development and CI, ``requirements.txt`` + ``requirements-test.txt`` as they stand (torch 2.13.0's CPU
  wheel, triton 3.6.0 for the interpreter), for the running Python, from the sources pip is configured with (what
  ``build.sh setup`` uses). Outside this environment the CPU wheel comes from https://download.pytorch.org/whl/cpu
  (``PIP_EXTRA_INDEX_URL``); PyPI's Linux torch 2.13.0 is the CUDA build, which requires triton 3.7.1.
* ``cuda`` (``Dockerfile``): ``requirements.txt`` with its torch / triton lines replaced by the pair the kernels are
  tested with on the H200 (torch 2.11.0, whose Linux wheel requires exactly triton 3.6.0 and brings CUDA 13.0:
  host driver R580 or newer), plus the server wheel, for Python 3.12 on Linux x86_64, from PyPI.
* ``rocm`` (``Dockerfile.rocm``): the same with PyTorch's ROCm 7.2 build and its Triton (pytorch-triton-rocm 3.6.0)
  from PyTorch's ROCm index.

``IMAGES`` is the one place for the image pins; the Dockerfiles install ``python3 docker/pins.py requirements NAME``.

The check (``python3 docker/pins.py check``; tests/unit/test_pins.py runs it) resolves each set with
``pip install --dry-run --ignore-installed --report`` for the set's Python version and platform, wheels only; pip
reads only the wheels' metadata (PEP 658 files, or with ``--use-feature=fast-deps`` ranges of the wheel where the
index serves none), not the gigabytes of CUDA wheels. An index it cannot reach is a failure that names it. PyTorch's
ROCm index is often not reachable from CI: then the ROCm set is resolved without its torch pair and the pair is
checked against PyPI's torch of the same version (its triton requirement must be the pair's Triton version), and
the result says so.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPI = "https://pypi.org/simple"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # the CPU set's torch wheel outside this environment
# Linux x86_64 wheels a glibc 2.39 system (Ubuntu 24.04) installs: pip takes --platform values literally
LINUX_X86_64 = tuple(f"manylinux_2_{m}_x86_64" for m in range(39, 4, -1)) + (
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64")
TORCH_PAIR = ("torch", "triton")  # the names requirements.txt's CPU pair goes by


@dataclass(frozen=True)
class Image:
    name: str
    base: str  # the Dockerfile's base image (an exact tag)
    python: str  # the base image's Python (major.minor)
    pair: tuple[str, ...]  # torch and its Triton, in place of requirements.txt's
    index: str | None = None  # an extra index the pair comes from
    cuda: str | None = None  # the CUDA version of the torch wheels (the host driver must support it)


IMAGES = {
    "cuda": Image("cuda", base="nvidia/cuda:13.0.2-base-ubuntu24.04", python="3.12",
                  pair=("torch==2.11.0", "triton==3.6.0"), cuda="13.0"),
    "rocm": Image("rocm", base="rocm/dev-ubuntu-24.04:7.2-complete", python="3.12",
                  pair=("torch==2.11.0+rocm7.2", "pytorch-triton-rocm==3.6.0"),
                  index="https://download.pytorch.org/whl/rocm7.2"),
}
# Host driver series per CUDA major.minor of the torch wheels (NVIDIA's CUDA release notes, minimum driver)
DRIVER_FOR_CUDA = {"12.6": 560, "12.8": 570, "12.9": 575, "13.0": 580}


def req_name(line: str) -> str:
    """The normalized project name of a requirement line."""
    return re.sub(r"[-_.]+", "-", re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line).group(1)).lower()


def req_lines(path: Path) -> list[str]:
    """The requirement lines of a requirements file (no comments, blank lines or options)."""
    out = []
    for line in path.read_text().splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith(("#", "-")):
            out.append(line)
    return out


def pytriton_pin() -> str:
    """The server wheel, at the version build.sh installs (PYTRITON_VERSION)."""
    m = re.search(r"^PYTRITON_VERSION=(\S+)$", (ROOT / "build.sh").read_text(), re.M)
    return f"nvidia-pytriton=={m.group(1)}"


def image_requirements(image: Image) -> list[str]:
    """The lines an image installs: requirements.txt without its torch pair, the image's pair, the client library
    at requirements-test.txt's pin (clients/ runs in the image), with an ``--extra-index-url`` line first where the
    pair has its own index. The server wheel (`pytriton_pin`) is installed apart, without its dependencies (those
    of its Python API, which the server does not use), as build.sh setup does."""
    keep = [x for x in req_lines(ROOT / "requirements.txt") if req_name(x) not in TORCH_PAIR]
    client = [x for x in req_lines(ROOT / "requirements-test.txt") if req_name(x) == "tritonclient"]
    return ([f"--extra-index-url {image.index}"] if image.index else []) + keep + list(image.pair) + client


def cpu_requirements() -> list[str]:
    return req_lines(ROOT / "requirements.txt") + req_lines(ROOT / "requirements-test.txt")


@dataclass
class Result:
    name: str
    ok: bool
    detail: str  # what was resolved, or pip's error
    installs: dict[str, str] = field(default_factory=dict)  # normalized name -> version
    requires: dict[str, list[str]] = field(default_factory=dict)  # normalized name -> Requires-Dist


def reachable(url: str, timeout: float = 15.0) -> str | None:
    """None when ``url`` answers, else why not."""
    if url.startswith("file:"):
        return None
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/", timeout=timeout):
            return None
    except Exception as e:  # noqa: BLE001 - every failure to connect is reported as such
        return f"{type(e).__name__}: {e}"


def _old_pip() -> str | None:
    """pip before 25.3 downloads whole wheels in a dry run where the index serves no metadata files (PEP 658):
    gigabytes for the CUDA set. requirements-test.txt pins the pip this check runs with."""
    from importlib.metadata import version
    have = version("pip")
    if tuple(int(x) for x in re.findall(r"\d+", have)[:2]) < (25, 3):
        return f"pip {have} is too old for the pin check (needs 25.3: ./build.sh setup installs requirements-test.txt)"
    return None


def _pip_env(isolated: bool) -> dict[str, str]:
    env = dict(os.environ)
    if isolated:  # only the indexes given on the command line: no config files, no local wheel folders
        for k in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_INDEX_URL", "PIP_CONSTRAINT", "PIP_NO_INDEX"):
            env.pop(k, None)
        env["PIP_CONFIG_FILE"] = os.devnull
    return env


def resolve(name: str, lines: list[str], python: str | None = None, platforms: tuple[str, ...] = LINUX_X86_64,
            index: str | None = PYPI, timeout: float = 300.0) -> Result:
    """pip's resolver over ``lines`` in dry-run mode. ``python``: a target Python version (with ``platforms``),
    from ``index`` only (``--extra-index-url`` lines in ``lines`` add theirs); None: this interpreter and
    platform, from the sources pip is configured with (``index`` ignored)."""
    why = _old_pip()
    if why:
        return Result(name, False, why)
    if python is not None:
        for url in [index] + [x.split()[1] for x in lines if x.startswith("--extra-index-url")]:
            why = reachable(url)
            if why:
                return Result(name, False, f"cannot reach the package index {url} ({why}): the pin check needs it")
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp, "requirements.txt")
        req.write_text("\n".join(lines) + "\n")
        report = Path(tmp, "report.json")
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--disable-pip-version-check", "--only-binary=:all:", "--use-feature=fast-deps",
               "--report", str(report), "-r", str(req)]
        if python is not None:
            cmd += ["--python-version", python, "--index-url", index] + [f"--platform={p}" for p in platforms]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_pip_env(python is not None))
        except subprocess.TimeoutExpired:
            return Result(name, False, f"pip did not finish in {timeout:.0f} s")
        if p.returncode != 0:
            err = "\n".join(x for x in p.stderr.splitlines() if not x.startswith("WARNING: Retrying"))
            return Result(name, False, err.strip()[-3000:])
        items = json.loads(report.read_text())["install"]
    installs = {req_name(i["metadata"]["name"]): i["metadata"]["version"] for i in items}
    requires = {req_name(i["metadata"]["name"]): i["metadata"].get("requires_dist", []) for i in items}
    where = f"Python {python}, Linux x86_64" if python else f"Python {sys.version_info[0]}.{sys.version_info[1]}"
    summary = ", ".join(f"{k} {installs[k]}" for k in ("torch", "triton", "pytorch-triton-rocm", "numpy")
                        if k in installs)
    return Result(name, True, f"{len(installs)} packages ({where}): {summary}", installs, requires)


def _pin(line: str) -> str:
    return line.split("==", 1)[1]


def torch_triton_requirement(requires_dist: list[str]) -> str | None:
    """The exact Triton version a torch wheel's metadata requires (``triton==X``), if any."""
    for r in requires_dist:
        m = re.match(r"\s*(?:pytorch-)?triton(?:-rocm)?\s*==\s*([^;\s]+)", r)
        if m:
            return m.group(1)
    return None


def check_rocm_pair(image: Image, cuda_torch_requires: list[str] | None = None) -> Result:
    """Without PyTorch's ROCm index: PyPI's torch of the pair's version must require the pair's Triton version."""
    torch_line, triton_line = image.pair
    public = _pin(torch_line).split("+", 1)[0]
    if cuda_torch_requires is None:
        r = resolve(f"{image.name} pair", [f"torch=={public}"], image.python)
        if not r.ok:
            return r
        cuda_torch_requires = r.requires["torch"]
    want = torch_triton_requirement(cuda_torch_requires)
    have = _pin(triton_line)
    ok = want == have
    return Result(f"{image.name} pair", ok, f"torch {public} requires Triton {want}; the pair pins {have}"
                  + ("" if ok else ": change the pair"))


def check_image(image: Image, torch_requires=lambda version: None) -> list[Result]:
    """Resolve an image's set; where its pair's index cannot be reached, the rest and the pair's consistency
    (``torch_requires(version)``: Requires-Dist of PyPI's torch wheel of that version, if another set has it)."""
    lines = image_requirements(image)
    why = reachable(image.index) if image.index else None
    if not why:
        return [resolve(image.name, lines, image.python)]
    rest = [x for x in lines if not x.startswith("--") and x not in image.pair]
    r = resolve(image.name, rest, image.python)
    r.detail += f" [without the torch pair: {image.index} not reachable here ({why})]"
    return [r, check_rocm_pair(image, torch_requires(_pin(image.pair[0]).split("+", 1)[0]))]


def python_stub(python: str) -> Result:
    """The installed server wheel (build.sh's version) has a python-backend stub for ``python``."""
    from importlib import metadata
    want = pytriton_pin().split("==")[1]
    try:
        dist = metadata.distribution("nvidia-pytriton")
    except metadata.PackageNotFoundError:
        return Result(f"stub {python}", False, "nvidia-pytriton is not installed here (./build.sh setup)")
    if dist.version != want:
        return Result(f"stub {python}", False, f"nvidia-pytriton {dist.version} installed, build.sh pins {want}")
    stubs = sorted({f.parts[-2] for f in dist.files or () if f.name == "triton_python_backend_stub"})
    tags = re.findall(r"^Tag: \S+-\S+-(\S+)$", dist.read_text("WHEEL") or "", re.M)
    ok = python in stubs and any(t in LINUX_X86_64 for t in tags)
    return Result(f"stub {python}", ok, f"nvidia-pytriton {want} ({', '.join(tags)}) has python-backend stubs for "
                  f"{', '.join(stubs)}")


def check_all() -> list[Result]:
    """Every set, resolved at once (each resolution waits on the index, not the CPU)."""
    with ThreadPoolExecutor(4) as pool:
        cpu = pool.submit(resolve, "cpu", cpu_requirements())
        plain = {n: pool.submit(check_image, im) for n, im in IMAGES.items() if not im.index}

        def torch_requires(version):  # PyPI's torch metadata, from a set without its own pair index
            for f in plain.values():
                for r in f.result():
                    if r.ok and r.installs.get("torch") == version:
                        return r.requires["torch"]
            return None

        own = {n: pool.submit(check_image, im, torch_requires) for n, im in IMAGES.items() if im.index}
        done = {n: f.result() for n, f in {**plain, **own}.items()}
        results = [cpu.result()] + [r for n in IMAGES for r in done[n]]
    if not results[0].ok:  # PyPI's Linux torch is the CUDA build: its triton pin conflicts with the CPU set's
        results[0].detail += f"\n(where pip finds no CPU torch wheel: PIP_EXTRA_INDEX_URL={CPU_INDEX})"
    return results + [python_stub(v) for v in sorted({im.python for im in IMAGES.values()})]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rq = sub.add_parser("requirements", help="print an image's requirement lines (the Dockerfiles install them)")
    rq.add_argument("image", choices=sorted(IMAGES))
    rq.add_argument("--base", help="the image being built on (Dockerfile's BASE_IMAGE): fail unless it is the "
                    "image's base, or it with a digest, and this Python is the image's")
    sub.add_parser("server", help="print the server wheel's pin (installed with --no-deps)")
    sub.add_parser("check", help="resolve every set with pip (dry run); exit 1 on a conflict")
    args = ap.parse_args(argv)
    if args.cmd == "requirements":
        image = IMAGES[args.image]
        here = f"{sys.version_info[0]}.{sys.version_info[1]}"
        if args.base is not None and (here != image.python or not args.base.startswith(image.base)):
            print(f"pins.py: building on {args.base} (Python {here}); the {image.name} pins were resolved for "
                  f"{image.base} (Python {image.python}): docker/pins.py IMAGES", file=sys.stderr)
            return 1
        print("\n".join(image_requirements(image)))
        return 0
    if args.cmd == "server":
        print(pytriton_pin())
        return 0
    results = check_all()
    for r in results:
        print(f"{'ok  ' if r.ok else 'FAIL'} {r.name}: {r.detail}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
