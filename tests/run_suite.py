"""The whole test suite, as `./build.sh test` (and CI, .ci/run) runs it: `python tests/run_suite.py [pytest args]`.

`TRITON_INTERPRET` is read when a kernel module is imported, so one process runs the Triton kernels either in the
interpreter or compiled, never both. Without a GPU that is one pytest process (tests/conftest.py turns the
interpreter on). With a GPU it is two: tests/kernels (the kernels in the interpreter on CPU tensors, as without a
GPU) and everything else without the interpreter, so tests/gpu runs the compiled kernels instead of skipping.
The output ends with each process's pytest summary line; the exit status is the first failing process's.
Path arguments pick what runs (a path under tests/kernels goes to the interpreter process); other arguments go
to every process.
"""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INTERPRETED = "tests/kernels"


def _rel(path: str) -> str:
    return os.path.relpath(os.path.join(ROOT, path.split("::")[0]), ROOT)


def _is_path(arg: str) -> bool:
    return not arg.startswith("-") and os.path.exists(os.path.join(ROOT, _rel(arg)))


def _inside(path: str, tree: str) -> bool:
    path, tree = _rel(path), _rel(tree)
    return tree == "." or path == tree or path.startswith(tree + os.sep)


def plan(args: list[str], gpu: bool) -> list[tuple[str, list[str], bool]]:
    """(label, pytest args, interpreter on) per process."""
    if not gpu:
        return [("tests", args, True)]
    paths = [a for a in args if _is_path(a)] or ["tests"]
    opts = [a for a in args if not _is_path(a)]
    kernels = [p for p in paths if _inside(p, INTERPRETED)]
    if any(_inside(INTERPRETED, p) and not _inside(p, INTERPRETED) for p in paths):  # a folder above the tree
        kernels.append(INTERPRETED)
    rest = [p for p in paths if not _inside(p, INTERPRETED)]
    runs = []
    if kernels:
        runs.append((f"{INTERPRETED} (TRITON_INTERPRET=1)", opts + kernels, True))
    if rest:
        runs.append((f"{' '.join(rest)} but {INTERPRETED} (compiled kernels)",
                     opts + rest + [f"--ignore={INTERPRETED}"], False))
    return runs


def run(label: str, args: list[str], interpret: bool) -> tuple[int, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    print(f"[run_suite] {label}: pytest {' '.join(args)}", flush=True)
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace")
    last = ""
    for line in proc.stdout:
        sys.stdout.write(line)
        if line.strip():
            last = line.rstrip("\n")
    return proc.wait(), last


def main(args: list[str]) -> int:
    import torch

    runs = plan(args, torch.cuda.is_available())
    results = [(label, *run(label, a, interp)) for label, a, interp in runs]
    if len(results) > 1:
        print(f"[run_suite] {len(results)} pytest processes:", flush=True)
        for label, rc, last in results:
            print(f"[run_suite] {label}: exit {rc}")
            print(last, flush=True)
    return next((rc for _, rc, _ in results if rc != 0), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
