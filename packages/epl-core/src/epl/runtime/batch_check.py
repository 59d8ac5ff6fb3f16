"""The ranks of one replica were given the same batch: a fingerprint of it compared every step.

Under ``epl.split`` and pipelines every rank of a replica passes the replica's whole batch to
``Engine.step``: the ranks compute parts of one model on it (the first stage reads the inputs,
the last the targets). A script ported from DDP whose sampler is keyed by the global rank gives
each rank its own batch instead; each rank then computes a part of a mixture of batches, and the
run trains on with no error. Before each step, the ranks of a replica gather a fingerprint of
what they were given (:func:`fingerprint`: shapes, and sums of up to :data:`SAMPLED` evenly strided
elements of each tensor, in float64) and compare them; a difference
is a :class:`BatchMismatchError` on every rank of the replica, naming the ranks, before anything
is computed. Identical batches give identical fingerprints bit for bit; two batches drawn apart
differ in nearly every element, so the sampled elements tell them apart.

Replicas whose devices split the batch among themselves (a ``replicate(k)`` TaskGraph, split
colocated with replicate) pass each its own rows and are not checked. ``io.check_batches``
switches the check off. The cost is one all-gather of five numbers per step (about 1% of a step of
the split benchmark's model at most: docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

import torch

from epl.errors import BatchMismatchError
from epl.interfaces.collectives import communicators_for
from epl.interfaces.communicator import Communicator
from epl.placement.plan import Plan
from epl.runtime.batch import tensors_in

#: At most this many elements of each tensor enter the fingerprint (evenly strided over it).
SAMPLED = 4096


class BatchCheck:
    """Compares a fingerprint of each step's batch over the ranks of this rank's replica (``communicator``)."""

    def __init__(self, communicator: Communicator, replica: int) -> None:
        self.communicator = communicator
        self.replica = replica

    def __call__(self, inputs: Any, targets: Any, step: int) -> None:
        """Raise :class:`BatchMismatchError` unless every rank of the replica passed the same ``inputs`` and
        ``targets`` to its ``step``-th step (a collective over the replica)."""
        mine = fingerprint((inputs, targets))
        size = self.communicator.world_size
        gathered = torch.zeros(size * mine.numel(), dtype=torch.float64)
        self.communicator.all_gather(gathered, mine).wait()
        rows = gathered.view(size, mine.numel())
        differ = [
            rank for rank, row in zip(self.communicator.ranks, rows, strict=True) if not torch.equal(row, rows[0])
        ]
        if differ:
            ranks = self.communicator.ranks
            raise BatchMismatchError(
                f"The ranks of replica {self.replica} (ranks {list(ranks)}) were given different batches at step "
                f"{step}: ranks {differ} differ from rank {ranks[0]}. Every rank of a replica must pass the "
                "replica's same batch to engine.step (they compute parts of one model on it). A sampler keyed by "
                "the global rank (DistributedSampler(rank=dist.get_rank()), as a DDP script has) does this: use "
                "epl.io.data_loader(dataset, engine, ...), or a sampler with num_replicas=engine.num_replicas and "
                "rank=engine.replica_index. Set io.check_batches=False to skip this check."
            )


def fingerprint(batch: Any) -> torch.Tensor:
    """Five float64 numbers that equal, bit for bit, those of an equal ``batch``: its number of tensors, and over
    its tensors (the i-th weighted by i) their elements, a hash of their shapes, the sum of up to :data:`SAMPLED`
    evenly strided elements and the same elements weighted by position."""
    tensors = tensors_in(batch)
    total = torch.zeros(5, dtype=torch.float64)
    total[0] = len(tensors)
    for index, tensor in enumerate(tensors, start=1):
        flat = tensor.detach().reshape(-1)
        sampled = flat[:: max(1, flat.numel() // SAMPLED)][:SAMPLED].to(torch.float64)
        weights = torch.arange(1, sampled.numel() + 1, dtype=torch.float64, device=sampled.device)
        sums = torch.stack([sampled.sum(), (sampled * weights).sum()]).cpu()
        shape = float(hash(tuple(tensor.shape)) % 1_000_003)
        total += index * torch.tensor([0.0, flat.numel(), shape, float(sums[0]), float(sums[1])], dtype=torch.float64)
    return total


def batch_check(plan: Plan, world: Communicator, rank: int, enabled: bool) -> BatchCheck | None:
    """The check for ``rank``'s replica, or None where it has one device or its devices split the batch.

    Every rank calls it with the same plan (it makes one communicator per replica).
    """
    whole = all(plan.batch_parts(tg.index) == 1 for tg in plan.taskgraphs)
    if not enabled or plan.local or plan.devices_per_replica < 2 or not whole:
        return None
    groups = [plan.devices_of_replica(replica) for replica in range(plan.num_replicas)]
    communicators = communicators_for(world, groups)
    replica = plan.replica_of(rank)
    return BatchCheck(communicators[tuple(sorted(plan.devices_of_replica(replica)))], replica)
