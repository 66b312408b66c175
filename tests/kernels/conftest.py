"""Kernel tests run the Triton kernels on CPU through the interpreter (set before triton is imported)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_configure(config):
    # the interpreter turns 1-element arrays into loop bounds (numpy deprecation noise, not ours)
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning:triton.runtime.interpreter")
