"""tests/run_suite.py (what `./build.sh test` runs): on a GPU host the interpreter tree and the rest run in two
pytest processes, so the compiled-kernel tests run instead of skipping; without a GPU, one process as before."""
import os
import subprocess
import sys

import pytest

from run_suite import INTERPRETED, ROOT, plan

Q = ["-q", "-p", "no:cacheprovider"]


@pytest.fixture(autouse=True)
def _unsharded(monkeypatch):
    monkeypatch.delenv("M3SERVE_SUITE_SHARDS", raising=False)  # the H200's suite step sets it


def test_no_gpu_is_one_process():
    assert plan(Q + ["tests/unit"], gpu=False) == [("tests", Q + ["tests/unit"], True)]


def test_gpu_host_splits_the_tree():
    (_, kernels, interp_k), (_, rest, interp_r) = plan(Q, gpu=True)
    assert interp_k and kernels == Q + [INTERPRETED]
    assert not interp_r and rest == Q + ["tests", f"--ignore={INTERPRETED}"]
    assert [len(plan(Q + [p], gpu=True)) for p in ("tests", ".", "tests/")] == [2, 2, 2]
    only = plan(Q + ["tests/kernels/test_moe.py::test_empty_step", "-k", "empty"], gpu=True)
    assert only == [(f"{INTERPRETED} (TRITON_INTERPRET=1)", Q + ["-k", "empty", "tests/kernels/test_moe.py::test_empty_step"],
                     True)]
    (_, gpu_args, interp), = plan(["tests/gpu/test_kernels_gpu.py"], gpu=True)
    assert not interp and gpu_args[0] == "tests/gpu/test_kernels_gpu.py"
    (_, rest, interp), = plan(Q + ["--ignore=tests/kernels"], gpu=True)  # the interpreter tree left out
    assert not interp and rest == Q + ["--ignore=tests/kernels", "tests", f"--ignore={INTERPRETED}"]


def _test_files(tree: str) -> list[str]:
    return sorted(os.path.join(tree, f) for f in os.listdir(os.path.join(ROOT, tree))
                  if f.startswith("test_") and f.endswith(".py"))


def _file_shards_of(tree: str, runs) -> list[list[str]]:
    """The shards of `tree` in a plan's runs (each a list of its files)."""
    return [a[len(Q):-1] for _, a, interp in runs if not interp and a[len(Q)].startswith(tree + os.sep)]


def test_interpreter_tree_in_shards(monkeypatch):
    """M3SERVE_SUITE_SHARDS=4: the interpreter tree in 4 processes, tests/gpu and tests/unit in 2 each, every other
    folder whole; every test file runs exactly once."""
    monkeypatch.setenv("M3SERVE_SUITE_SHARDS", "4")
    runs = plan(Q, gpu=True)
    folders = sorted(d for d in os.listdir(os.path.join(ROOT, "tests")) if d not in ("kernels", "support")
                     and os.path.isdir(os.path.join(ROOT, "tests", d)) and d != "__pycache__")
    assert [r[2] for r in runs] == [True] * 4 + [False] * (len(folders) + 2)
    paths = [args[len(Q):-1] for _, args, _ in runs[4:]]  # each ends with --ignore=tests/kernels
    assert all(args[-1] == f"--ignore={INTERPRETED}" for _, args, _ in runs[4:])
    for d in folders:
        tree = os.path.join("tests", d)
        mine = [p for p in paths if p[0].startswith(tree + os.sep) or p == [tree]]
        if tree in ("tests/gpu", "tests/unit"):
            assert len(mine) == 2 and sorted(f for p in mine for f in p) == _test_files(tree)
        else:
            assert mine == [[tree]]
    files = sorted(f for _, args, _ in runs[:4] for f in args[len(Q):])
    assert files == _test_files(INTERPRETED)  # every file once
    assert plan(Q, gpu=False) == [("tests", Q, True)]  # no GPU: one process whatever the setting
    named = plan(Q + ["tests/gpu", "tests/gateway", "tests/unit/test_formats.py"], gpu=True)  # folders named: split
    assert [a[len(Q):-1] for _, a, _ in named] == [*_file_shards_of("tests/gpu", runs), ["tests/gateway"],
                                                    ["tests/unit/test_formats.py"]]
    without = plan(Q + ["--ignore=tests/gateway"], gpu=True)  # an ignored folder gets no process (pytest would
    assert len(without) == len(runs) - 1                      # collect nothing there and exit 5)
    assert not [a for _, a, _ in without if "tests/gateway" in a]


def test_failing_process_fails_the_run_and_its_summary_line_ends_the_output(tmp_path):
    """On a (fake) GPU host, with a plugin that fails every test under tests/kernels: the interpreter process fails,
    the other passes; the run exits non-zero and its output ends with both pytest summary lines."""
    (tmp_path / "sitecustomize.py").write_text("import torch\ntorch.cuda.is_available = lambda: True\n")
    (tmp_path / "fail_kernels.py").write_text(
        "def pytest_runtest_call(item):\n    assert not item.nodeid.startswith('tests/kernels'), 'made to fail'\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
               M3SERVE_SUITE_LOG_DIR=str(tmp_path / "logs"))
    r = subprocess.run([sys.executable, "tests/run_suite.py", *Q, "-p", "fail_kernels",
                        "tests/kernels/test_dispatch.py::test_gates_here",
                        "tests/unit/test_run_suite.py::test_no_gpu_is_one_process"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 1, r.stdout[-3000:]
    assert lines[-4].endswith("exit 1") and lines[-3].startswith("1 failed"), lines[-6:]
    assert lines[-2].endswith("exit 0") and lines[-1].startswith("1 passed"), lines[-6:]
    assert "made to fail" in (tmp_path / "logs" / "pytest-0.log").read_text() and "made to fail" in r.stdout


def test_a_stopped_run_prints_where_each_process_stood(tmp_path):
    """A timeout's SIGTERM to the run (GNU timeout signals the whole process group) while one process is still in a
    test: that process is interrupted as by Ctrl-C, so its log names the test it was in (tests/conftest.py) and ends
    with its pytest summary, and the run prints it; the process that had finished is reported as before. The run
    starts with SIGINT ignored, as a shell's background job without job control has it (CI's `nohup .ci/run &`)."""
    import signal
    import time

    (tmp_path / "sitecustomize.py").write_text("import torch\ntorch.cuda.is_available = lambda: True\n")
    started = tmp_path / "started"
    (tmp_path / "slow_unit.py").write_text(
        "import pathlib, time\n"
        "def pytest_runtest_call(item):\n"
        "    if item.nodeid.startswith('tests/unit'):\n"
        f"        pathlib.Path({str(started)!r}).write_text('x')\n"
        "        time.sleep(60)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
               M3SERVE_SUITE_LOG_DIR=str(tmp_path / "logs"))
    slow = "tests/unit/test_run_suite.py::test_no_gpu_is_one_process"
    proc = subprocess.Popen([sys.executable, "tests/run_suite.py", *Q, "-p", "slow_unit",
                             "tests/kernels/test_dispatch.py::test_gates_here", slow],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True,  # SIGINT ignored, as `nohup .ci/run &` leaves it (CI)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.monotonic() + 240
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert started.exists(), "the slow test never started"
        time.sleep(1)
        os.killpg(proc.pid, signal.SIGTERM)  # as `timeout` does: the whole group
        t0 = time.monotonic()
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143 and time.monotonic() - t0 < 30, out[-3000:]
    blocks = {b.split(" (", 1)[0]: b for b in out.split("[run_suite] ---- ")[1:]}  # each process's log, by label
    assert set(blocks) == {"tests/kernels", slow}, out[-3000:]
    assert blocks["tests/kernels"].rstrip().splitlines()[-1].startswith("1 passed"), out[-3000:]  # ended, or ending
    mine = blocks[slow]
    assert "still running when the suite was stopped" in mine.splitlines()[0], mine
    assert "KeyboardInterrupt" in mine and f"interrupted in {slow}" in mine, mine[-2000:]
    assert mine.rstrip().splitlines()[-1].startswith("no tests ran"), mine[-2000:]  # its pytest summary
