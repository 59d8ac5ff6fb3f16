"""``InOrderBackward``: GPipe's shape (every forward, then every backward) with the backwards in micro-batch order.

GPipe (``PreferForward``) runs the backwards newest first; this schedule runs them oldest
first on every stage. The makespan and peak memory are GPipe's (every stage holds every
micro-batch's activations), but each parameter's gradient is summed over the micro-batches
in the same order as the plain gradient-accumulation loop (micro-batch 0 first), so the
result is the same as the one-process run's, to the bit.

A schedule is data: per stage, its ordered actions (``Action(stage, kind, micro_batch)``, or
None for an idle slot). epl-pipeline checks it before use (each micro-batch's F before its B,
once each, no deadlock, and neighbouring stages exchanging micro-batches in the same order)
and runs it with its one executor. Stages exchange activations and gradients in the order
they run them, so neighbouring stages must run the forwards in the same order and the
backwards in the same order, as they do here.
"""

from __future__ import annotations

from epl.plugin_api import Action, ActionKind, Schedule, ScheduleGenerator

#: The name users set ``pipeline.strategy`` to.
IN_ORDER_BACKWARD = "InOrderBackward"


def in_order_backward(num_stages: int, num_micro_batches: int) -> Schedule:
    """Every stage: ``F0 .. F(M-1)``, then ``B0 .. B(M-1)``."""
    return [
        [Action(stage, ActionKind.FORWARD, m) for m in range(num_micro_batches)]
        + [Action(stage, ActionKind.BACKWARD, m) for m in range(num_micro_batches)]
        for stage in range(num_stages)
    ]


#: The schedules this plugin registers, by name.
SCHEDULES: dict[str, ScheduleGenerator] = {IN_ORDER_BACKWARD: in_order_backward}
