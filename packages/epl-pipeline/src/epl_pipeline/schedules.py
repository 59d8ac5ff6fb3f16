"""Pipeline schedules as data, their invariants, and a simulator of their bubble.

A schedule lists, per stage, the ordered forward (F) and backward (B) actions on
micro-batches; the executor adds the sends and receives between stages.
"""

from __future__ import annotations

from dataclasses import dataclass

from epl.schedule import Action, ActionKind, Schedule

F, B = ActionKind.FORWARD, ActionKind.BACKWARD


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


SCHEDULES = {"PreferForward": gpipe, "PreferBackward": one_f_one_b}


def check(schedule: Schedule, num_stages: int, num_micro_batches: int) -> None:
    """Raise ``ValueError`` unless every stage runs F then B of every micro-batch once and the
    dependencies between stages can be met (no deadlock, checked by simulation)."""
    if len(schedule) != num_stages:
        raise ValueError(f"schedule has {len(schedule)} stages, expected {num_stages}")
    for s, actions in enumerate(schedule):
        seen = [(a.kind, a.micro_batch) for a in actions if a is not None]
        expected = {(kind, m) for kind in (F, B) for m in range(num_micro_batches)}
        if sorted(seen, key=str) != sorted(expected, key=str):
            raise ValueError(f"stage {s} does not run one F and one B of each of {num_micro_batches} micro-batches")
        for m in range(num_micro_batches):
            if seen.index((F, m)) > seen.index((B, m)):
                raise ValueError(f"stage {s} runs B{m} before F{m}")
    simulate(schedule)


@dataclass(frozen=True)
class Event:
    """One action placed in time by the simulator."""

    action: Action
    start: float
    end: float


def timeline(schedule: Schedule, forward_cost: float = 1.0, backward_cost: float = 2.0) -> list[Event]:
    """When every action of ``schedule`` runs, given its cost and what it waits for; a deadlock raises."""
    stages = len(schedule)
    done: dict[tuple[int, ActionKind, int], float] = {}
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
            m = action.micro_batch
            if action.kind is F:
                needed = (s - 1, F, m) if s > 0 else None
            else:
                needed = (s + 1, B, m) if s < stages - 1 else (s, F, m)
            if needed is not None and needed not in done:
                continue
            start = max(clock[s], done[needed] if needed is not None else 0.0)
            clock[s] = start + (forward_cost if action.kind is F else backward_cost)
            done[(s, action.kind, m)] = clock[s]
            events.append(Event(action, start, clock[s]))
            position[s] += 1
            progressed = True
        if not progressed:
            stuck = {s: str(queues[s][position[s]]) for s in range(stages) if position[s] < len(queues[s])}
            raise ValueError(f"schedule deadlocks: stages wait on each other at {stuck}")
    return events


def simulate(schedule: Schedule, forward_cost: float = 1.0, backward_cost: float = 2.0) -> tuple[float, float]:
    """(makespan, bubble fraction) of ``schedule`` with the given costs per action; a deadlock raises."""
    events = timeline(schedule, forward_cost, backward_cost)
    makespan = max(event.end for event in events)
    busy = sum(event.end - event.start for event in events)
    return makespan, 1.0 - busy / (len(schedule) * makespan)
