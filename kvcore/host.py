"""The host's CPU as kvplan's speed depends on it: its model name and the instruction sets that
decide the compute dtype (AVX512-BF16 or AMX: bf16 matmuls at twice fp32's rate; without them
bf16 is emulated and ~3x slower than fp32) and that every benchmark table names beside its figures.

`compute_dtype("auto", device)` is where `KVPLAN_COMPUTE_DTYPE=auto` (the default) turns into a
dtype: bfloat16 on a CPU with native bf16 dot products, float32 elsewhere (and on CUDA, as before).
The flags come from torch's own CPU probe (`torch.cpu.get_capabilities`, cpuinfo), with
/proc/cpuinfo as the fallback where this torch has none."""
from __future__ import annotations

import functools
import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")   # the ones tables name


@dataclass(frozen=True)
class Host:
    cpu: str                     # the CPU's model name ("AMD EPYC 9R14", "Intel(R) Xeon(R) ...")
    cores: int                   # logical cores torch sees
    flags: frozenset             # of FLAGS, those the CPU has

    @property
    def native_bf16(self) -> bool:
        """bf16 dot products in hardware (AVX512-BF16's vdpbf16ps or AMX tiles): what makes
        oneDNN's bf16 linears and torch's bf16 flash attention faster than fp32."""
        return "avx512_bf16" in self.flags or "amx_bf16" in self.flags

    def describe(self) -> str:
        """One line for a table's caption: 'AMD EPYC, 2 cores, avx512f avx512_bf16 (no amx)'."""
        shown = [f for f in FLAGS if f in self.flags and f != "amx_tile"]
        amx = "" if "amx_bf16" in self.flags else " (no amx)"
        return f"{self.cpu}, {self.cores} cores, {' '.join(shown) or 'no avx2'}{amx}"

    def as_dict(self) -> dict:
        return dict(cpu=self.cpu, cores=self.cores, flags=sorted(self.flags), native_bf16=self.native_bf16)


def _proc_cpuinfo() -> tuple[str, set[str]]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), set()
    name = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    return (name.group(1).strip() if name else platform.machine()), set(flags.group(1).split() if flags else ())


@functools.lru_cache(maxsize=1)
def host() -> Host:
    """This machine's CPU (probed once)."""
    import torch
    name, proc = _proc_cpuinfo()
    caps = {}
    try:
        caps = torch.cpu.get_capabilities()
    except (AttributeError, RuntimeError):
        pass
    alias = {"avx512f": "avx512_f"}                       # cpuinfo's spelling of /proc/cpuinfo's flag
    flags = {f for f in FLAGS if caps.get(alias.get(f, f)) or f in proc}
    return Host(cpu=name, cores=int(caps.get("num_logical_cores") or os.cpu_count() or 1), flags=frozenset(flags))


def compute_dtype(setting: str, device: str = "cpu") -> str:
    """KVPLAN_COMPUTE_DTYPE as a torch dtype name: `auto` is bfloat16 on a CPU with native bf16
    (`Host.native_bf16`), float32 on any other CPU and on CUDA; a named dtype is kept."""
    if setting != "auto":
        return setting
    return "bfloat16" if device == "cpu" and host().native_bf16 else "float32"
