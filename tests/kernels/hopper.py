"""Compile a Triton kernel for an H100 (sm_90) on a machine without a GPU: Triton's own ptxas turns
it into machine code, so the constraints the interpreter does not enforce — power-of-two aranges,
tl.dot's tile sizes and operand dtypes, the loops' carried types — are checked here before a lent
GPU runs it. Skips (saying so) where Triton has no CUDA backend."""
from __future__ import annotations

import pytest


def compile_for_hopper(fn, signature: dict, constexprs: dict, **options):
    """fn a @triton.jit kernel; signature {arg: "*bf16" | "i32" | "fp32" | ...} for its runtime
    arguments, constexprs {arg: value} -> the compiled kernel (its .asm holds "ptx" and "cubin")."""
    triton = pytest.importorskip("triton")
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    if "nvidia" not in backends:
        pytest.skip("this Triton has no CUDA backend to compile for sm_90 with")
    if type(fn).__name__ == "InterpretedFunction":
        pytest.skip("kernels were decorated under TRITON_INTERPRET=1 in this process")
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    return triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", 90, 32), options=options)
