"""Pipeline schedules as data, their invariants, and a simulator of their bubble.

A schedule lists, per stage, the ordered actions on micro-batches: forward (F) and
backward (B), or backward split in two (zero bubble): the input gradient (I), which
the previous stage waits for, and the weight gradient (W), which nobody waits for and
so can fill the idle slots. The executor adds the sends and receives between stages.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass

from epl.plugin_api import Action, ActionKind, Schedule, ScheduleGenerator

F, B, I, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT  # noqa: E741
#: Kinds whose end sends the input gradient to the previous stage.
GRADIENT_KINDS = (B, I)


def gpipe(num_stages: int, num_micro_batches: int) -> Schedule:
    """``PreferForward`` (GPipe): every forward, then every backward (in reverse order)."""
    return [
        [Action(s, F, m) for m in range(num_micro_batches)]
        + [Action(s, B, m) for m in reversed(range(num_micro_batches))]
        for s in range(num_stages)
    ]


def one_f_one_b(num_stages: int, num_micro_batches: int) -> Schedule:
    """``PreferBackward`` (1F1B, PipeDream-flush): stage s runs ``S - 1 - s`` warm-up forwards,
    then alternates one forward and one backward, then drains the backwards.

    At most ``S - s`` micro-batches are in flight on stage s.
    """
    schedule = []
    for s in range(num_stages):
        warmup = min(num_stages - 1 - s, num_micro_batches)
        actions = [Action(s, F, m) for m in range(warmup)]
        forward, backward = warmup, 0
        while backward < num_micro_batches:
            if forward < num_micro_batches:
                actions.append(Action(s, F, forward))
                forward += 1
            actions.append(Action(s, B, backward))
            backward += 1
        schedule.append(actions)
    return schedule


def zero_bubble(num_stages: int, num_micro_batches: int) -> Schedule:
    """``ZeroBubble`` (ZB-H1 of Qi et al., 2023): 1F1B with each backward split into I and W.

    Built by list scheduling with unit costs: an idle stage runs, in order of preference,
    the oldest input gradient it can (the previous stage waits for it), else the next
    forward if fewer than ``S`` micro-batches are in flight (a micro-batch is in flight
    until its W; ``S`` is 1F1B's peak, on its first stage, so the peak memory of the
    pipeline is 1F1B's), else the oldest pending weight gradient. The weight gradients
    fill slots where 1F1B idles: 4 stages x 8 micro-batches take 29 units instead of 33.
    """
    stages, micro = num_stages, num_micro_batches
    limit = [stages] * stages
    finished: dict[tuple[int, ActionKind, int], int] = {}  # action -> time step it ends
    next_forward, next_input, weights_done = [0] * stages, [0] * stages, [0] * stages
    schedule: list[list[Action]] = [[] for _ in range(stages)]
    time = 0
    while any(weights_done[s] < micro for s in range(stages)):
        for s in range(stages):

            def ready(key: tuple[int, ActionKind, int], now: int = time) -> bool:
                return finished.get(key, now + 1) <= now

            m = next_input[s]
            input_ready = m < next_forward[s] and ready((s, F, m)) and (s == stages - 1 or ready((s + 1, I, m)))
            forward_ready = (
                next_forward[s] < micro
                and next_forward[s] - weights_done[s] < limit[s]
                and (s == 0 or ready((s - 1, F, next_forward[s])))
            )
            if input_ready:
                action = Action(s, I, m)
                next_input[s] += 1
            elif forward_ready:
                action = Action(s, F, next_forward[s])
                next_forward[s] += 1
            elif weights_done[s] < next_input[s]:
                action = Action(s, W, weights_done[s])
                weights_done[s] += 1
            else:
                continue
            schedule[s].append(action)
            finished[(s, action.kind, action.micro_batch)] = time + 1
        time += 1
    return schedule


SCHEDULES = {"PreferForward": gpipe, "PreferBackward": one_f_one_b, "ZeroBubble": zero_bubble}


def build(name: str, registered: Mapping[str, ScheduleGenerator], num_stages: int, num_micro_batches: int) -> Schedule:
    """The schedule ``name`` among ``registered`` for this size, checked; ``ValueError`` says what is wrong."""
    if name not in registered:
        close = difflib.get_close_matches(name, registered, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"{name!r} is not a registered schedule; registered: {', '.join(sorted(registered))}.{hint} "
            "A plugin adds one through the epl_pipeline_schedules hook."
        )
    schedule = registered[name](num_stages, num_micro_batches)
    try:
        check(schedule, num_stages, num_micro_batches)
    except ValueError as error:
        raise ValueError(
            f"Schedule {name!r} is invalid for {num_stages} stages x {num_micro_batches} micro-batches: {error}"
        ) from None
    return schedule


def check(schedule: Schedule, num_stages: int, num_micro_batches: int) -> None:
    """Raise ``ValueError`` unless every stage runs, for each micro-batch, F then either B or
    I then W, once each, and the dependencies between stages can be met (no deadlock,
    checked by simulation)."""
    if len(schedule) != num_stages:
        raise ValueError(f"schedule has {len(schedule)} stages, expected {num_stages}")
    for s, actions in enumerate(schedule):
        seen = [(a.kind, a.micro_batch) for a in actions if a is not None]
        if any(a is not None and a.stage != s for a in actions):
            raise ValueError(f"stage {s}'s list holds actions of another stage")
        if len(set(seen)) != len(seen):
            raise ValueError(f"stage {s} runs an action twice")
        for m in range(num_micro_batches):
            split = (I, m) in seen or (W, m) in seen
            needed = [(F, m), (I, m), (W, m)] if split else [(F, m), (B, m)]
            missing = [f"{kind.value}{m}" for kind, _ in needed if (kind, m) not in seen]
            if missing or (split and (B, m) in seen):
                raise ValueError(f"stage {s} must run F{m} then B{m} (or I{m} then W{m}); missing {missing}")
            for first, then in zip(needed, needed[1:], strict=False):
                if seen.index(then) < seen.index(first):
                    raise ValueError(f"stage {s} runs {then[0].value}{m} before {first[0].value}{m}")
        if len(seen) != sum(3 if (I, m) in seen else 2 for m in range(num_micro_batches)):
            raise ValueError(f"stage {s} runs actions on micro-batches outside 0..{num_micro_batches - 1}")
    simulate(schedule)


@dataclass(frozen=True)
class Event:
    """One action placed in time (by the simulator, or measured in a real run)."""

    action: Action
    start: float
    end: float


def timeline(schedule: Schedule, forward_cost: float = 1.0, backward_cost: float = 2.0) -> list[Event]:
    """When every action of ``schedule`` runs, given its cost and what it waits for; a deadlock raises.

    I and W each cost half a backward.
    """
    stages = len(schedule)
    cost = {F: forward_cost, B: backward_cost, I: backward_cost / 2, W: backward_cost / 2}
    done: dict[tuple[int, str, int], float] = {}
    position = [0] * stages
    clock = [0.0] * stages
    queues = [[a for a in actions if a is not None] for actions in schedule]
    events = []
    while any(position[s] < len(queues[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if position[s] == len(queues[s]):
                continue
            action = queues[s][position[s]]
            needed = _dependency(action, stages)
            if needed is not None and needed not in done:
                continue
            start = max(clock[s], done[needed] if needed is not None else 0.0)
            clock[s] = start + cost[action.kind]
            done[_key(action)] = clock[s]
            events.append(Event(action, start, clock[s]))
            position[s] += 1
            progressed = True
        if not progressed:
            stuck = {s: str(queues[s][position[s]]) for s in range(stages) if position[s] < len(queues[s])}
            raise ValueError(f"schedule deadlocks: stages wait on each other at {stuck}")
    return events


def _key(action: Action) -> tuple[int, str, int]:
    """What an action makes available: activations (F), input gradients (B or I), weights done (W)."""
    kind = "G" if action.kind in GRADIENT_KINDS else action.kind.value
    return (action.stage, kind, action.micro_batch)


def _dependency(action: Action, stages: int) -> tuple[int, str, int] | None:
    """What an action waits for (see ``_key``)."""
    s, m = action.stage, action.micro_batch
    if action.kind is F:
        return (s - 1, "F", m) if s > 0 else None
    if action.kind is W:
        return (s, "G", m)
    return (s + 1, "G", m) if s < stages - 1 else (s, "F", m)


def simulate(schedule: Schedule, forward_cost: float = 1.0, backward_cost: float = 2.0) -> tuple[float, float]:
    """(makespan, bubble fraction) of ``schedule`` with the given costs per action; a deadlock raises."""
    events = timeline(schedule, forward_cost, backward_cost)
    return bubble(events, len(schedule))


def bubble(events: list[Event], stages: int) -> tuple[float, float]:
    """(makespan, idle fraction) of a timeline, simulated or measured."""
    begin = min(event.start for event in events)
    makespan = max(event.end for event in events) - begin
    busy = sum(event.end - event.start for event in events)
    return makespan, 1.0 - busy / (stages * makespan)


def peak_in_flight(actions: list[Action | None]) -> int:
    """Most micro-batches whose activations one stage holds at once (from F until B or W)."""
    in_flight = peak = 0
    for action in actions:
        if action is None:
            continue
        if action.kind is F:
            in_flight += 1
            peak = max(peak, in_flight)
        elif action.kind in (B, W):
            in_flight -= 1
    return peak
