"""Tensor-parallel ``nn.Linear``: column-parallel (output features sharded) and row-parallel (input features)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from epl.interfaces.split_rule import ShardContext, ShardRole
from epl.sharding import collectives as C
from epl.sharding.parameters import sharded_parameter


class ColumnParallelLinear(nn.Module):
    """This device's rows of a Linear's weight (its share of the output features, uneven allowed).

    The input must be whole on every device (or, with a batch split over the devices,
    each device's rows, which are gathered first). The output is this device's
    features when ``role`` is ``column`` (a row-parallel layer follows) or ``logits``
    (a parallel loss follows, while autograd records; ``Engine.predict`` gets whole
    logits); otherwise the features of every device are gathered.
    """

    def __init__(self, linear: nn.Linear, shard: ShardContext) -> None:
        super().__init__()
        self.group = shard.group
        self.role: ShardRole = shard.role
        self.group.require(linear.out_features, f"{shard.name}: the output features of nn.Linear")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.sizes = self.group.sizes(linear.out_features)
        self.weight = sharded_parameter(linear.weight, group=self.group, dim=0)
        self.bias = sharded_parameter(linear.bias, group=self.group, dim=0) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This device's output features (``column``/``logits``) or all of them (``alone``)."""
        group = self.group
        x = C.gather_rows(x, group) if group.batch_split else C.copy_to_shards(x, group)
        y = F.linear(x, self.weight, self.bias)
        keep_sharded = self.role == "column" or (self.role == "logits" and torch.is_grad_enabled())
        if keep_sharded:
            return y
        y = C.gather_from_shards(y, group, -1, self.sizes)
        return C.scatter_rows(y, group) if group.batch_split else y

    def extra_repr(self) -> str:
        """What ``print(model)`` shows of this layer."""
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(shard {self.group.index} of {self.group.count}: {self.sizes[self.group.index]}), role={self.role}"
        )


class RowParallelLinear(nn.Module):
    """This device's columns of a Linear's weight: its share of the input features, which arrive sharded.

    The partial products are summed over the devices (each device's rows only, with
    a batch split over the devices); the bias, whole on every device, is added after.
    """

    def __init__(self, linear: nn.Linear, shard: ShardContext) -> None:
        super().__init__()
        self.group = shard.group
        self.group.require(linear.in_features, f"{shard.name}: the input features of nn.Linear")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = sharded_parameter(linear.weight, group=self.group, dim=1)
        self.bias = (
            nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
            if linear.bias is not None
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The whole output (this device's rows of it when the batch is split over the devices)."""
        partial = F.linear(x, self.weight)
        group = self.group
        y = C.reduce_scatter_rows(partial, group) if group.batch_split else C.reduce_from_shards(partial, group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        """What ``print(model)`` shows of this layer."""
        size = self.weight.shape[1]
        return (
            f"in_features={self.in_features} (shard {self.group.index} of {self.group.count}: {size}), "
            f"out_features={self.out_features}"
        )


def shard_linear(module: nn.Linear, shard: ShardContext) -> nn.Module:
    """The split rule for ``nn.Linear``: row-parallel as the second of a pair, column-parallel otherwise."""
    if shard.role == "row":
        return RowParallelLinear(module, shard)
    return ColumnParallelLinear(module, shard)
