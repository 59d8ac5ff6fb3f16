"""Schedule invariants and bubbles, without processes, for a generated grid of stages x micro-batches."""

from __future__ import annotations

import pytest

from epl.interfaces.schedule import Action, ActionKind
from epl_pipeline.schedules import SCHEDULES, check, gpipe, one_f_one_b, peak_in_flight, simulate, zero_bubble

GRID = [(stages, micro) for stages in range(1, 9) for micro in range(1, 17)]
F, B, I, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT  # noqa: E741


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_is_complete_ordered_and_deadlock_free_on_the_grid(name: str) -> None:
    for stages, micro in GRID:
        check(SCHEDULES[name](stages, micro), stages, micro)


@pytest.mark.parametrize("name", ["PreferForward", "PreferBackward"])
def test_gpipe_and_1f1b_reach_the_theoretical_bubble(name: str) -> None:
    for stages, micro in GRID:
        _, bubble = simulate(SCHEDULES[name](stages, micro), 1.0, 2.0)
        assert bubble == pytest.approx((stages - 1) / (micro + stages - 1)), (stages, micro)


def test_zero_bubble_beats_both_with_the_same_peak_memory_as_1f1b() -> None:
    for stages, micro in GRID:
        ours, theirs = zero_bubble(stages, micro), one_f_one_b(stages, micro)
        makespan, _ = simulate(ours, 1.0, 2.0)
        baseline, _ = simulate(theirs, 1.0, 2.0)
        if stages == 1:
            assert makespan == baseline
        else:
            assert makespan < baseline, (stages, micro)
        assert max(map(peak_in_flight, ours)) <= max(map(peak_in_flight, theirs))
    assert simulate(zero_bubble(4, 8), 1.0, 2.0)[0] == 29 < simulate(one_f_one_b(4, 8), 1.0, 2.0)[0] == 33


def test_1f1b_keeps_at_most_s_minus_stage_micro_batches_in_flight() -> None:
    stages, micro_batches = 4, 8
    assert [peak_in_flight(actions) for actions in one_f_one_b(stages, micro_batches)] == [4, 3, 2, 1]
    assert [peak_in_flight(actions) for actions in gpipe(stages, micro_batches)] == [8] * 4


def test_compact_form_and_bad_schedules() -> None:
    assert [str(a) for a in one_f_one_b(2, 3)[0]] == ["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"]
    assert {a.kind for a in zero_bubble(2, 3)[0]} == {F, I, W}
    with pytest.raises(ValueError, match="runs B0 before F0"):
        check([[Action(0, B, 0), Action(0, F, 0)]], 1, 1)
    with pytest.raises(ValueError, match="runs W0 before I0"):
        check([[Action(0, F, 0), Action(0, W, 0), Action(0, I, 0)]], 1, 1)
    with pytest.raises(ValueError, match="missing"):
        check([[Action(0, F, 0), Action(0, I, 0)]], 1, 1)
    with pytest.raises(ValueError, match="twice"):
        check([[Action(0, F, 0), Action(0, F, 0), Action(0, B, 0)]], 1, 1)
    with pytest.raises(ValueError, match="another stage"):
        check([[Action(1, F, 0), Action(1, B, 0)]], 1, 1)
    deadlock = [
        [Action(0, B, 0), Action(0, F, 0)],
        [Action(1, F, 0), Action(1, B, 0)],
    ]
    with pytest.raises(ValueError):
        check(deadlock, 2, 1)
