"""The communicators data parallelism needs on this rank, made once per ``epl.parallelize``.

Every process makes them in the same order (torch.distributed creates groups
collectively), from the Plan alone, so they agree without talking.
"""

from __future__ import annotations

from dataclasses import dataclass

from epl.plugin_api import Communicator, Copies, ParallelContext, communicators_for, every_copy_group
from epl_comm.settings import CommSettings


@dataclass(frozen=True)
class DataParallelGroups:
    """This rank's data-parallel communicators and its place in its replica.

    ``copies`` maps each group of devices holding copies of some of this rank's
    tensors to ``communication.num_communicators`` communicators over it (used in
    turn for gradient buckets); ``replica`` spans the devices of this rank's
    replica that split the replica batch ``num_shards`` ways (None when they do not
    split it), and this rank takes part ``shard_index``.
    """

    copies: dict[tuple[int, ...], list[Communicator]]
    replica: Communicator | None
    shard_index: int
    num_shards: int

    def communicators(self, copies: Copies) -> list[Communicator]:
        """The communicators over the devices of ``copies``."""
        return self.copies[copies.devices]


def groups_for(context: ParallelContext) -> DataParallelGroups:
    """The data-parallel groups of ``context``, made on first use and shared by all hooks."""
    cached = context.state(_MadeGroups)
    if cached.groups is None:
        cached.groups = _make_groups(context)
    return cached.groups


@dataclass
class _MadeGroups:
    """epl-comm's state in a ParallelContext: its groups, once made."""

    groups: DataParallelGroups | None = None


def _make_groups(context: ParallelContext) -> DataParallelGroups:
    plan, world = context.plan, context.communicator
    copies = {group: [communicator] for group, communicator in context.copy_communicators().items()}
    for _ in range(CommSettings.from_config(context.config).communication.num_communicators - 1):
        for group, communicator in communicators_for(world, every_copy_group(plan)).items():
            copies[group].append(communicator)
    replica_groups = [plan.devices(tg.index, r) for tg in plan.taskgraphs for r in range(plan.num_replicas)]
    replica = communicators_for(world, replica_groups).get(
        tuple(sorted(plan.devices(plan.taskgraphs_on(context.cluster.rank)[0], context.replica_index)))
    )
    first, position = plan.assignment(context.cluster.rank).taskgraphs[0]
    parts = plan.batch_parts(first)
    return DataParallelGroups(
        copies=copies,
        # Devices that do not split the batch (a split-only replica) compute the same loss: nothing to average;
        # context devices each compute their tokens' share of it.
        replica=replica if replica is not None and (parts > 1 or plan.context_degree > 1) else None,
        shard_index=position,
        num_shards=parts,
    )
