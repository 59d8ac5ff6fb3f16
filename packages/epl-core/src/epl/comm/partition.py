"""Communicators for any family of rank groups, even overlapping ones, made with ``Communicator.split``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from epl.comm.protocol import Communicator

if TYPE_CHECKING:
    from epl.engine.extensions import ParallelContext

Group = tuple[int, ...]


def communicators_for(world: Communicator, groups: Sequence[Sequence[int]]) -> dict[Group, Communicator]:
    """This rank's communicator for each of ``groups`` (global ranks) that contains it.

    Every rank of ``world`` must call this with the same groups in the same order.
    Groups are deduplicated and packed into rounds of disjoint groups; each round is
    one ``world.split`` in which the ranks outside every group of the round stand
    alone. Overlapping groups (a rank that is in a replicate group and a shard
    group) therefore get independent communicators.
    """
    me = world.ranks[world.rank]
    rounds: list[list[Group]] = []
    for group in dict.fromkeys(tuple(sorted(g)) for g in groups):
        for round_ in rounds:
            if not any(set(group) & set(other) for other in round_):
                round_.append(group)
                break
        else:
            rounds.append([group])
    mine: dict[Group, Communicator] = {}
    for round_ in rounds:
        covered = {rank for group in round_ for rank in group}
        communicator = world.split([*round_, *((rank,) for rank in world.ranks if rank not in covered)])
        for group in round_:
            if me in group:
                mine[group] = communicator
    return mine


#: Key of :func:`copy_communicators`' result in ``ParallelContext.extras``.
COPIES_KEY = "epl-core/copy-communicators"


def copy_communicators(context: ParallelContext) -> dict[Group, Communicator]:
    """This rank's communicator over each group of devices that hold copies of some tensors.

    Made once per ``epl.parallelize`` (on first use, on every rank in the same order) and
    shared by the plugins that need them: data-parallel reduction, ZeRO.
    """
    from epl.placement.copies import every_copy_group

    cached = context.extras.get(COPIES_KEY)
    if cached is None:
        cached = context.extras[COPIES_KEY] = communicators_for(context.communicator, every_copy_group(context.plan))
    return cached
