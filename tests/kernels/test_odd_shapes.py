"""The quantized linears and the fused MoE layer at odd shapes (N, K not multiples of 64 or 128) in the interpreter:
against the torch reference, and with every weight in front of a guard page, so that a kernel reading past a
weight's rows (the N tail of a tile: what faulted on the H200 with the 64-wide shared expert) kills a child process
instead of reading a neighbour's bytes. The GPU twin: tests/gpu/test_odd_shapes_gpu.py."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from support.odd_shapes import FORMATS, check_linear, check_moe

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(11)


@pytest.mark.parametrize("fmt", FORMATS[:3])
@pytest.mark.parametrize("n,k", [(40, 96), (200, 160)])
def test_quant_linear_odd_shapes(fmt, n, k, gen):
    check_linear(fmt, n, k, (1, 17), "cpu", gen, tol=1e-5)


@pytest.mark.parametrize("expert_fmt,shared_fmt", [("nvfp4", "nvfp4"), ("mxfp8", "nvfp4"), ("nvfp4", "mxfp8"),
                                                   ("fp8", "dense"), ("dense", "fp8")])
def test_moe_odd_shapes(expert_fmt, shared_fmt, gen):
    check_moe(expert_fmt, shared_fmt, 96, 96, 160, (1, 5), "cpu", gen, tol=1e-5)


_GUARDED = """
import torch
from support.odd_shapes import check_linear, check_moe
g = torch.Generator().manual_seed(3)
check_linear("nvfp4", 40, 96, (3,), "cpu", g, guard=True, tol=1e-5)
check_linear("mxfp8", 200, 160, (3,), "cpu", g, guard=True, tol=1e-5)
check_moe("nvfp4", "nvfp4", 80, 96, 160, (3,), "cpu", g, guard=True, tol=1e-5)
check_moe("mxfp8", "mxfp8", 96, 96, 64, (3,), "cpu", g, guard=True, tol=1e-5)
print("guarded ok")
"""


def test_no_kernel_reads_past_a_weight():
    """Run in a child: a read past a guarded weight is a SIGSEGV there (with the unclamped N tail it is one)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]),
               TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _GUARDED], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "guarded ok" in r.stdout, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])
