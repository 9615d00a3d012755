"""The C heap's policy for freed memory, set once per process before a model runs.

On CPU every attention call converts a layer's fp16 K/V to the compute dtype in a fresh tensor
(a few MB at 2k tokens), and freed once attention ends. glibc's default returns such freed
memory to the OS (trims the heap top, or unmaps chunks above its mmap threshold), so the next
call faults in fresh zeroed pages, several times the step's arithmetic (docs/benchmarks.md,
"Figures behind the code"). Holding it costs nothing the process did not already reach:
resident memory stays at the step's high-water mark."""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("kvplan.allocator")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3            # mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20        # blocks up to 32 MiB come from the heap (glibc's own dynamic ceiling)
TRIM_THRESHOLD = (1 << 31) - 1   # never trim a free heap top below 2 GiB

_done = False


def hold_freed_memory() -> bool:
    """Keep freed blocks up to MMAP_THRESHOLD in the heap for reuse. -> whether it took effect
    (False where the C library is not glibc: nothing to tune, nothing changed)."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        log.info("no glibc mallopt here: the C heap keeps its default policy")
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not _done:
        log.warning("mallopt refused the heap policy: freed memory goes back to the OS (slower decode on CPU)")
    return _done


def give_back() -> bool:
    """Return the C heap's free memory to the OS now (glibc's malloc_trim), whatever the policy
    above: after a refused request of many MB, which a process holding freed memory would keep
    for good. -> whether anything was returned (False without glibc)."""
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):
        return False
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    return bool(trim(0))
