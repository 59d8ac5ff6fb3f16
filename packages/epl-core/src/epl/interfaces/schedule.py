"""Pipeline schedules as data: what the ``epl_pipeline_schedules`` hook registers.

A schedule lists, per pipeline stage, the ordered actions that stage performs;
``None`` marks an idle slot (a bubble). One executor (epl-pipeline) runs every
schedule, so a plugin adds a schedule without touching the executor, and a
schedule can be drawn or simulated for stage counts this machine does not have.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class ActionKind(enum.Enum):
    """One step of a stage's work."""

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    SEND_ACTIVATION = "SEND_F"
    RECV_ACTIVATION = "RECV_F"
    SEND_GRADIENT = "SEND_B"
    RECV_GRADIENT = "RECV_B"


@dataclass(frozen=True)
class Action:
    """``kind`` of micro-batch ``micro_batch`` on ``stage``; printed compactly as ``1F3``."""

    stage: int
    kind: ActionKind
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.micro_batch}"


#: Per stage, its ordered actions (``None`` = idle).
Schedule = Sequence[Sequence[Action | None]]


class ScheduleGenerator(Protocol):
    """Builds the schedule of ``num_stages`` stages over ``num_micro_batches`` micro-batches."""

    def __call__(self, num_stages: int, num_micro_batches: int) -> Schedule:
        """Return the per-stage action lists."""
        ...
