"""The communicators data parallelism needs on this rank, made once per ``epl.parallelize``.

Every process makes them in the same order (torch.distributed creates groups
collectively), from the Plan alone, so they agree without talking.
"""

from __future__ import annotations

from dataclasses import dataclass

from epl.comm.protocol import Communicator
from epl.engine.extensions import ParallelContext
from epl.errors import MissingPluginError

PLUGIN = "epl-comm"


@dataclass(frozen=True)
class DataParallelGroups:
    """This rank's data-parallel communicators and its place in its replica.

    ``copies`` spans every copy of this rank's TaskGraphs (all replicas, and the k
    devices of a ``replicate(k)``); ``reducers`` are ``communication.num_communicators``
    communicators over the same ranks, used in turn for gradient buckets; ``replica``
    spans the k devices of this replica's ``replicate(k)`` (None when k is 1).
    """

    copies: Communicator
    reducers: list[Communicator]
    replica: Communicator | None
    shard_index: int
    num_shards: int

    @property
    def num_copies(self) -> int:
        """How many copies of each parameter are reduced together."""
        return self.copies.world_size


def groups_for(context: ParallelContext) -> DataParallelGroups:
    """The data-parallel groups of ``context``, made on first use and shared by all hooks."""
    cached = context.extras.get(PLUGIN)
    if cached is None:
        cached = context.extras[PLUGIN] = _make_groups(context)
    return cached


def _make_groups(context: ParallelContext) -> DataParallelGroups:
    plan, world = context.plan, context.communicator
    mine = plan.assignment(context.cluster.rank).taskgraphs
    split = [plan.taskgraphs[i].name for i, _ in mine if plan.taskgraphs[i].strategy == "split"]
    if split:
        raise MissingPluginError(
            f"TaskGraph {split[0]!r} is split over several processes, and the installed packages have no "
            "split support yet (it comes with the split rules). Run it in one process for now."
        )
    copy_groups = sorted({tuple(sorted(plan.devices(tg.index))) for tg in plan.taskgraphs})
    copies = world.split(copy_groups)
    reducers = [copies] + [
        world.split(copy_groups) for _ in range(context.config["communication.num_communicators"] - 1)
    ]
    replica = None
    if any(tg.device_count > 1 for tg in plan.taskgraphs):
        replica_groups = sorted(
            {tuple(sorted(plan.devices(tg.index, r))) for tg in plan.taskgraphs for r in range(plan.num_replicas)}
        )
        replica = world.split(replica_groups)
    first, position = mine[0]
    return DataParallelGroups(
        copies=copies,
        reducers=reducers,
        replica=replica if replica is not None and replica.world_size > 1 else None,
        shard_index=position,
        num_shards=plan.taskgraphs[first].device_count,
    )
