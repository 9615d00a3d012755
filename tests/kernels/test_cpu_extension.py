"""The CPU kernels' C++ builds wherever a compiler is, for every kind of x86 host: a compile error
must fail here, not pass as "no C++ compiler" (the kernel tests skip without the module, and the
engine silently takes the torch references). Before: cpu_prefill.cpp named an AVX-512-only type
outside its #if, so on an AVX2-only host the extension did not build and every kernel test skipped."""
from __future__ import annotations

import platform
import shutil
import subprocess
import sysconfig

import pytest

from kernels import cpu_extension
from kvcore.host import host

compiler = shutil.which("c++")
needs_compiler = pytest.mark.skipif(compiler is None, reason="no C++ compiler here")


@needs_compiler
def test_the_kernels_build_on_this_host():
    assert cpu_extension.build(), "a C++ compiler is here but the extension did not build (see the warning logged)"


def other_target() -> str:
    """The -march of the kind of host this one is not (the build above compiles this host's own
    branches): AVX2 only (x86-64-v3: the scalar and 8-lane paths) where this host has AVX512-BF16,
    else AVX-512 with AVX512-BF16 and AMX (sapphirerapids: the VDPBF16PS and tile paths; AMX is
    chosen at run time, so it covers AVX512-BF16 hosts without AMX too)."""
    return "x86-64-v3" if host().native_bf16 else "sapphirerapids"


@needs_compiler
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 targets")
def test_every_source_compiles_for_the_other_kind_of_x86_host():
    """Each source, syntax-checked as the host build compiles it but for the other kind of host: an
    #if branch this host never takes still has to compile (~40 s a source: torch's headers)."""
    march = other_target()
    from torch.utils.cpp_extension import include_paths
    includes = [f"-I{p}" for p in include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    procs = [(src.name, subprocess.Popen([compiler, "-fsyntax-only", "-std=c++20", f"-march={march}", "-fopenmp",
                                          "-DTORCH_EXTENSION_NAME=kvplan_cpu_decode", "-DTORCH_API_INCLUDE_EXTENSION_H",
                                          *includes, str(src)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
             for src in cpu_extension.SOURCES]
    failed = {name: p.communicate()[0] for name, p in procs if p.wait() != 0}
    assert not failed, "\n".join(f"{name} for -march={march}:\n{out[-3000:]}" for name, out in failed.items())
