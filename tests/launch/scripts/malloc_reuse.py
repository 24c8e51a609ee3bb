"""Frees an 8 MiB block after kerasdist.init() and prints how much of it malloc kept.

Usage: malloc_reuse.py  (one process, no launcher: malloc's thresholds start at glibc's
defaults). Prints KEPT_BYTES=<bytes>.
"""

import ctypes

import kerasdist


class Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


kerasdist.init()
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
before = libc.mallinfo2().fordblks
block = libc.malloc(8 * 2**20)
libc.free(block)
# Free bytes that stay in the heap: none if the block was mmapped or the heap was trimmed.
print(f"KEPT_BYTES={libc.mallinfo2().fordblks - before}", flush=True)
kerasdist.shutdown()
