"""A process's resident memory and its peak, from Linux's /proc (``VmRSS``, ``VmHWM``), for memory benchmarks.

The peak is reset by writing 5 to ``/proc/self/clear_refs`` (Linux 4.0+), so that a
benchmark measures the peak of one phase (building and parallelizing a model) over
what the process held when the phase began.
"""

from __future__ import annotations

from pathlib import Path


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
