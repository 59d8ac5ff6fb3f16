"""Pipeline schedules as data: what the ``epl_pipeline_schedules`` hook registers.

A schedule lists, per pipeline rank (a "lane"), the ordered actions that rank performs;
``None`` marks an idle slot (a bubble). A pipeline of ``S`` stages may run ``v`` stages
per rank (``pipeline.stages_per_rank``, Megatron's virtual pipeline size): there are then
``P = S // v`` lanes and stage ``s`` runs on lane ``s % P``. With one stage per rank
(``v = 1``) lane and stage are the same. One executor (epl-pipeline) runs every
schedule, so a plugin adds a schedule without touching the executor, and a schedule
can be drawn or simulated for stage counts this machine does not have.
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


@dataclass(frozen=True)
class Action:
    """``kind`` of micro-batch ``micro_batch`` on ``stage`` (the global stage, ``0 .. S-1``); printed as ``1F3``."""

    stage: int
    kind: ActionKind
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.micro_batch}"


#: Per lane (pipeline rank ``r``, which runs the stages ``s`` with ``s % P == r``), its ordered actions
#: (``None`` = idle); ``Action.stage`` is the global stage. With one stage per rank: per stage.
Schedule = Sequence[Sequence[Action | None]]


class ScheduleGenerator(Protocol):
    """Builds the schedule of ``num_stages`` stages over ``num_micro_batches`` micro-batches.

    It is called as ``gen(num_stages, num_micro_batches)`` for one stage per rank. A generator
    that can run several stages per rank also accepts the keyword ``stages_per_rank: int``
    (``v``) and is then called as ``gen(S, M, stages_per_rank=v)``: it returns ``S // v``
    lanes. A generator without that keyword only serves ``pipeline.stages_per_rank = 1``.
    """

    def __call__(self, num_stages: int, num_micro_batches: int) -> Schedule:
        """Return the per-lane action lists (per stage, with one stage per rank)."""
        ...
