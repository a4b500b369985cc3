"""glibc's malloc for an engine on the CPU: big tensors reused from the heap instead of mapped afresh.

A CPU prefill allocates and frees tensors of tens of MiB in every layer (projections, MLP activations, attention
outputs, a sparse policy's gathered keys). glibc serves an allocation above its mmap threshold (128 KiB, raised on
the fly to at most 32 MiB as such blocks are freed) with a fresh mapping, and the kernel zeroes a fresh mapping page
by page as it is first touched: one fault per 4 KiB, every time. It also gives freed heap memory back to the kernel
above its trim threshold, so even heap memory comes back fresh. `tune()` raises the mmap threshold to 256 MiB and the
trim threshold to 1 GiB for the process (`mallopt`), so a freed tensor's memory serves the next one as it is.

Measured (default model, 7,000-token prefill, 2-core CPU, `tools/prefill_split.py`, the variables
MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ set the same way, two runs each): dense 13.28-13.39 s -> 12.70-12.88,
XAttention 9.44-9.73 -> 8.70-8.84, their non-attention part 5.7-5.8 -> 5.0-5.1 s; with the engine on a thread of
its own (a thread's arena keeps heaps of at most 64 MiB) 3-4% instead of 4-8%. The trim threshold alone made it far
slower (every large block mapped). The price: memory freed stays with the process, up to the largest working set
it has had (not a growth: the next prefill reuses it). CUDA engines are left alone (their big tensors are on the GPU).
A no-op off glibc (macOS, musl, Windows).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

MMAP_THRESHOLD = 256 << 20
TRIM_THRESHOLD = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3        # glibc's malloc.h
_done: bool | None = None


def tune() -> bool:
    """Set the two thresholds for this process once; whether glibc took them."""
    global _done
    if _done is None:
        _done = False
        if sys.platform.startswith("linux"):
            try:
                mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
            except (OSError, AttributeError):          # no libc by that name, or no mallopt in it (musl)
                return False
            mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
            _done = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return _done
