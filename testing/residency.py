"""Which pages of this process's memory are resident: mincore(2) over an address range, through ctypes.

    resident_bytes(tensor.data_ptr(), tensor.nbytes)   # bytes of the range's pages backed by RAM now

Used by the KV pool's tests (its storage after warm-up) and bench/bench_memory.py (the pool's share of
the stage's RSS). Linux only (mincore of anonymous memory reports the pages the process has touched and
the kernel has not reclaimed)."""
from __future__ import annotations

import ctypes
import mmap

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
PAGE = mmap.PAGESIZE


def resident_bytes(address: int, nbytes: int) -> int:
    """Bytes of the whole pages overlapping [address, address + nbytes) that are resident."""
    if nbytes <= 0:
        return 0
    start = address - address % PAGE
    pages = -(-(address + nbytes - start) // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * PAGE), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(v & 1 for v in vec) * PAGE


def tensor_resident_bytes(t) -> int:
    """Resident bytes of a CPU tensor's storage."""
    s = t.untyped_storage()
    return resident_bytes(s.data_ptr(), s.nbytes())
