"""Pipeline schedules as data, their invariants, and a simulator of their bubble.

A schedule lists, per lane (pipeline rank), the ordered actions on micro-batches: forward
(F) and backward (B), or backward split in two (zero bubble): the input gradient (I), which
the previous stage waits for, and the weight gradient (W), which nobody waits for and so can
fill the idle slots. With ``v`` stages per rank there are ``P = S // v`` lanes and stage ``s``
runs on lane ``s % P``; with one stage per rank lane and stage are the same. The executor
adds the sends and receives between stages.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable, Mapping, Sequence
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


def interleaved_one_f_one_b(num_stages: int, num_micro_batches: int, *, stages_per_rank: int = 1) -> Schedule:
    """``Interleaved1F1B`` (Megatron-LM's virtual pipeline): 1F1B where each rank runs ``v`` stages.

    The ``S`` stages are dealt round-robin to ``P = S // v`` ranks (stage ``s`` on rank
    ``s % P``), so a micro-batch visits every rank ``v`` times, and each visit (a "chunk")
    is ``1/v`` of the rank's work. A rank walks its ``m * v`` forwards in rounds: ``P``
    micro-batches through its first chunk, the same ``P`` through its second chunk, ... then
    the next ``P`` micro-batches; the backwards go the same way with the chunks from last to
    first. Rank ``r`` first runs ``(P - r - 1) * 2 + (v - 1) * P`` forwards (at most ``m * v``;
    all of them when ``m == P``, as Megatron does), then alternates one forward and one
    backward, then drains the backwards. So it holds at most ``warm-up + 1`` chunk activations
    (``m * v`` when all are warm-up), each ``1/v`` of the rank's share: with ``m > P`` rank 0
    holds ``(P * (v + 1) - 1) / v`` shares where 1F1B holds ``P``, about ``1 + 1/v`` times more.

    The pipeline fills and drains in steps of a chunk, ``1/v`` of a rank's work, instead of
    a whole rank's share, so the bubble is ``v`` times shorter: ``(P - 1) / (v * m + P - 1)``
    of the time against 1F1B's ``(P - 1) / (m + P - 1)`` (the simulator gives exactly that),
    at the price of ``v`` times more messages. ``m`` must be a multiple of ``P``. With
    ``stages_per_rank = 1`` it is 1F1B (``PreferBackward``).
    """
    if stages_per_rank == 1:
        return one_f_one_b(num_stages, num_micro_batches)
    lanes = pipeline_ranks(num_stages, stages_per_rank)
    if num_micro_batches % lanes:
        below = num_micro_batches // lanes * lanes
        suggestions = " or ".join(str(n) for n in (below, below + lanes) if n > 0)
        raise ValueError(
            f"Interleaved1F1B needs the micro-batches (m = {num_micro_batches}) to be a multiple of the pipeline "
            f"ranks (P = {num_stages} stages / {stages_per_rank} per rank = {lanes}); try m = {suggestions}."
        )
    return [_interleaved_lane(r, lanes, stages_per_rank, num_micro_batches) for r in range(lanes)]


def _interleaved_lane(lane: int, lanes: int, chunks: int, micro: int) -> list[Action]:
    """Rank ``lane``'s actions in Megatron's interleaved 1F1B order (see ``interleaved_one_f_one_b``)."""
    total = micro * chunks
    warmup = total if micro == lanes else min((lanes - lane - 1) * 2 + (chunks - 1) * lanes, total)

    def nth(kind: ActionKind, k: int) -> Action:
        chunk = (k // lanes) % chunks
        if kind is B:
            chunk = chunks - 1 - chunk
        return Action(chunk * lanes + lane, kind, (k // (lanes * chunks)) * lanes + k % lanes)

    actions = [nth(F, k) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [nth(F, warmup + k), nth(B, k)]
    return actions + [nth(B, k) for k in range(total - warmup, total)]


SCHEDULES = {
    "PreferForward": gpipe,
    "PreferBackward": one_f_one_b,
    "ZeroBubble": zero_bubble,
    "Interleaved1F1B": interleaved_one_f_one_b,
}


def pipeline_ranks(num_stages: int, stages_per_rank: int) -> int:
    """``P = S // v``, the ranks (lanes) along a pipeline of ``num_stages`` stages with ``stages_per_rank`` each.

    ``ValueError`` unless ``v`` divides ``S`` and, with several stages per rank, ``P >= 2``.
    """
    if stages_per_rank < 1 or num_stages % stages_per_rank:
        raise ValueError(
            f"pipeline.stages_per_rank = {stages_per_rank} must divide the {num_stages} pipeline stages "
            "(stage s runs on rank s % (stages // stages_per_rank))"
        )
    lanes = num_stages // stages_per_rank
    if stages_per_rank > 1 and lanes < 2:
        raise ValueError(
            f"{num_stages} stages with pipeline.stages_per_rank = {stages_per_rank} make {lanes} pipeline rank; "
            "several stages per rank need at least 2 ranks"
        )
    return lanes


def build(
    name: str,
    registered: Mapping[str, ScheduleGenerator],
    num_stages: int,
    num_micro_batches: int,
    stages_per_rank: int = 1,
) -> Schedule:
    """The schedule ``name`` among ``registered`` for this size, checked; ``ValueError`` says what is wrong.

    With ``stages_per_rank == 1`` the generator is called as ``gen(S, M)``; with more, as
    ``gen(S, M, stages_per_rank=v)``, which only generators taking that keyword accept.
    """
    if name not in registered:
        close = difflib.get_close_matches(name, registered, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"{name!r} is not a registered schedule; registered: {', '.join(sorted(registered))}.{hint} "
            "A plugin adds one through the epl_pipeline_schedules hook."
        )
    lanes = pipeline_ranks(num_stages, stages_per_rank)
    schedule = _generate(name, registered[name], num_stages, num_micro_batches, stages_per_rank)
    try:
        if len(schedule) != lanes:
            raise ValueError(f"it has {len(schedule)} lanes, expected {lanes} (one per pipeline rank)")
        check(schedule, num_stages, num_micro_batches)
    except ValueError as error:
        per_rank = f" ({stages_per_rank} per rank)" if stages_per_rank > 1 else ""
        raise ValueError(
            f"Schedule {name!r} is invalid for {num_stages} stages{per_rank} x {num_micro_batches} micro-batches: "
            f"{error}"
        ) from None
    return schedule


def _generate(name: str, generator: ScheduleGenerator, stages: int, micro: int, per_rank: int) -> Schedule:
    """Call ``generator``, passing ``stages_per_rank`` only when it is above 1 (and so only to those that take it)."""
    if per_rank == 1:
        return generator(stages, micro)
    if not _takes_stages_per_rank(generator):
        raise ValueError(
            f"Schedule {name!r} runs one stage per rank: pipeline.stages_per_rank = {per_rank} (> 1) needs a "
            "schedule that runs several stages per rank, e.g. 'Interleaved1F1B'."
        )
    return generator(stages, micro, stages_per_rank=per_rank)  # type: ignore[call-arg]  # it takes it (checked)


def _takes_stages_per_rank(generator: ScheduleGenerator) -> bool:
    """Whether ``generator`` accepts the keyword ``stages_per_rank`` (or any keyword); unknown signatures: yes."""
    try:
        parameters = inspect.signature(generator).parameters.values()
    except (TypeError, ValueError):
        return True
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD or (p.name == "stages_per_rank" and p.kind in keyword)
        for p in parameters
    )


def check(schedule: Schedule, num_stages: int, num_micro_batches: int) -> None:
    """Raise ``ValueError`` unless the schedule can run.

    ``len(schedule)`` is the lane count ``P``, which divides ``num_stages``; lane ``r`` holds only
    actions of the stages ``s`` with ``s % P == r``, and every stage runs, for each micro-batch,
    F then either B or I then W, once each. Across every link ``s -> s+1`` the executor matches
    messages in the order they come, so stage ``s+1`` runs its forwards in stage ``s``'s
    micro-batch order, and stage ``s`` its input gradients (B or I) in stage ``s+1``'s order.
    Last, the dependencies between stages can be met (no deadlock, checked by simulation).
    """
    per_stage = _actions_by_stage(schedule, num_stages)
    for s, actions in enumerate(per_stage):
        _check_stage(s, actions, num_micro_batches)
    _check_link_orders(per_stage)
    simulate(schedule)


def _actions_by_stage(schedule: Schedule, num_stages: int) -> list[list[Action]]:
    """Each stage's actions in the order its lane runs them; ``ValueError`` if a lane holds another's stage."""
    lanes = len(schedule)
    if lanes == 0 or num_stages % lanes:
        raise ValueError(f"schedule has {lanes} lanes (pipeline ranks), which does not divide {num_stages} stages")
    per_stage: list[list[Action]] = [[] for _ in range(num_stages)]
    for lane, actions in enumerate(schedule):
        for action in actions:
            if action is None:
                continue
            if not 0 <= action.stage < num_stages or action.stage % lanes != lane:
                mine = list(range(lane, num_stages, lanes))
                raise ValueError(f"lane {lane}'s list holds {action}, an action of another stage than {mine}")
            per_stage[action.stage].append(action)
    return per_stage


def _check_stage(s: int, actions: Sequence[Action], num_micro_batches: int) -> None:
    """``ValueError`` unless stage ``s`` runs, for each micro-batch, F then B or I then W, once each."""
    seen = [(a.kind, a.micro_batch) for a in actions]
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


def _check_link_orders(per_stage: Sequence[Sequence[Action]]) -> None:
    """``ValueError`` unless both ends of every link ``s -> s+1`` exchange their messages in the same order."""

    def order(stage: int, kinds: tuple[ActionKind, ...]) -> list[int]:
        return micro_batch_order(per_stage[stage], stage, kinds)

    for s in range(len(per_stage) - 1):
        sent, received = order(s, (F,)), order(s + 1, (F,))
        if sent != received:
            raise ValueError(
                f"stage {s} sends its activations in micro-batch order {sent} but stage {s + 1} runs its forwards "
                f"in order {received}; the executor matches messages in order, so they must agree"
            )
        sent, received = order(s + 1, GRADIENT_KINDS), order(s, GRADIENT_KINDS)
        if sent != received:
            raise ValueError(
                f"stage {s + 1} sends its input gradients (B or I) in micro-batch order {sent} but stage {s} runs "
                f"its B or I in order {received}; the executor matches messages in order, so they must agree"
            )


def micro_batch_order(actions: Iterable[Action | None], stage: int, kinds: tuple[ActionKind, ...]) -> list[int]:
    """The micro-batches of ``stage``'s actions of ``kinds``, in the order ``actions`` lists them."""
    return [a.micro_batch for a in actions if a is not None and a.stage == stage and a.kind in kinds]


def one_stream_per_pair(schedule: Schedule) -> bool:
    """Whether, between every two ranks and in each direction, the messages of all the links (activations
    and input gradients of every stage pair the two ranks hold) are received in the order they are sent.

    Then one communicator can carry every link, as with one stage per rank; else each link needs its own.
    Every built-in schedule, Interleaved1F1B included, has one stream per pair.
    """
    lanes = len(schedule)
    actions = [[a for a in lane if a is not None] for lane in schedule]
    stages = 1 + max((a.stage for lane in actions for a in lane), default=0)

    def messages(lane: int, sender: bool) -> dict[int, list[tuple[str, int, int]]]:
        """Per other lane, what ``lane`` sends to it (``sender``) or receives from it, in ``lane``'s order."""
        found: dict[int, list[tuple[str, int, int]]] = {}
        for a in actions[lane]:
            ahead = a.stage + 1 < stages
            if a.kind is F and (a.stage > 0 if not sender else ahead):
                peer_stage = a.stage + 1 if sender else a.stage - 1
                link = a.stage if sender else a.stage - 1
                found.setdefault(peer_stage % lanes, []).append(("activation", link, a.micro_batch))
            elif a.kind in GRADIENT_KINDS and (a.stage > 0 if sender else ahead):
                peer_stage = a.stage - 1 if sender else a.stage + 1
                link = a.stage - 1 if sender else a.stage
                found.setdefault(peer_stage % lanes, []).append(("gradient", link, a.micro_batch))
        return found

    sent = [messages(lane, sender=True) for lane in range(lanes)]
    received = [messages(lane, sender=False) for lane in range(lanes)]
    return all(sent[a].get(b, []) == received[b].get(a, []) for a in range(lanes) for b in range(lanes) if a != b)


@dataclass(frozen=True)
class Event:
    """One action placed in time (by the simulator, or measured in a real run)."""

    action: Action
    start: float
    end: float


def timeline(schedule: Schedule, forward_cost: float = 1.0, backward_cost: float = 2.0) -> list[Event]:
    """When every action of ``schedule`` runs, given its cost and what it waits for; a deadlock raises.

    Each lane keeps its own clock. ``forward_cost`` and ``backward_cost`` are those of a whole
    rank's share of the model: with ``v = S / lanes`` stages per rank (``S`` = 1 + the highest
    stage in the schedule) each action costs ``1/v`` of them, so a schedule with several stages
    per rank compares with one with a stage per rank at the same total work. I and W each cost
    half a backward.
    """
    queues = [[a for a in actions if a is not None] for actions in schedule]
    if not any(queues):
        return []
    lanes = len(queues)
    stages = 1 + max(a.stage for queue in queues for a in queue)
    share = lanes / stages
    cost = {F: forward_cost * share, B: backward_cost * share, I: backward_cost * share / 2}
    cost[W] = cost[I]
    done: dict[tuple[int, str, int], float] = {}
    position = [0] * lanes
    clock = [0.0] * lanes
    events = []
    while any(position[r] < len(queues[r]) for r in range(lanes)):
        progressed = False
        for r in range(lanes):
            if position[r] == len(queues[r]):
                continue
            action = queues[r][position[r]]
            needed = _dependency(action, stages)
            if needed is not None and needed not in done:
                continue
            start = max(clock[r], done[needed] if needed is not None else 0.0)
            clock[r] = start + cost[action.kind]
            done[_key(action)] = clock[r]
            events.append(Event(action, start, clock[r]))
            position[r] += 1
            progressed = True
        if not progressed:
            stuck = {r: str(queues[r][position[r]]) for r in range(lanes) if position[r] < len(queues[r])}
            raise ValueError(f"schedule deadlocks: lanes (pipeline ranks) wait on each other at {stuck}")
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
    """(makespan, bubble fraction) of ``schedule`` with the given costs per rank's share (see ``timeline``);
    a deadlock raises."""
    events = timeline(schedule, forward_cost, backward_cost)
    return bubble(events, len(schedule))


def bubble(events: list[Event], lanes: int) -> tuple[float, float]:
    """(makespan, idle fraction) of a timeline, simulated or measured, over ``lanes`` pipeline ranks.

    ``lanes`` is the number of ranks along the pipeline (``S // stages_per_rank``; the number
    of stages with one stage per rank): the idle fraction is of ``lanes x makespan``.
    """
    begin = min(event.start for event in events)
    makespan = max(event.end for event in events) - begin
    busy = sum(event.end - event.start for event in events)
    return makespan, 1.0 - busy / (lanes * makespan)


def peak_in_flight(actions: Sequence[Action | None]) -> int:
    """Most micro-batch activations one lane holds at once (from F until B or W), counted over all its stages.

    With several stages per rank each counted activation is one stage's, ``1/v`` of the rank's share.
    """
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
