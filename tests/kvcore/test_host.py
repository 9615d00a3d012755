"""The host's CPU as kvplan reads it: flags from torch's probe or /proc/cpuinfo, and the compute
dtype `auto` resolves to — bf16 only where the CPU has bf16 dot products and only on the CPU."""
import dataclasses

import pytest

from kvcore import host as hostmod
from kvcore.config import ConfigError, ModelConfig, from_env
from kvcore.host import Host, compute_dtype


def fake(monkeypatch, *flags: str) -> None:
    monkeypatch.setattr(hostmod, "host", lambda: Host(cpu="Test CPU", cores=2, flags=frozenset(flags)))


@pytest.mark.parametrize("flags, want", [
    ((), "float32"),
    (("avx2",), "float32"),
    (("avx2", "avx512f"), "float32"),                        # AVX-512 without BF16: bf16 is emulated
    (("avx2", "avx512f", "avx512_bf16"), "bfloat16"),
    (("avx2", "avx512f", "amx_tile", "amx_bf16"), "bfloat16"),
])
def test_auto_is_bf16_only_with_bf16_dot_products(monkeypatch, flags, want):
    fake(monkeypatch, *flags)
    assert compute_dtype("auto", "cpu") == want
    assert from_env(ModelConfig, {}).dtype == want                          # auto is the default
    assert compute_dtype("auto", "cuda") == "float32"                       # CUDA: as before
    assert from_env(ModelConfig, {"KVPLAN_DEVICE": "cuda:1"}).dtype == "float32"


@pytest.mark.parametrize("forced", ["float32", "bfloat16", "float16"])
def test_a_named_dtype_is_kept_whatever_the_host(monkeypatch, forced):
    for flags in ((), ("avx512f", "avx512_bf16")):
        fake(monkeypatch, *flags)
        assert from_env(ModelConfig, {"KVPLAN_COMPUTE_DTYPE": forced}).dtype == forced


def test_a_bad_compute_dtype_names_the_variable():
    with pytest.raises(ConfigError, match="KVPLAN_COMPUTE_DTYPE.*auto"):
        from_env(ModelConfig, {"KVPLAN_COMPUTE_DTYPE": "fp8"})


def test_this_hosts_flags_agree_with_proc_cpuinfo():
    h = hostmod.host()
    assert h.cpu and h.cores >= 1
    name, proc = hostmod._proc_cpuinfo()
    if proc:                                       # Linux: torch's probe and the kernel's flags agree
        for flag in ("avx2", "avx512f", "avx512_bf16", "amx_bf16"):
            assert (flag in h.flags) == (flag in proc), flag
    d = h.as_dict()
    assert d["native_bf16"] == h.native_bf16 and set(d["flags"]) == set(h.flags)
    line = h.describe()
    assert h.cpu in line and ("no amx" in line) == ("amx_bf16" not in h.flags)
    assert dataclasses.is_dataclass(h)
