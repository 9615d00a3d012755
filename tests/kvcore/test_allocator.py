"""The heap policy: glibc takes it (mallopt accepts both settings), once per process, and a
freed block the size of a layer's widened K/V comes back from the heap instead of the OS."""
import ctypes
import ctypes.util
import platform

import pytest

from kvcore import allocator


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_glibc_takes_the_policy_and_reuses_a_freed_block():
    assert allocator.hold_freed_memory() is True
    assert allocator.hold_freed_memory() is True            # idempotent
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    size = 3 << 20                        # 3 MiB: above glibc's default 128 KiB mmap threshold
    first = libc.malloc(size)
    libc.free(first)
    second = libc.malloc(size)
    libc.free(second)
    assert first == second                # the same heap block again, not a fresh mapping
