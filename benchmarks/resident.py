"""A process's resident memory and its peak, from Linux's /proc (``VmRSS``, ``VmHWM``), for memory benchmarks.

The peak is reset by writing 5 to ``/proc/self/clear_refs`` (Linux 4.0+), so that a
benchmark measures the peak of one phase (building and parallelizing a model) over
what the process held when the phase began.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

#: glibc's malloc gives a freed block of at least this many bytes back to the system at once. By default the
#: threshold adapts upwards to the largest block freed (up to 32 MiB), after which blocks below it come from the heap
#: and stay resident when freed: a ZeRO step on a 31M Llama then held 702 MB resident with 126 MB of live tensors, and
#: 163 MB with this setting (tests/planner/test_measured_memory.py). A fixed threshold makes resident memory follow
#: what the process allocates, which is what the planner predicts.
GLIBC_RETURNS_FREED_BLOCKS = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


@contextlib.contextmanager
def allocation_tracking_children() -> Iterator[None]:
    """Processes started inside the block (``run_ranks``) use :data:`GLIBC_RETURNS_FREED_BLOCKS`: glibc reads it when
    a process starts, so it is set in this process's environment, which they inherit, and restored after."""
    before = {key: os.environ.get(key) for key in GLIBC_RETURNS_FREED_BLOCKS}
    os.environ.update(GLIBC_RETURNS_FREED_BLOCKS)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}: these memory figures need Linux")


def resident() -> int:
    """Bytes this process holds in memory now (``VmRSS``)."""
    return _status_bytes("VmRSS")


def peak() -> int:
    """The most bytes this process has held since it started or since :func:`reset_peak` (``VmHWM``)."""
    return _status_bytes("VmHWM")


def reset_peak() -> int:
    """Start measuring the peak afresh; returns :func:`resident`, the baseline a phase's growth is measured from."""
    Path("/proc/self/clear_refs").write_text("5")
    return resident()
