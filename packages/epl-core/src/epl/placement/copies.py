"""Which devices hold copies of a tensor, and over how many losses its gradient is summed.

Data parallelism reduces a parameter's gradient over its copies: a ``replicate``
TaskGraph's tensors over every device that runs it (all replicas, and the k devices
of a ``replicate(k)``); a split shard over the same shard of the other replicas; a
tensor several TaskGraphs share (tied weights across pipeline stages) over every
owner's copies. Under context parallelism every lane of a replica counts as a replica
here: each device's loss is its lane's estimate of the replica's loss, so the mean over
data x context devices is the replica mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from epl.placement.plan import Plan


@dataclass(frozen=True)
class Copies:
    """The devices holding copies of some tensors, and the mean's divisor for their gradients.

    The divisor is the number of device losses the gradient sums over. It exceeds the
    number of devices for a split shard whose devices also split the batch: each
    shard's gradient already sums over the losses of the devices sharing it.
    """

    devices: tuple[int, ...]
    divisor: int


def copies_of(plan: Plan, taskgraph: int, device: int, *, sharded: bool) -> Copies:
    """The copies of a tensor of ``taskgraph`` held by ``device`` (``sharded``: a split rule's shard)."""
    spec = plan.taskgraphs[taskgraph]
    parts = plan.batch_parts(taskgraph)
    if spec.strategy == "split" and (sharded or parts == 1):
        _, slot = plan.locate(device)
        devices = tuple(plan.device_of(lane, slot) for lane in range(plan.num_lanes))
        return Copies(devices, plan.num_lanes * parts)
    devices = tuple(sorted(plan.devices(taskgraph)))
    return Copies(devices, len(devices))


def copies_of_shared(plan: Plan, taskgraphs: tuple[int, ...], device: int, *, sharded: bool = False) -> Copies:
    """The copies of a tensor that several TaskGraphs hold (tied weights across pipeline stages).

    Every owner's copies count, at ``device``'s position in each owner: their gradients are
    summed over the owners (each holds part of the replica's gradient, as Megatron sums the
    tied embedding's between the first and last stage) and averaged over the replicas, in one
    reduction. The divisor is one owner's. ``sharded``: a split rule's shard (split stages of one
    width shard the tied tensor alike, so the device at the same position holds the same shard).
    """
    lane, slot = plan.locate(device)
    own = next(tg for tg in taskgraphs if slot in plan.slots[tg])
    position = plan.slots[own].index(slot)
    devices: set[int] = set()
    for taskgraph in taskgraphs:
        peer = plan.device_of(lane, plan.slots[taskgraph][position])
        devices.update(copies_of(plan, taskgraph, peer, sharded=sharded).devices)
    return Copies(tuple(sorted(devices)), copies_of(plan, own, device, sharded=sharded).divisor)


def every_copy_group(plan: Plan) -> list[tuple[int, ...]]:
    """The device groups of every tensor of every device, in the same order on every rank."""
    groups: dict[tuple[int, ...], None] = {}
    for spec in plan.taskgraphs:
        for device in plan.devices(spec.index):
            for sharded in (False, True):
                groups[copies_of(plan, spec.index, device, sharded=sharded).devices] = None
    for owners in plan.shared:
        for device in sorted({d for tg in owners for d in plan.devices(tg)}):
            for sharded in (False, True):
                groups[copies_of_shared(plan, owners, device, sharded=sharded).devices] = None
    return list(groups)
