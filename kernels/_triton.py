"""Whether Triton is here, and whether its kernels run in the interpreter — decided once.

Every kernel module imports `triton`/`tl` from here, and `kernels.backend` reads the same two
flags, so they cannot disagree. Triton is optional: without it `HAS_TRITON` is False, `triton`
and `tl` are None, kernel modules skip their `@triton.jit` definitions, and only the torch
references are usable.

Triton picks interpreter or compiler when `@triton.jit` runs, i.e. when a kernel module is
imported; TRITON_INTERPRET=1 must be set before that (tests start a child process for it).
"""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # optional dependency; the references cover CPU
    triton = None
    tl = None

HAS_TRITON = triton is not None
INTERPRETED = HAS_TRITON and bool(triton.knobs.runtime.interpret)


def pow2_at_least(n: int, lo: int = 1, hi: int = 1 << 30) -> int:
    """Smallest power of two >= n, clamped to [lo, hi] (lo, hi powers of two): block sizes."""
    block = lo
    while block < n and block < hi:
        block *= 2
    return block


def require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use the kernels.dispatch functions (torch reference on CPU)")
