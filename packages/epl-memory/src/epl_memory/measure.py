"""Measuring memory on CPU: the allocator's running total under the PyTorch profiler (tests and benchmarks use it)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch


def trace_events(prof: torch.profiler.profile) -> list[dict[str, Any]]:
    """The events of a finished profile, as its Chrome trace has them (with shapes and allocator totals)."""
    with tempfile.TemporaryDirectory(prefix="epl-bench-") as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as file:
            return json.load(file)["traceEvents"]


def peak_allocated_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes that ``fn`` held allocated at once from the CPU allocator, above what was live before it.

    Under ``torch.profiler.profile(profile_memory=True)`` the CPU allocator reports
    every allocation and every free, with its running total of the bytes allocated
    since profiling began and not yet freed ("Total Allocated" of the ``[memory]``
    events of the trace). The peak of that total over ``fn`` is its peak footprint:
    every tensor it made (outputs, temporaries, tensors saved for backward,
    gradients, collective buffers) while it lived, freed ones included only while
    they were alive. Tensors that existed before (the inputs) are not counted; what
    ``fn`` made and kept (a leaf's ``.grad``) is. Memory that bypasses PyTorch's
    allocator (gloo's own small staging buffers) is not counted on either side.
    """
    base, totals = _allocator_totals(fn)
    return max(totals) - base


def steady_peak_allocated_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes ``fn``'s second call holds above what was allocated when it began (``fn`` runs twice).

    For code that frees tensors made before it and makes them again (a training step's
    ``zero_grad`` and new gradients): the profiler reports no free of a block allocated
    before profiling began, so :func:`peak_allocated_bytes` would count such tensors twice.
    Here every block the second call frees was allocated under the profiler.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    marker = "epl.measure.second_call"
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
        with record_function(marker):
            pass
        fn()
    events = trace_events(prof)
    boundary = next(e for e in events if e.get("name") == marker and e.get("ph") == "X")
    memory = _cpu_allocator_events(events)
    before = [e["args"]["Total Allocated"] for e in memory if e["ts"] <= boundary["ts"]]
    after = [e["args"]["Total Allocated"] for e in memory if e["ts"] >= boundary["ts"] + boundary.get("dur", 0)]
    return max(after) - before[-1]


def kept_allocated_bytes(fn: Callable[[], object]) -> int:
    """Bytes that ``fn`` left allocated when it returned (what it made and kept), above what was live before it.

    Measured like :func:`peak_allocated_bytes`, from the allocator's last running total.
    """
    base, totals = _allocator_totals(fn)
    return totals[-1] - base


def _allocator_totals(fn: Callable[[], object]) -> tuple[int, list[int]]:
    """(bytes live before ``fn``, the allocator's running total after each of its allocations and frees)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    memory = _cpu_allocator_events(trace_events(prof))
    assert memory, "the profiler recorded no CPU allocation"
    # The running total may carry what earlier profiled code left allocated; start from it.
    first = memory[0]["args"]
    return first["Total Allocated"] - first["Bytes"], [e["args"]["Total Allocated"] for e in memory]


def _cpu_allocator_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The CPU allocator's allocation and free events of a trace, in time order."""
    return sorted(
        (e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0),
        key=lambda e: e["ts"],
    )
