"""Kernel tests run the Triton kernels on CPU through the interpreter (set before triton is imported). The
interpreter is per process: on a GPU host tests/run_suite.py (`./build.sh test`) runs this tree in a process of its
own, so that the rest (tests/gpu) runs the compiled kernels."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_configure(config):
    # the interpreter turns 1-element arrays into loop bounds (numpy deprecation noise, not ours)
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning:triton.runtime.interpreter")
