"""Where a pipeline rank's stages stand: its links to the neighbouring stages, its groups, its shares of the batch.

:class:`PipelineTopology` is what the pipeline runner is told of the job's layout around this rank, built once from
the :class:`~epl.plugin_api.ParallelContext` (:meth:`PipelineTopology.from_context`); the runner itself only runs
the schedule over it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from epl.plugin_api import Communicator
from epl_pipeline.resharding import Boundary

if TYPE_CHECKING:
    from epl.plugin_api import ParallelContext, Schedule
    from epl_pipeline.resharding import StageShape


@dataclass(frozen=True)
class Link:
    """The way to a neighbouring stage's device: a communicator, and that device's member index in it; and the
    communicator over the same ranks that carries the gradients going the other way, when not the same one."""

    communicator: Communicator
    peer: int
    gradients: Communicator | None = None


#: The way to a neighbouring stage: one device (stages that run the micro-batch alike), or the devices that
#: hold this device's rows (stages that share it out differently).
StageLink = Link | Boundary


@dataclass(frozen=True)
class PipelineTopology:
    """This rank's place in the pipeline: its stages, the ways to their neighbours, the groups it meets in.

    A rank runs one stage, or several (``pipeline.stages_per_rank``: interleaved pipelines).
    """

    #: This rank's stages, in order (the first is its place along the pipeline, its lane in the schedule).
    stages: tuple[int, ...]
    #: Each of this rank's stages' way to its previous and next stage's devices (None: no such stage).
    links: Mapping[int, tuple[StageLink | None, StageLink | None]]
    #: This rank's device.
    device: torch.device
    #: Every device of this rank's replica: the step's loss is summed over it.
    replica: Communicator
    #: Every device of this rank's lane (its replica without context parallelism, every stage): the gradient
    #: norm adds their squares.
    stage_peers: Communicator
    #: How many devices run this rank's stages (their squares in the norm are divided by it).
    stage_copies: int
    #: ids of this rank's parameters tied to an earlier stage's on another rank (that rank counts them in the norm).
    counted_elsewhere: frozenset[int]
    #: Each of this rank's stages' part of every micro-batch: (index, count); (0, 1) for a stage that runs it whole.
    shares: Mapping[int, tuple[int, int]]
    #: This device's weight in the replica's mean loss: 1/parts on one device of each part of the last stage,
    #: divided over the replica's lanes; 0 elsewhere.
    loss_share: float
    #: The devices sharing the last stage's micro-batches out (``predict`` joins their parts), when they do.
    last_stage: Communicator | None
    #: Every micro-batch's rows must share out over each stage of the pipeline: a multiple of this.
    rows_multiple: int

    @classmethod
    def from_context(cls, context: ParallelContext, schedule: Schedule) -> PipelineTopology:
        """This rank's topology in ``context``'s plan, run by ``schedule``: its communicators are made here, a
        collective of every rank (each makes them in the same order)."""
        from epl_pipeline.stages import stage_shapes

        plan, rank = context.plan, context.cluster.rank
        lane = plan.lane_of(rank)
        local = context.pipeline.stages
        stages, shapes = plan.num_stages, stage_shapes(plan)
        world = context.communicator
        # Every device of a lane (a replica without context parallelism): the global gradient norm adds their
        # squares. Every device of a replica: its loss, each lane's last stage giving 1/c of it.
        lane_group = world.split([list(plan.devices_of_lane(r)) for r in range(plan.num_lanes)])
        replica_group = (
            lane_group
            if plan.context_degree == 1
            else world.split([list(plan.devices_of_replica(r)) for r in range(plan.num_replicas)])
        )
        shares = {s: shapes[s].part(plan.lane_devices(s, lane).index(rank)) for s in local}
        last, loss_share, last_stage = stages - 1, 0.0, None
        if last in local:
            loss_share = shapes[last].loss_share(plan.lane_devices(last, lane).index(rank)) / plan.context_degree
        if shapes[last].parts > 1:  # predict gathers the last stage's parts of each micro-batch
            last_stage = _group(world, [plan.lane_devices(last, r) for r in range(plan.num_lanes)])
        links = _links(context, local, schedule, shapes)
        return cls(
            stages=tuple(sorted(links)),
            links=links,
            device=context.cluster.device,
            replica=replica_group,
            stage_peers=lane_group,
            stage_copies=shapes[local[0]].width,
            counted_elsewhere=_counted_elsewhere(context, local),
            shares={stage: shares.get(stage, (0, 1)) for stage in sorted(links)},
            loss_share=loss_share,
            last_stage=last_stage,
            rows_multiple=math.lcm(*(shape.parts for shape in shapes)),
        )


def _links(
    context: ParallelContext, local: tuple[int, ...], schedule: Schedule, shapes: Sequence[StageShape]
) -> dict[int, tuple[StageLink | None, StageLink | None]]:
    """Each of this rank's stages' way to its previous and next stage: the device at this rank's position in
    the neighbouring stage when both run micro-batches alike (split stages exchange activations shard by
    shard), else a :class:`~epl_pipeline.resharding.Boundary` to the devices holding this device's rows.

    Messages between two ranks are matched in the order they come. With several stages per rank, one pair of
    ranks carries several links in one direction (stage 0 -> 1 and 2 -> 3, and 2 -> 1's gradients): the job's
    communicator carries them all when the schedule receives them in the order it sends them (every built-in
    schedule does); otherwise each link gets a communicator of its own, made by every rank in the same order
    (each is a process group more: its threads and sockets, on every rank).
    """
    from epl_pipeline.resharding import boundary
    from epl_pipeline.schedules import one_stream_per_pair

    plan, rank, world = context.plan, context.cluster.rank, context.communicator
    lane = plan.lane_of(rank)
    between = [world] * (plan.num_stages - 1)
    per_link = plan.stages_per_rank > 1 and not one_stream_per_pair(schedule)
    if per_link:
        between = [_link_communicator(context, stage) for stage in range(plan.num_stages - 1)]
    backward = between
    if gradients_apart(context.cluster.device):
        backward = (
            [_link_communicator(context, stage) for stage in range(plan.num_stages - 1)]
            if per_link
            else [world.split([list(world.ranks)])] * (plan.num_stages - 1)
        )

    def link(stage: int, to: int) -> StageLink:
        communicator = between[min(stage, to)]
        apart = backward[min(stage, to)]
        assert apart.ranks == communicator.ranks, "member indices must mean the same ranks in both directions"
        gradients = None if apart is communicator else apart
        position = plan.lane_devices(stage, lane).index(rank)
        if shapes[stage] == shapes[to]:
            peer = communicator.ranks.index(plan.lane_devices(to, lane)[position])
            return Link(communicator, peer, gradients)
        first, second = sorted((stage, to))
        first_members, second_members = (
            [communicator.ranks.index(d) for d in plan.lane_devices(s, lane)] for s in (first, second)
        )
        members = (first_members, second_members)
        return boundary(communicator, members, (shapes[first], shapes[second]), stage == first, position, gradients)

    last = plan.num_stages - 1
    return {s: (link(s, s - 1) if s > 0 else None, link(s, s + 1) if s < last else None) for s in local}


def gradients_apart(device: torch.device) -> bool:
    """Whether the gradients going back between two stages travel on a communicator of their own.

    NCCL runs the sends and receives between two ranks on one stream, each waiting for the one before it: a
    stage that posts its next gradient receive ahead of its next activation send, while its neighbour posts
    its next activation receive ahead of its gradient send, would wait forever (torch.distributed.pipelining
    batches the two for this reason). On their own communicators each direction is one ordered stream, as
    every message is under gloo, which matches each alone: the CPU keeps one communicator.
    """
    return device.type != "cpu"


def _link_communicator(context: ParallelContext, stage: int) -> Communicator:
    """This rank's communicator for the link from ``stage`` to ``stage + 1`` (its pair, or itself alone)."""
    plan, world = context.plan, context.communicator
    pairs = [
        (plan.lane_devices(stage, r)[p], plan.lane_devices(stage + 1, r)[p])
        for r in range(plan.num_lanes)
        for p in range(len(plan.slots[stage]))
    ]
    return _group(world, pairs)


def _group(world: Communicator, groups: Sequence[Sequence[int]]) -> Communicator:
    """This rank's communicator among ``groups`` (disjoint), every other rank alone (made by every rank)."""
    grouped = {rank for group in groups for rank in group}
    return world.split([*map(list, groups), *([rank] for rank in world.ranks if rank not in grouped)])


def _counted_elsewhere(context: ParallelContext, local: tuple[int, ...]) -> frozenset[int]:
    """ids of this rank's parameters whose first holding stage runs on another rank (tied weights: that rank
    counts them in the gradient norm)."""
    holders = context.tensor_holders()
    return frozenset(id(p) for p in context.model.parameters() if min(holders.get(id(p), {local[0]})) not in local)
