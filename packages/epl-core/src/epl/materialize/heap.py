"""Giving the memory of freed init-unit values back to the operating system, as they are freed.

Each init unit's values are allocated whole, sliced, and freed, between tensors a rank keeps. glibc's
``malloc`` keeps such freed chunks in its heap, resident, unless they sit at its top: building a 252M-parameter
Llama on meta under ``epl.split(2)`` peaked at 984 MiB per rank over the process's start for a 485 MiB share
(benchmarks/test_giant_models.py). ``malloc_trim(0)`` returns the free pages inside the heap; called after
every 256 MiB freed, the peak fell to about 800 MiB for 0.3 s more. Where the C library is not glibc, nothing
is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

#: Bytes freed between two trims.
TRIM_EVERY = 256 * 2**20


@functools.cache
def _malloc_trim() -> Callable[[int], object] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


class FreedMemory:
    """Counts the bytes of values freed, and gives the heap's free pages back each :data:`TRIM_EVERY` bytes."""

    def __init__(self, every: int = TRIM_EVERY) -> None:
        self.every = every
        self.pending = 0

    def freed(self, nbytes: int) -> None:
        """``nbytes`` of values were just freed."""
        self.pending += nbytes
        if self.pending >= self.every:
            self.trim()

    def trim(self) -> None:
        """Give the free pages back now."""
        self.pending = 0
        trim = _malloc_trim()
        if trim is not None:
            trim(0)
