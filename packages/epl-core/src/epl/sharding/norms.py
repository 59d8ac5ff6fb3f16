"""The global gradient norm of a model whose parameters may be shards: each tensor counted once.

A shard's squares are summed over its shard group (one all-reduce per group); a
tensor every device of a group holds whole (a norm's weight, a row-parallel bias)
is counted once, from this device's copy, as is every tensor outside split scopes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from epl.interfaces.communicator import ReduceOp
from epl.sharding.parameters import shard_spec


def total_grad_norm(parameters: Iterable[nn.Parameter]) -> torch.Tensor:
    """The 2-norm of the whole model's gradient (a collective over every shard group the parameters belong to)."""
    grads_by_group: dict[int, list[torch.Tensor]] = {}
    groups = {}
    whole: list[torch.Tensor] = []
    for param in parameters:
        if param.grad is None:
            continue
        spec = shard_spec(param)
        if spec is None:
            whole.append(param.grad)
        else:
            grads_by_group.setdefault(id(spec.group), []).append(param.grad)
            groups[id(spec.group)] = spec.group
    device = next((g.device for g in whole), None) or next((g[0].device for g in grads_by_group.values()), None)
    total = torch.zeros((), dtype=torch.float64, device=device)
    if whole:
        total += _sum_of_squares(whole)
    for key, grads in grads_by_group.items():
        shard_squares = _sum_of_squares(grads).reshape(1)
        groups[key].communicator.all_reduce(shard_squares, ReduceOp.SUM).wait()
        total += shard_squares[0]
    return total.sqrt()


def _sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    norms = torch._foreach_norm(grads, 2.0)
    return torch.stack([n.double() for n in norms]).square().sum()


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale the gradients so that their global norm is at most ``max_norm``; return the norm before clipping.

    As ``torch.nn.utils.clip_grad_norm_`` (2-norm, coefficient ``max_norm / (norm + 1e-6)``
    clamped to 1), with each shard and each replicated tensor counted once.
    """
    params = [p for p in parameters if p.grad is not None]
    if not any(shard_spec(p) is not None for p in params):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)  # exactly PyTorch's when nothing is sharded
    norm = total_grad_norm(params)
    coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    grads = [p.grad for p in params]
    if grads:
        torch._foreach_mul_(grads, coefficient.to(grads[0].dtype))
    return norm
