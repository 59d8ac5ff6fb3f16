"""Schedule invariants and bubbles, without processes, for a generated grid of stages x micro-batches."""

from __future__ import annotations

import pytest

from epl.interfaces.schedule import Action, ActionKind
from epl_pipeline.schedules import (
    SCHEDULES,
    build,
    check,
    gpipe,
    interleaved_one_f_one_b,
    one_f_one_b,
    peak_in_flight,
    simulate,
    zero_bubble,
)

GRID = [(stages, micro) for stages in range(1, 9) for micro in range(1, 17)]
#: (pipeline ranks P, stages per rank v, micro-batches m) for the interleaved schedule.
INTERLEAVED = [(2, 2, 2), (2, 2, 4), (4, 2, 8), (2, 3, 4), (4, 2, 4), (3, 2, 9), (4, 3, 12), (2, 4, 8)]
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


# -- interleaved 1F1B (several stages per rank) ------------------------------------------------------


def test_interleaved_with_one_stage_per_rank_is_1f1b() -> None:
    for stages, micro in GRID:
        assert interleaved_one_f_one_b(stages, micro) == one_f_one_b(stages, micro), (stages, micro)
        assert build("Interleaved1F1B", SCHEDULES, stages, micro) == one_f_one_b(stages, micro)


@pytest.mark.parametrize(("lanes", "per_rank", "micro"), INTERLEAVED)
def test_interleaved_is_valid_with_megatron_s_peak_in_flight(lanes: int, per_rank: int, micro: int) -> None:
    stages = lanes * per_rank
    schedule = build("Interleaved1F1B", SCHEDULES, stages, micro, stages_per_rank=per_rank)
    check(schedule, stages, micro)
    assert len(schedule) == lanes
    for r, actions in enumerate(schedule):
        assert {a.stage for a in actions} == set(range(r, stages, lanes))
        assert sum(a.kind is F for a in actions) == sum(a.kind is B for a in actions) == micro * per_rank
        # Megatron: (P - r - 1) * 2 + (v - 1) * P warm-up forwards (all m * v when m == P), then 1F1B: one more.
        warmup = micro * per_rank if micro == lanes else (lanes - r - 1) * 2 + (per_rank - 1) * lanes
        assert peak_in_flight(actions) == min(warmup + 1, micro * per_rank), r


@pytest.mark.parametrize(("lanes", "per_rank", "micro"), INTERLEAVED)
def test_interleaved_exchanges_between_two_ranks_come_in_the_order_the_receiver_runs_them(
    lanes: int, per_rank: int, micro: int
) -> None:
    """Beyond ``check``'s rule per link: all the links between one pair of ranks agree too (one channel is enough)."""
    schedule = interleaved_one_f_one_b(lanes * per_rank, micro, stages_per_rank=per_rank)
    last = lanes * per_rank - 1
    for r in range(lanes):
        after = (r + 1) % lanes
        sent = [(a.stage + 1, a.micro_batch) for a in schedule[r] if a.kind is F and a.stage < last]
        assert sent == [(a.stage, a.micro_batch) for a in schedule[after] if a.kind is F and a.stage > 0]
        sent = [(a.stage, a.micro_batch) for a in schedule[after] if a.kind is B and a.stage > 0]
        assert sent == [(a.stage + 1, a.micro_batch) for a in schedule[r] if a.kind is B and a.stage < last]


def test_interleaved_bubble_is_v_times_shorter_than_1f1b_s_at_the_same_work() -> None:
    for lanes in range(2, 6):
        for per_rank in range(2, 5):
            for micro in range(lanes, 4 * lanes + 1, lanes):
                ours = simulate(interleaved_one_f_one_b(lanes * per_rank, micro, stages_per_rank=per_rank), 1.0, 2.0)
                theirs = simulate(one_f_one_b(lanes, micro), 1.0, 2.0)
                assert ours[1] < theirs[1], (lanes, per_rank, micro)
                # Each action costs 1/v: the fill and drain take (P - 1) * 3 / v, the work 3 * m.
                assert ours[0] == pytest.approx(3 * micro + 3 * (lanes - 1) / per_rank)
                assert ours[1] == pytest.approx((lanes - 1) / (per_rank * micro + lanes - 1))
    # P=2 m=4: 15 (bubble 0.200) -> 13.5 (0.111); P=4 m=8: 33 (0.273) -> 28.5 (0.158); P=4 m=16: 57 (0.158) -> 52.5.
    assert simulate(one_f_one_b(4, 8)) == pytest.approx((33, 3 / 11))
    assert simulate(interleaved_one_f_one_b(8, 8, stages_per_rank=2)) == pytest.approx((28.5, 3 / 19))


def test_interleaved_and_stages_per_rank_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match=r"\(m = 6\) to be a multiple of the pipeline ranks .* = 4\); try m = 4 or 8"):
        interleaved_one_f_one_b(8, 6, stages_per_rank=2)
    with pytest.raises(ValueError, match="'PreferBackward' .* needs a schedule that runs several stages per rank"):
        build("PreferBackward", SCHEDULES, 8, 8, stages_per_rank=2)
    with pytest.raises(ValueError, match="must divide the 7 pipeline stages"):
        build("Interleaved1F1B", SCHEDULES, 7, 8, stages_per_rank=2)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        build("Interleaved1F1B", SCHEDULES, 2, 8, stages_per_rank=2)

    def anything(num_stages: int, num_micro_batches: int, **options: int) -> list[list[Action]]:
        return one_f_one_b(num_stages, num_micro_batches)

    with pytest.raises(ValueError, match="it has 4 lanes, expected 2"):
        build("Anything", {"Anything": anything}, 4, 4, stages_per_rank=2)


def test_check_rules_for_lanes_and_message_orders() -> None:
    good = interleaved_one_f_one_b(4, 2, stages_per_rank=2)
    with pytest.raises(ValueError, match="3 lanes .* does not divide 4 stages"):
        check([*good, []], 4, 2)
    with pytest.raises(ValueError, match=r"lane 0's list holds 1F0, an action of another stage than \[0, 2\]"):
        check([good[1], good[0]], 4, 2)
    first = [Action(0, F, 0), Action(0, F, 1), Action(0, B, 0), Action(0, B, 1)]
    backwards_swapped = [Action(1, F, 0), Action(1, F, 1), Action(1, B, 1), Action(1, B, 0)]
    with pytest.raises(ValueError, match=r"stage 1 sends its input gradients .* \[1, 0\] but stage 0 .* \[0, 1\]"):
        check([first, backwards_swapped], 2, 2)
    forwards_swapped = [Action(1, F, 1), Action(1, F, 0), Action(1, B, 0), Action(1, B, 1)]
    with pytest.raises(ValueError, match=r"stage 0 sends its activations in micro-batch order \[0, 1\] but stage 1"):
        check([first, forwards_swapped], 2, 2)


def test_one_stream_per_pair_of_ranks_for_every_built_in_schedule() -> None:
    """Every built-in schedule sends each pair of ranks' messages (all links, both kinds) in the order the
    receiver takes them, so one communicator carries them; a schedule that mixes the links' order does not."""
    from epl_pipeline.schedules import one_stream_per_pair

    for stages, micro in [(2, 4), (3, 5), (4, 8)]:
        for generator in (gpipe, one_f_one_b, zero_bubble):
            assert one_stream_per_pair(generator(stages, micro)), (generator.__name__, stages, micro)
    for lanes, per_rank, micro in INTERLEAVED:
        assert one_stream_per_pair(interleaved_one_f_one_b(lanes * per_rank, micro, stages_per_rank=per_rank))
    # P=2, v=2: rank 0 runs stage 2's forward of micro-batch 0 before stage 0's: rank 1 then receives stage
    # 2's activation first, but runs stage 1's forward (which takes stage 0's) first.
    mixed = [
        [Action(2, F, 0), Action(0, F, 0), Action(2, B, 0), Action(0, B, 0)],
        [Action(1, F, 0), Action(3, F, 0), Action(3, B, 0), Action(1, B, 0)],
    ]
    assert not one_stream_per_pair(mixed)
