"""The ranks of one replica were given the same batch: a fingerprint of it compared every step.

Under ``epl.split`` and pipelines every rank of a replica passes the replica's whole batch to
``Engine.step``: the ranks compute parts of one model on it (the first stage reads the inputs,
the last the targets). A script ported from DDP whose sampler is keyed by the global rank gives
each rank its own batch instead; each rank then computes a part of a mixture of batches, and the
run trains on with no error. Each step the ranks of a replica all-gather a fingerprint of what they
were given (:func:`fingerprint`: sizes, and sums of up to :data:`SAMPLED` evenly strided elements of
each tensor, in float64), posted when the step begins and read just before the optimizer applies the
update; a difference is a :class:`~epl.errors.BatchMismatchError` on every rank of the replica, naming
the ranks, and the update is not applied. Each of the first :data:`FIRST_STEPS` steps is checked, then
every ``io.check_batches_every``-th (50 by default; 1 checks every step): one all-gather costs about
as much as a small step's collective, and a loader keyed by the global rank differs from its first
batch. Identical batches give identical fingerprints bit for bit; two batches drawn apart differ in
nearly every element, so the sampled elements tell them apart.

Replicas whose devices split the batch among themselves (a ``replicate(k)`` TaskGraph, split
colocated with replicate) pass each its own rows and are not checked. ``io.check_batches``
switches the check off. Its cost is measured in ``benchmarks/test_batch_check.py``
(docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

import torch

from epl.errors import BatchMismatchError
from epl.interfaces.collectives import communicators_for
from epl.interfaces.communicator import Communicator, Work
from epl.placement.plan import Plan
from epl.runtime.batch import tensors_in

#: At most this many elements of each tensor enter the fingerprint (evenly strided over it).
SAMPLED = 4096
#: Every one of the first steps is checked (a loader keyed by the global rank differs from the first batch on);
#: then every ``io.check_batches_every``-th.
FIRST_STEPS = 10


class BatchCheck:
    """Compares a fingerprint of each step's batch over the ranks of this rank's replica (``communicator``).

    :meth:`start` posts the all-gather when the step begins, so it travels during the forward and
    backward; :meth:`finish` reads it before the optimizer applies the update (an optimizer step
    pre-hook, :meth:`hook`), or after the step when nothing was applied.
    """

    def __init__(self, communicator: Communicator, replica: int, every: int = 1) -> None:
        self.communicator = communicator
        self.replica = replica
        #: After the first :data:`FIRST_STEPS` steps, every how many steps the batch is checked.
        self.every = every
        self._pending: tuple[Work, torch.Tensor, int] | None = None

    def due(self, step: int) -> bool:
        """Whether step ``step`` (counted from 1) is checked: each of the first steps, then every ``every``-th."""
        return step <= FIRST_STEPS or step % self.every == 0

    def start(self, inputs: Any, targets: Any, step: int) -> None:
        """Post the gather of every rank's fingerprint of ``inputs`` and ``targets`` (a collective over the
        replica)."""
        if self._pending is not None:  # a step that ended in an error: its gather still completes
            self._pending[0].wait()
        mine = fingerprint((inputs, targets))
        gathered = torch.empty(self.communicator.world_size * mine.numel(), dtype=torch.float64)
        self._pending = (self.communicator.all_gather(gathered, mine), gathered, step)

    def finish(self) -> None:
        """Raise :class:`BatchMismatchError` unless every rank of the replica passed the same batch (no-op when
        this step's fingerprints were read already)."""
        if self._pending is None:
            return
        (work, gathered, step), self._pending = self._pending, None
        work.wait()
        rows = gathered.view(self.communicator.world_size, -1)
        differ = [
            rank for rank, row in zip(self.communicator.ranks, rows, strict=True) if not torch.equal(row, rows[0])
        ]
        if differ:
            ranks = self.communicator.ranks
            raise BatchMismatchError(
                f"The ranks of replica {self.replica} (ranks {list(ranks)}) were given different batches at step "
                f"{step}: ranks {differ} differ from rank {ranks[0]}. Every rank of a replica must pass the "
                "replica's same batch to engine.step (they compute parts of one model on it); the step was not "
                "applied. A sampler keyed by the global rank (DistributedSampler(rank=dist.get_rank()), as a DDP "
                "script has) does this: use epl.io.data_loader(dataset, engine, ...), or a sampler with "
                "num_replicas=engine.num_replicas and rank=engine.replica_index. Set io.check_batches=False to "
                "skip this check."
            )

    def hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """An optimizer step pre-hook: the batch is checked before the update is applied."""
        self.finish()


def fingerprint(batch: Any) -> torch.Tensor:
    """Float64 numbers that equal, bit for bit, those of an equal ``batch``: per tensor, its number of elements,
    a hash of its shape, and the sum of up to :data:`SAMPLED` evenly strided elements and of the same elements
    weighted by position (one product with cached weights)."""
    sizes: list[float] = []
    samples = []
    for tensor in tensors_in(batch):
        flat = tensor.detach().reshape(-1)
        sampled = flat[:: max(1, flat.numel() // SAMPLED)][:SAMPLED]
        sizes += [float(flat.numel()), float(hash(tuple(tensor.shape)) % 1_000_003), float(sampled.numel())]
        samples.append(sampled.to(torch.float64))
    if not samples:
        return torch.zeros(1, dtype=torch.float64)
    joined = torch.cat([sample.to(samples[0].device) for sample in samples])  # inputs and targets may differ in device
    weights = _weights(joined.numel(), joined.device)
    sums = (joined @ weights).cpu()
    return torch.cat([torch.tensor(sizes, dtype=torch.float64), sums])


_WEIGHTS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _weights(count: int, device: torch.device) -> torch.Tensor:
    """[count, 2]: ones (the sum) and 1..count (the sum weighted by position), made once per size and device."""
    key = (count, device)
    if key not in _WEIGHTS:
        if len(_WEIGHTS) > 64:
            _WEIGHTS.clear()
        position = torch.arange(1, count + 1, dtype=torch.float64, device=device)
        _WEIGHTS[key] = torch.stack([torch.ones_like(position), position], dim=1)
    return _WEIGHTS[key]


def batch_check(
    plan: Plan, world: Communicator, rank: int, enabled: bool, every: int = 1, *, presliced: bool = False
) -> BatchCheck | None:
    """The check for ``rank``'s replica, or None where it has one device or its devices split the batch.

    Every rank calls it with the same plan (it makes one communicator per replica). ``presliced``
    (``context.presliced``): each lane of a replica is given its own share of every sequence, so each lane is
    checked alone.
    """
    whole = all(plan.batch_parts(tg.index) == 1 for tg in plan.taskgraphs)
    width = plan.lane_width if presliced else plan.devices_per_replica
    if not enabled or plan.local or width < 2 or not whole:
        return None
    if presliced and plan.context_degree > 1:
        groups = [plan.devices_of_lane(lane) for lane in range(plan.num_lanes)]
        mine = plan.devices_of_lane(plan.lane_of(rank))
    else:
        groups = [plan.devices_of_replica(replica) for replica in range(plan.num_replicas)]
        mine = plan.devices_of_replica(plan.replica_of(rank))
    return BatchCheck(communicators_for(world, groups)[tuple(sorted(mine))], plan.replica_of(rank), every)
