"""Gradient clipping by the global norm of a model whose parameters may be shards or pipeline stages.

A shard's squares are summed over its shard group (one all-reduce per group of
devices); a tensor every device of a group holds whole (a norm's weight, a
row-parallel bias, a replicated layer) is counted once, from this device's copy.
That copy must be the replica's gradient: identical on every device of the group,
which holds unless the group also splits the batch and the gradients are not yet
reduced (the split transform refuses that combination). Only the 2-norm.

A parameter ZeRO chunks over its copies (:mod:`epl.sharding.data_shards`) adds its chunk's squares, summed over
those copies first (one all-reduce per communicator of copies, carrying every tensor of it at once); the sum then
counts as the whole tensor's, or as its shard's where split cut it too.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import torch
from torch import nn

from epl.interfaces.communicator import Communicator, ReduceOp
from epl.sharding.data_shards import data_shards, local_tensor
from epl.sharding.parameters import shard_spec
from epl.torch_private import foreach_mul_, foreach_norm

#: Added to the norm before dividing, as ``torch.nn.utils.clip_grad_norm_`` does.
EPSILON = 1e-6


def total_grad_norm(
    parameters: Iterable[nn.Parameter],
    stages: Communicator | None = None,
    counted_elsewhere: Collection[int] = frozenset(),
    stage_copies: int = 1,
    *,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The 2-norm (float64) of the gradient of ``parameters``, shards summed over their groups.

    A collective over every shard group of ``parameters``: every device of a group must
    call it with the same parameters (it takes part even where a shard has no gradient).
    ``stages``: the devices of every pipeline stage of the same replica, whose squares are added;
    ``counted_elsewhere``: ids of parameters (whole or shards) another stage also holds and counts (tied weights);
    ``stage_copies``: how many members of ``stages`` hold this device's stage (its shards, or copies of it):
    each adds that share of its squares; ``device``: where the norm is computed when this device holds no gradient
    (a stage without trainable parameters, or whose gradients ZeRO keeps on other owners), so that its share of the
    ``stages`` all-reduce is on the other members' device (without it: the CPU).
    """
    params = list(parameters)
    whole: list[torch.Tensor] = []
    shards: dict[int, tuple[Communicator, torch.device, list[torch.Tensor]]] = {}
    # ZeRO's chunks, per communicator of copies: the shard communicator they belong to (None: whole) -> local grads
    chunks: dict[int, tuple[Communicator, torch.device, dict[int | None, list[torch.Tensor]]]] = {}
    for param in params:
        spec = shard_spec(param)
        copies = data_shards(param)
        if copies is not None:
            key = None
            if spec is not None:
                key = id(spec.group.communicator)
                shards.setdefault(key, (spec.group.communicator, param.device, []))
            _, _, by_shards = chunks.setdefault(id(copies.communicator), (copies.communicator, param.device, {}))
            grads = by_shards.setdefault(key, [])
            if param.grad is not None and id(param) not in counted_elsewhere:
                grads.append(local_tensor(param.grad))
            continue
        if spec is None:
            if param.grad is not None and id(param) not in counted_elsewhere:
                whole.append(param.grad)
            continue
        # Keyed by communicator: split TaskGraphs on the same devices share one all-reduce (which this device
        # joins even when another stage counts its shard: the shard of an embedding tied to the last stage's head).
        communicator = spec.group.communicator
        _, _, grads = shards.setdefault(id(communicator), (communicator, param.device, []))
        if param.grad is not None and id(param) not in counted_elsewhere:
            grads.append(param.grad)
    device = whole[0].device if whole else next((d for _, d, _ in [*shards.values(), *chunks.values()]), device)
    total = _sum_of_squares(whole, device)
    summed_chunks: dict[int, torch.Tensor] = {}
    for communicator, chunk_device, by_shards in chunks.values():  # in the order of the parameters, as below
        keys = list(by_shards)
        squares = torch.stack([_sum_of_squares(by_shards[key], chunk_device) for key in keys])
        communicator.all_reduce(squares, ReduceOp.SUM).wait()
        for key, value in zip(keys, squares, strict=True):
            if key is None:
                total = total + value.to(total.device)
            else:
                summed_chunks[key] = summed_chunks.get(key, 0) + value
    for communicator, shard_device, grads in shards.values():  # in the order of the parameters: same on every device
        squares = _sum_of_squares(grads, shard_device).reshape(1)
        if id(communicator) in summed_chunks:
            squares = squares + summed_chunks[id(communicator)].to(squares.device)
        communicator.all_reduce(squares, ReduceOp.SUM).wait()
        total = total + squares[0].to(total.device)
    if stages is not None:
        total = (total / stage_copies if stage_copies > 1 else total).reshape(1)
        stages.all_reduce(total, ReduceOp.SUM).wait()
        total = total[0]
    return total.sqrt()


def clip_grad_norm(
    parameters: Iterable[nn.Parameter],
    max_norm: float,
    stages: Communicator | None = None,
    counted_elsewhere: Collection[int] = frozenset(),
    stage_copies: int = 1,
    *,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Scale the gradients so that their global 2-norm is at most ``max_norm``; return the norm before clipping.

    As ``torch.nn.utils.clip_grad_norm_`` (coefficient ``max_norm / (norm + 1e-6)`` clamped
    to 1, non-finite norms not an error), with each shard and each tensor held whole counted
    once (see :func:`total_grad_norm`); with ``stages``, over every pipeline stage of the
    replica, tied weights (``counted_elsewhere`` on all stages but one) once, each stage once however many
    devices hold it (``stage_copies``, and ``device``: see :func:`total_grad_norm`). Without shards or
    stages it is ``clip_grad_norm_`` itself.
    """
    params = list(parameters)
    if stages is None and all(shard_spec(p) is None and data_shards(p) is None for p in params):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    norm = total_grad_norm(params, stages, counted_elsewhere, stage_copies, device=device)
    coefficient = (max_norm / (norm + EPSILON)).clamp(max=1.0)
    dense: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        grad = local_tensor(grad)
        if grad.is_sparse:
            grad.mul_(coefficient.to(grad.device, grad.dtype))
        else:
            dense.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, dtype), grads in dense.items():
        foreach_mul_(grads, coefficient.to(device, dtype))
    return norm


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device | None) -> torch.Tensor:
    """The sum of the squared entries of ``grads`` in float64 on ``device`` (norms by device and dtype, as torch)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    dense: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        if grad.is_sparse:
            total = total + torch.linalg.vector_norm(grad.coalesce().values()).double().to(device).square()
        else:
            dense.setdefault((grad.device, grad.dtype), []).append(grad)
    for group in dense.values():
        norms = torch.stack([n.to(device=device, dtype=torch.float64) for n in foreach_norm(group, 2.0)])
        total = total + norms.square().sum()
    return total
