"""Schedule invariants and bubbles, without processes, for a grid of stages x micro-batches."""

from __future__ import annotations

import pytest

from epl.schedule import Action, ActionKind
from epl_pipeline.schedules import SCHEDULES, check, gpipe, one_f_one_b, simulate


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("micro_batches", [1, 2, 4, 7, 16])
def test_every_schedule_is_complete_ordered_and_deadlock_free(name: str, stages: int, micro_batches: int) -> None:
    schedule = SCHEDULES[name](stages, micro_batches)
    check(schedule, stages, micro_batches)
    _, bubble = simulate(schedule, 1.0, 1.0)
    assert bubble == pytest.approx((stages - 1) / (micro_batches + stages - 1))


def test_1f1b_keeps_at_most_s_minus_stage_micro_batches_in_flight() -> None:
    stages, micro_batches = 4, 8
    for stage, actions in enumerate(one_f_one_b(stages, micro_batches)):
        in_flight = peak = 0
        for action in actions:
            in_flight += 1 if action.kind is ActionKind.FORWARD else -1
            peak = max(peak, in_flight)
        assert peak == stages - stage
    assert max(len([a for a in gpipe(stages, micro_batches)[0] if a.kind is ActionKind.FORWARD]), 0) == micro_batches


def test_compact_form_and_bad_schedules() -> None:
    assert [str(a) for a in one_f_one_b(2, 3)[0]] == ["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"]
    with pytest.raises(ValueError, match="runs B0 before F0"):
        check([[Action(0, ActionKind.BACKWARD, 0), Action(0, ActionKind.FORWARD, 0)]], 1, 1)
    deadlock = [
        [Action(0, ActionKind.BACKWARD, 0), Action(0, ActionKind.FORWARD, 0)],
        [Action(1, ActionKind.FORWARD, 0), Action(1, ActionKind.BACKWARD, 0)],
    ]
    with pytest.raises(ValueError):
        check(deadlock, 2, 1)
