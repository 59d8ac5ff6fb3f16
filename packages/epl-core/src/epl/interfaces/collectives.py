"""Helpers built on the :class:`~epl.interfaces.communicator.Communicator` protocol alone.

``broadcast_tensors`` gives every member one member's values of some tensors;
``communicators_for`` makes communicators for any family of rank groups, even
overlapping ones, with ``Communicator.split``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from epl.interfaces.communicator import Communicator

#: A group of global ranks, sorted.
Group = tuple[int, ...]


def broadcast_tensors(tensors: Iterable[torch.Tensor], communicator: Communicator, src: int = 0) -> None:
    """Copy member ``src``'s values of ``tensors`` into every member's (one flat broadcast per dtype).

    Every member calls it with the same tensors in the same order (shapes and dtypes alike).
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        if tensor.numel():
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
    with torch.no_grad():
        for group in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            communicator.broadcast(flat, src=src).wait()
            if communicator.rank != src:
                for tensor, piece in zip(group, flat.split([t.numel() for t in group]), strict=True):
                    tensor.copy_(piece.view_as(tensor))


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
