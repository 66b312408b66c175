"""Compile a Gluon kernel of kernels/nvfp4_mma.py for sm_90 without a GPU (used in a child process without
TRITON_INTERPRET, since the interpreter patches the language functions)."""
from pathlib import Path

from m3serve.kernels import nvfp4_mma


def compile_for_sm90(kernel: str, signature: dict, constexprs: dict, cubin: str) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = getattr(nvfp4_mma, kernel)
    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    names = list(sig)
    attrs = {(i,): [["tt.divisibility", 16]] for i, v in enumerate(sig.values()) if v.startswith("*")}
    src = GluonASTSource(fn, signature=sig, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                         attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": nvfp4_mma.NUM_WARPS})
    Path(cubin).write_bytes(compiled.asm["cubin"])
