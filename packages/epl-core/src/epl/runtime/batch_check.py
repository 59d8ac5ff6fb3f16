"""The ranks of one replica were given the same batch: a fingerprint of it compared before the step runs.

Under ``epl.split`` and pipelines every rank of a replica passes the replica's whole batch to
``Engine.step``: the ranks compute parts of one model on it (the first stage reads the inputs,
the last the targets). A script ported from DDP whose sampler is keyed by the global rank gives
each rank its own batch instead; each rank then computes a part of a mixture of batches, and the
run trains on with no error. When the check is due, the ranks of a replica all-gather a fingerprint
of what they were given (:func:`fingerprint`: the number of tensors, their shapes, and sums of up to
:data:`SAMPLED` evenly strided elements of each, in float64; always :data:`FINGERPRINT` numbers, so that
the gather itself never mismatches) and compare it before the step's forward: a difference is a
:class:`~epl.errors.BatchMismatchError` on every rank of the replica, naming the ranks (and each rank's
shapes when those differ), and nothing of the step runs. The shapes have to be compared before the
forward: the forward's first collective over tensors of different sizes is not an error but a crash
(gloo aborts the process: ``op.preamble.length <= op.nbytes``).

Each of the first :data:`FIRST_STEPS` steps is checked, then every ``io.check_batches_every``-th (50 by
default; 1 checks every step): one small all-gather costs about as much as a small step's collective, and a
loader keyed by the global rank differs from its first batch. Measured on the split MLP benchmark's step
(512-2048-512, batch 64, 2 processes on 2 shared cores, 15 rounds of 20 steps, medians): 9.23 ms unchecked;
checked every step, 10.37 ms with the gather waited for before the forward (this design), 9.73 ms with it
overlapping the forward and read before the update (the earlier one, which let gloo abort on batches of
different sizes). By default that is 1.1 ms on 1 step in 50 after the first 10: about 0.25 %. Gathering the
shapes alone on every step, to catch sizes that change only after the first steps, would cost 0.77 ms a step
(8 %), so the other steps compare nothing. Identical batches give identical fingerprints bit for bit
(compared as bits, so a NaN in both matches); two batches drawn apart differ in nearly every element, so the
sampled elements tell them apart.

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
from epl.interfaces.communicator import Communicator
from epl.placement.plan import Plan
from epl.runtime.batch import tensors_in

#: At most this many elements of each tensor enter the fingerprint (evenly strided over it).
SAMPLED = 4096
#: Every one of the first steps is checked (a loader keyed by the global rank differs from the first batch on);
#: then every ``io.check_batches_every``-th.
FIRST_STEPS = 10
#: The shapes of this many of a batch's first tensors are in the fingerprint, this many dimensions of each (the
#: others' shapes only in a hash of all shapes); they name the sizes in the error.
SHOWN_TENSORS, SHOWN_DIMS = 2, 4
#: Numbers in every fingerprint: tensors, the hash of the shapes, the shown shapes, sampled elements, two sums.
#: Few enough that a 4-rank replica gathers under 64 (``benchmarks/collectives.py`` tells them apart by that).
FINGERPRINT = 2 + SHOWN_TENSORS * SHOWN_DIMS + 3


class BatchCheck:
    """Compares a fingerprint of each step's batch over the ranks of this rank's replica (``communicator``).

    :meth:`start`, when the step begins, gathers every rank's fingerprint and raises on a difference, before
    the step's forward (whose collectives would crash on tensors of different sizes).
    """

    def __init__(self, communicator: Communicator, replica: int, every: int = 1) -> None:
        self.communicator = communicator
        self.replica = replica
        #: After the first :data:`FIRST_STEPS` steps, every how many steps the batch is checked.
        self.every = every

    def due(self, step: int) -> bool:
        """Whether step ``step`` (counted from 1) is checked: each of the first steps, then every ``every``-th."""
        return step <= FIRST_STEPS or step % self.every == 0

    def start(self, inputs: Any, targets: Any, step: int) -> None:
        """Gather every rank's fingerprint of ``inputs`` and ``targets`` (a collective over the replica) and raise
        :class:`BatchMismatchError` on every rank unless all are equal."""
        mine = fingerprint((inputs, targets))
        gathered = torch.empty(self.communicator.world_size * mine.numel(), dtype=torch.float64)
        self.communicator.all_gather(gathered, mine).wait()
        rows = gathered.view(self.communicator.world_size, -1)
        ranks = list(self.communicator.ranks)
        bits = rows.view(torch.int64)  # bit for bit: a NaN equals the same NaN
        differ = [rank for rank, row in zip(ranks, bits, strict=True) if not torch.equal(row, bits[0])]
        if not differ:
            return
        fix = (
            "Every rank of a replica must pass the replica's same batch to engine.step (they compute parts of one "
            "model on it); the step was not run. A sampler keyed by the global rank (DistributedSampler(rank="
            "dist.get_rank()), as a DDP script has) does this: use epl.io.data_loader(dataset, batch_size, engine, "
            "...), or a sampler with num_replicas=engine.num_replicas and rank=engine.replica_index. Set "
            "io.check_batches=False to skip this check."
        )
        shapes = [_shapes(row) for row in rows]
        if any(shape != shapes[0] for shape in shapes):
            sizes = "; ".join(f"rank {rank}: {shape}" for rank, shape in zip(ranks, shapes, strict=True))
            raise BatchMismatchError(
                f"The ranks of replica {self.replica} (ranks {ranks}) were given batches of different sizes at step "
                f"{step} ({sizes}): ranks {differ} differ from rank {ranks[0]}. {fix}"
            )
        raise BatchMismatchError(
            f"The ranks of replica {self.replica} (ranks {ranks}) were given different batches at step {step}: "
            f"ranks {differ} differ from rank {ranks[0]}. {fix}"
        )


def fingerprint(batch: Any) -> torch.Tensor:
    """:data:`FINGERPRINT` float64 numbers that equal, bit for bit, those of an equal ``batch``: its number of
    tensors, a hash of their shapes, the shapes of the first :data:`SHOWN_TENSORS` (-1 where a dimension or a
    tensor is absent), how many elements were sampled, and the sum of up to :data:`SAMPLED` evenly strided
    elements of each tensor and of the same elements weighted by position (one product with cached weights)."""
    tensors = list(tensors_in(batch))
    shapes = tuple(tuple(int(size) for size in tensor.shape) for tensor in tensors)
    shown = [-1.0] * (SHOWN_TENSORS * SHOWN_DIMS)
    for index, shape in enumerate(shapes[:SHOWN_TENSORS]):
        for dim, size in enumerate(shape[:SHOWN_DIMS]):
            shown[index * SHOWN_DIMS + dim] = float(size)
    samples = []
    for tensor in tensors:
        flat = tensor.detach().reshape(-1)
        samples.append(flat[:: max(1, flat.numel() // SAMPLED)][:SAMPLED].to(torch.float64))
    sampled = sum(sample.numel() for sample in samples)
    header = [float(len(tensors)), float(hash(shapes) % 2**52), *shown, float(sampled)]
    if not sampled:
        return torch.tensor([*header, 0.0, 0.0], dtype=torch.float64)
    joined = torch.cat([sample.to(samples[0].device) for sample in samples])  # inputs and targets may differ in device
    weights = _weights(joined.numel(), joined.device)
    sums = (joined @ weights).cpu()
    return torch.cat([torch.tensor(header, dtype=torch.float64), sums])


def _shapes(row: torch.Tensor) -> str:
    """The shapes a gathered fingerprint shows, as the error names them (``"[4, 8], [4, 8]"``)."""
    count = int(row[0])
    shown = row[2 : 2 + SHOWN_TENSORS * SHOWN_DIMS].view(SHOWN_TENSORS, SHOWN_DIMS)
    parts = [str([int(size) for size in dims if size >= 0]) for dims in shown[: min(count, SHOWN_TENSORS)]]
    if count > SHOWN_TENSORS:
        parts.append(f"and {count - SHOWN_TENSORS} more tensors (shape hash {int(row[1])})")
    return ", ".join(parts) if parts else "no tensors"


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
