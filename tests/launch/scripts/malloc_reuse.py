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
BLOCK_BYTES = 8 * 2**20
before = libc.mallinfo2()
block = libc.malloc(BLOCK_BYTES)
held = libc.mallinfo2()
libc.free(block)
after = libc.mallinfo2()
# Kept: the block came from the heap (not a fresh mmap) and the free did not trim the heap.
# Counted from the heap's size, not its free bytes: free space already at the heap's top is
# reused for the block and would make a free-bytes difference fall short of the block.
mmapped = held.hblkhd - before.hblkhd >= BLOCK_BYTES
trimmed = max(held.arena - after.arena, 0)
print(f"KEPT_BYTES={0 if mmapped else max(BLOCK_BYTES - trimmed, 0)}", flush=True)
kerasdist.shutdown()
