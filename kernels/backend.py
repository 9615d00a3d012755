"""The one place that decides which kernel runs, and the one switch that turns them all off.

    backend(device)    "triton" on CUDA where Triton is installed; "cpp" on the CPU where the C++
                       extension (`kernels.cpu_extension`) is built; "torch" (the plain-torch
                       reference) otherwise — and everywhere while ENABLED is False
    use_triton(*ts)    the dispatched ops' rule (`kernels.dispatch`): Triton where every tensor is
                       on CUDA, or on any device when the kernels were decorated under Triton's
                       interpreter (TRITON_INTERPRET=1 set before `kernels` was imported: the tests)

Every launcher asks one of the two, then whether its kernel takes these inputs (dtypes, strides,
shapes: its own check, next to the kernel), else runs its reference. The engine's kernels
(`paged_decode`, `paged_prefill`, `decoder_ops`, `kv_write`, `quant_attention`) follow `backend`:
on the CPU they take the C++ kernels even under the interpreter, whose tests call the Triton
launchers themselves."""
from __future__ import annotations

from typing import Literal

import torch

from kernels import cpu_extension
from kernels._triton import HAS_TRITON, INTERPRETED

ENABLED = True       # False: the references everywhere (benches compare kernels and references in one process)

Backend = Literal["triton", "cpp", "torch"]


def backend(device: torch.device | str) -> Backend:
    """Which kernels serve tensors on `device` (the C++ extension is built on first ask)."""
    if not ENABLED:
        return "torch"
    kind = torch.device(device).type
    if kind == "cuda":
        return "triton" if HAS_TRITON else "torch"
    return "cpp" if kind == "cpu" and cpu_extension.module() is not None else "torch"


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether a dispatched op runs its Triton kernel on these tensors."""
    if not ENABLED or not HAS_TRITON or not tensors:
        return False
    return INTERPRETED or all(t.is_cuda for t in tensors)
