"""One place decides which kernel runs (`kernels.backend`): its answer per device, its one switch
reaching every launcher, and no kernel module keeping a switch or a device rule of its own."""
import ast
from pathlib import Path

import pytest
import torch

import kernels
from kernels import backend as B
from kernels import cpu_extension, decoder_ops, kv_write, paged_prefill, quant, quant_attention
from kernels._triton import HAS_TRITON, INTERPRETED

KERNELS = Path(kernels.__file__).parent


class _Refused:
    """A C++ extension whose every kernel fails: a launcher that reaches it did not take the reference."""

    def __getattr__(self, name):
        raise AssertionError(f"the C++ kernel {name} ran")


def test_backend_per_device():
    assert B.backend("cpu") == ("cpp" if cpu_extension.module() is not None else "torch")
    assert B.backend(torch.device("cuda")) == ("triton" if HAS_TRITON else "torch")
    assert B.backend("meta") == "torch"
    x = torch.zeros(2, 2)
    assert B.use_triton(x) is INTERPRETED and B.use_triton() is False
    assert kernels.use_triton is B.use_triton                 # the package's name is the one rule


def test_no_extension_is_the_torch_backend(monkeypatch):
    monkeypatch.setattr(cpu_extension, "module", lambda: None)
    assert B.backend("cpu") == "torch" and not paged_prefill.fast(torch.device("cpu"))


def test_the_one_switch_sends_every_launcher_to_its_reference(monkeypatch):
    monkeypatch.setattr(B, "ENABLED", False)
    monkeypatch.setattr(cpu_extension, "module", lambda: _Refused())
    assert B.backend("cpu") == B.backend("cuda") == "torch" and B.use_triton(torch.zeros(1)) is False
    assert not paged_prefill.fast(torch.device("cpu")) and not paged_prefill.fast(torch.device("cuda"))
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 8, generator=g), torch.randn(8, generator=g)
    torch.testing.assert_close(decoder_ops.rms_norm(x, w, 1e-6), decoder_ops.rms_norm_reference(x, w, 1e-6))
    gate, up = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)
    torch.testing.assert_close(decoder_ops.silu_mul(gate, up), torch.nn.functional.silu(gate) * up)
    rows, at = torch.zeros(8, 4, dtype=torch.float16), torch.tensor([0, 2])
    k, v = torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g)
    kv_write.write_kv(rows, at, k, v, 4)
    torch.testing.assert_close(rows[[0, 2, 4, 6]].float(), torch.cat([k, v]), atol=1e-3, rtol=1e-3)
    assert not quant.quantize_pack_cpu_handles(x)
    q, kk = torch.randn(1, 2, 64, generator=g), torch.randn(1, 64, 64, generator=g)
    got = quant_attention.quant_attention(q, kk, kk, [8], 2, 0.125)
    torch.testing.assert_close(got, quant_attention.quant_attention_reference(q, kk, kk, [8], 2, 0.125))


@pytest.mark.parametrize("path", sorted(p for p in KERNELS.glob("*.py") if p.name != "backend.py"),
                         ids=lambda p: p.name)
def test_no_kernel_module_keeps_a_switch_of_its_own(path):
    """Before issue 41 paged_decode, paged_prefill, decoder_ops, kv_write and quant_attention each
    had an `ENABLED` of their own, and dispatch its own `use_triton`."""
    tree = ast.parse(path.read_text())
    own = [n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "ENABLED"]
    own += [n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "INTERPRETED"
            and isinstance(n.ctx, ast.Load)]                                   # deciding by the interpreter
    own += [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name in ("backend", "use_triton")]
    assert own == []
