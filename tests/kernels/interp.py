"""Run a test module's `_child` under TRITON_INTERPRET=1 in a fresh process.

Triton chooses interpreter vs compiler when `@triton.jit` runs, i.e. when a kernel module is first
imported, and other tests import `kernels` earlier in this process without the interpreter. So a
test module runs itself as `python -m tests.kernels.<module> OUT` with the variable set; its child
saves inputs and outputs with torch.save, and the assertions happen in the parent.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(module: str, out_dir: Path) -> dict:
    pytest.importorskip("triton")
    out = out_dir / "results.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", module, str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


def interpreted_fixture(module: str):
    """A module-scoped `interpreted` fixture: `module`'s child run once under the interpreter."""
    @pytest.fixture(scope="module")
    def interpreted(tmp_path_factory) -> dict:
        return run_interpreted(module, tmp_path_factory.mktemp(module.rsplit(".", 1)[-1]))
    return interpreted


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|, in fp32."""
    if ref.numel() == 0:
        return 0.0
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12)).item()
