"""The collectives one call issues on this rank, from the PyTorch profiler: how many, of what shape, how many bytes."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class CollectiveCount:
    """The c10d collectives of one call: ``counts["allreduce [2, 128, 512]"] = 18`` and their payload bytes."""

    counts: dict[str, int] = field(default_factory=dict)
    #: The bytes of the tensors handed to the collectives (the payload, not what the wire carries).
    bytes: int = 0

    def add(self, key: str, payload: int) -> None:
        """Count one collective called ``key`` of ``payload`` bytes."""
        self.counts[key] = self.counts.get(key, 0) + 1
        self.bytes += payload


def collectives_of(step: Callable[[], object], element_size: int = 4) -> CollectiveCount:
    """The c10d collectives one call of ``step`` issues on this rank (barriers left out).

    Counted by "operation [shape of the first tensor]". The profiler records shapes, not
    dtypes, for tensor lists: each tensor is counted as ``element_size`` bytes an element.
    """
    from torch.profiler import ProfilerActivity, profile

    from epl_memory.measure import trace_events

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    found = CollectiveCount()
    for event in trace_events(prof):
        name = event.get("name", "")
        if name.startswith("c10d::") and name != "c10d::barrier":
            dims = event["args"].get("Input Dims") or [[[]]]
            shape = dims[0][0] if dims[0] else []
            shape = [shape] if isinstance(shape, int) else shape  # a flat input (an all-gather into a tensor)
            found.add(f"{name.removeprefix('c10d::').rstrip('_')} {shape}", math.prod(shape) * element_size)
    return found


def less_batch_check(counts: dict[str, int]) -> tuple[dict[str, int], int]:
    """``counts`` without the all-gathers of EPL's batch check (a few float64 numbers over a replica's ranks, in
    its first steps and every 50th: :mod:`epl.runtime.batch_check`) and of its check of non-finite steps (two
    numbers a rank, every step: :mod:`epl.runtime.nonfinite`), and how many there were."""
    check = {key: n for key, n in counts.items() if "allgather" in key and _numbers(key) < 64}
    return {key: n for key, n in counts.items() if key not in check}, sum(check.values())


def _numbers(key: str) -> int:
    """The elements of a count's shape (``"allgather [16]"`` -> 16)."""
    shape = key.rpartition(" ")[2].strip("[]")
    return math.prod(int(size) for size in shape.split(",") if size.strip()) if shape else 0
