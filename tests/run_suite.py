"""The whole test suite, as `./build.sh test` (and CI, .ci/run) runs it: `python tests/run_suite.py [pytest args]`.

`TRITON_INTERPRET` is read when a kernel module is imported, so one process runs the Triton kernels either in the
interpreter or compiled, never both. Without a GPU that is one pytest process (tests/conftest.py turns the
interpreter on). With a GPU it is two: tests/kernels (the kernels in the interpreter on CPU tensors, as without a
GPU) and everything else without the interpreter, so tests/gpu runs the compiled kernels instead of skipping.
The two run side by side, each into a log (under $M3SERVE_SUITE_LOG_DIR if set) printed whole when it ends; the
output ends with each process's pytest summary line; the exit status is the first failing process's.
`--ignore=tests/kernels` leaves the interpreter process out. $M3SERVE_SUITE_SHARDS=N (many-core GPU hosts) splits
the interpreter tree over N processes by file, tests/gpu and tests/unit (whole, or named) over N // 2 each, and runs
each other test folder in a process of its own.
Path arguments pick what runs (a path under tests/kernels goes to the interpreter process); other arguments go
to every process.
"""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INTERPRETED = "tests/kernels"
# the longest folders on a GPU host (the GPU test files took over 730 s in the device calls that ran them, more than
# one call's 600 s; docs/performance.md): sharded runs split them by file too
SPLIT = ("tests/gpu", "tests/unit")


def _rel(path: str) -> str:
    return os.path.relpath(os.path.join(ROOT, path.split("::")[0]), ROOT)


def _is_path(arg: str) -> bool:
    return not arg.startswith("-") and os.path.exists(os.path.join(ROOT, _rel(arg)))


def _inside(path: str, tree: str) -> bool:
    path, tree = _rel(path), _rel(tree)
    return tree == "." or path == tree or path.startswith(tree + os.sep)


def _ignored(tree: str, opts: list[str]) -> bool:
    """An `--ignore=` among the pytest options covers `tree`."""
    return any(o.startswith("--ignore=") and _inside(tree, o.split("=", 1)[1]) for o in opts)


def _shards(kernels: list[str], n: int) -> list[list[str]]:
    """The interpreter tree in `n` processes: the interpreter runs one core per process, so a many-core GPU host runs
    it `n` times faster. Only the whole tree is split."""
    if n <= 1 or kernels != [INTERPRETED]:
        return [kernels] if kernels else []
    return _file_shards(INTERPRETED, n)


def _file_shards(tree: str, n: int) -> list[list[str]]:
    """The test files of `tree` in up to `n` groups (by size, each to the lightest group)."""
    files = sorted(glob.glob(os.path.join(ROOT, tree, "test_*.py")), key=os.path.getsize, reverse=True)
    shares = [[0, []] for _ in range(max(1, min(n, len(files))))]
    for f in files:
        share = min(shares, key=lambda s: s[0])
        share[0] += os.path.getsize(f)
        share[1].append(os.path.relpath(f, ROOT))
    return [sorted(files) for _, files in shares]


def _sharded(rest: list[str], opts: list[str], n: int) -> list[list[str]]:
    """Sharded (n > 1): a process per test folder named (`tests`: each of its folders but the interpreter tree and
    the --ignore'd ones), the longest folders (SPLIT) over n // 2 processes each; test files and node ids named
    alone run together in one more."""
    folders, alone = [], []
    for p in rest:
        if _rel(p) == "tests":
            for d in sorted(glob.glob(os.path.join(ROOT, "tests", "*", ""))):
                tree = os.path.relpath(d, ROOT)
                if glob.glob(os.path.join(d, "test_*.py")) and not _inside(d, INTERPRETED) and not _ignored(tree, opts):
                    folders.append(tree)
        elif "::" not in p and os.path.isdir(os.path.join(ROOT, _rel(p))):
            folders.append(_rel(p))
        else:
            alone.append(p)
    parts = [part for tree in folders for part in (_file_shards(tree, n // 2) if tree in SPLIT else [[tree]])]
    return parts + ([alone] if alone else [])


def plan(args: list[str], gpu: bool) -> list[tuple[str, list[str], bool]]:
    """(label, pytest args, interpreter on) per process."""
    if not gpu:
        return [("tests", args, True)]
    paths = [a for a in args if _is_path(a)] or ["tests"]
    opts = [a for a in args if not _is_path(a)]
    kernels = [p for p in paths if _inside(p, INTERPRETED)]
    if any(_inside(INTERPRETED, p) and not _inside(p, INTERPRETED) for p in paths):  # a folder above the tree
        kernels.append(INTERPRETED)
    if _ignored(INTERPRETED, opts):
        kernels = []  # the caller left the interpreter tree out
    rest = [p for p in paths if not _inside(p, INTERPRETED)]
    runs = []
    n = int(os.environ.get("M3SERVE_SUITE_SHARDS", "1"))
    shards = _shards(kernels, n)
    for i, part in enumerate(shards):
        tag = f" [{i + 1}/{len(shards)}]" if len(shards) > 1 else ""
        runs.append((f"{INTERPRETED}{tag} (TRITON_INTERPRET=1)", opts + part, True))
    rest_parts = _sharded(rest, opts, n) if rest and n > 1 else [rest] if rest else []
    for part in rest_parts:
        around = any(_inside(INTERPRETED, p) for p in part)
        runs.append((f"{' '.join(part)}{' without ' + INTERPRETED if around else ''} (compiled kernels)",
                     opts + part + [f"--ignore={INTERPRETED}"], False))
    return runs


def _env(interpret: bool) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def run_one(args: list[str], interpret: bool) -> tuple[int, str]:
    """One pytest process, its output streamed: (exit status, last line)."""
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *args], cwd=ROOT, env=_env(interpret),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    last = ""
    for line in proc.stdout:
        sys.stdout.write(line)
        if line.strip():
            last = line.rstrip("\n")
    return proc.wait(), last


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_together(runs, log_dir: str) -> list[tuple[int, str]]:
    """The processes side by side (the interpreter tree is CPU-bound, the other mostly on the GPU), each writing
    `<log_dir>/pytest-<i>.log`; each log is printed whole when its process ends."""
    procs = []
    for i, (label, args, interpret) in enumerate(runs):
        path = os.path.join(log_dir, f"pytest-{i}.log")
        print(f"[run_suite] {label}: pytest {' '.join(args)} (log: {path})", flush=True)
        with open(path, "w") as log:
            # a session of its own: a timeout's signal to the group reaches only this process, which stops each
            # pytest so that it reports (_stop_the_rest); SIGINT as Python's own default, also where the runner was
            # started in the background without job control (`nohup ... &`), which ignores it
            procs.append((path, subprocess.Popen([sys.executable, "-m", "pytest", *args], cwd=ROOT,
                                                 env=_env(interpret), stdout=log, stderr=subprocess.STDOUT,
                                                 start_new_session=True, preexec_fn=_default_sigint)))
    results: dict[int, tuple[int, str]] = {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM: stop the processes too
    try:
        _collect(runs, procs, results)
    finally:
        _stop_the_rest(runs, procs, results)
    return [results[i] for i in range(len(procs))]


def _report(runs, procs, results, i: int, how: str) -> None:
    """Process i's whole log under a header saying how it ended; its last line becomes its summary."""
    path, proc = procs[i]
    with open(path, errors="replace") as f:
        text = f.read()
    sys.stdout.write(f"[run_suite] ---- {runs[i][0]}: {how} ----\n{text}")
    sys.stdout.flush()
    results[i] = (proc.returncode, _last_line(text))


def _collect(runs, procs, results) -> None:
    while len(results) < len(procs):
        for i, (_, proc) in enumerate(procs):
            if i not in results and proc.poll() is not None:
                _report(runs, procs, results, i, f"exit {proc.returncode}")
        time.sleep(0.5)


def _stop_the_rest(runs, procs, results) -> None:
    """Stopped early (a timeout's SIGTERM, Ctrl-C): interrupt the pytest processes still running, as Ctrl-C would (each
    then names the test it was in and prints its summary), and print each one's log, so a run cut short still says
    what passed and where it stood."""
    running = [i for i, (_, proc) in enumerate(procs) if i not in results and proc.poll() is None]
    for i in running:
        procs[i][1].send_signal(signal.SIGINT)
    deadline = time.monotonic() + 15  # (a device call's limit leaves a stopped suite little time)
    for i, (_, proc) in enumerate(procs):
        if i in results:
            continue
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        how = "still running when the suite was stopped; its log" if i in running else f"exit {proc.returncode}"
        _report(runs, procs, results, i, how)


def main(args: list[str]) -> int:
    import torch

    runs = plan(args, torch.cuda.is_available())
    if len(runs) == 1:
        label, a, interpret = runs[0]
        return run_one(a, interpret)[0]
    log_dir = os.environ.get("M3SERVE_SUITE_LOG_DIR") or tempfile.mkdtemp(prefix="m3serve-suite-")
    os.makedirs(log_dir, exist_ok=True)
    results = run_together(runs, log_dir)
    print(f"[run_suite] {len(results)} pytest processes:", flush=True)
    for (label, _, _), (rc, last) in zip(runs, results):
        print(f"[run_suite] {label}: exit {rc}")
        print(last, flush=True)
    return next((rc for rc, _ in results if rc != 0), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
