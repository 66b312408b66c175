"""Kernels compiled for a GPU target on a CPU-only machine: the interpreter (on in tests/kernels) patches the
language functions, so the compiling runs in a child process without TRITON_INTERPRET."""
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def run_uninterpreted(test_file: str, call: str) -> None:
    """Run ``call`` (a Python expression over ``t``, the module of ``test_file``) in a child process without
    TRITON_INTERPRET, tests/ on its path."""
    path = Path(test_file)
    code = f"import sys; sys.path.insert(0, {str(path.parent)!r}); import {path.stem} as t; {call}"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600, env=env)


def cuobjdump(flag: str, cubin: Path) -> str:
    """triton's bundled cuobjdump on a cubin (``--dump-sass``, ``--dump-resource-usage``)."""
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return subprocess.run([str(tool), flag, str(cubin)], capture_output=True, text=True, check=True).stdout


def compile_sm90(kernel, signature: dict, constexprs: dict, aligned=(), gluon: bool = False, **options):
    """``kernel`` (a Triton or, ``gluon``, a Gluon kernel) compiled for sm_90 as the runtime would launch it:
    ``signature`` types every runtime argument, ``constexprs`` binds the rest, the ``aligned`` arguments are
    specialized as multiples of 16 (the runtime does so for 16-byte aligned pointers and such strides / sizes);
    ``options``: num_warps, num_stages. Triton's compiled kernel (``.asm["cubin"]``, ``["ptx"]``). Call it where
    TRITON_INTERPRET is off (`run_uninterpreted`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as Source
    else:
        from triton.compiler import ASTSource as Source
    names = list(kernel.arg_names)
    full = dict(signature, **{k: "constexpr" for k in constexprs})
    src = Source(kernel, signature={n: full[n] for n in names},
                 constexprs={(names.index(k),): v for k, v in constexprs.items()},
                 attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
