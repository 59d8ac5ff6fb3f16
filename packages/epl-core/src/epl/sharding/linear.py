"""Tensor-parallel linear layers: column-parallel (output features sharded) and row-parallel (input features).

Both take any linear-like module: ``nn.Linear`` (weight ``[out, in]``) or a module
computing ``x @ W + b`` with ``W`` as ``[in, out]`` (GPT-2's ``Conv1D``); the shard
keeps the original orientation, so checkpoints keep the names and shapes of the model.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from epl.errors import AnnotationError
from epl.interfaces.shard_group import ShardGroup
from epl.interfaces.split_rule import ShardContext, ShardRole
from epl.sharding import collectives as C
from epl.sharding.links import tracing
from epl.sharding.logits import mark_sharded_logits
from epl.sharding.parameters import sharded_parameter


def _weight(module: nn.Module) -> torch.Tensor:
    """The ``weight`` of a linear-like module (a parameter; ``Module.__getattr__`` is typed as any member)."""
    return cast(torch.Tensor, module.weight)


def _features(module: nn.Module, shard: ShardContext) -> tuple[int, int]:
    """(in, out) features of a linear-like module."""
    weight = _weight(module)
    return (
        (weight.shape[1], weight.shape[0])
        if shard.weight_layout == "out_in"
        else cast(tuple[int, int], tuple(weight.shape))
    )


def entered(x: torch.Tensor, group: ShardGroup) -> torch.Tensor:
    """``x`` entered into the shards (copy, or gather of rows), shared by every layer reading the same ``x``.

    q, k and v (or gate and up) then cost one all-reduce of the input gradient
    backward, as Megatron-LM's fused layers do. Inside a compiled block whose collectives are traced, the cache
    holds the tensors themselves for the trace (dynamo follows them; the row layer clears it); else weak
    references, run as they are.
    """
    if tracing(group):
        gathered = group.sequence_entry
        if gathered is not None and gathered is x:
            return x
        traced = group.traced_entry
        if traced is not None and traced[0] is x:
            return cast(torch.Tensor, traced[1])
        result = C.gather_rows(x, group) if group.batch_split else C.copy_to_shards(x, group)
        group.traced_entry = (x, result)
        return result
    return _entered_eager(x, group)


@torch.compiler.disable  # a cache of weak references: run as it is under torch.compile
def _entered_eager(x: torch.Tensor, group: ShardGroup) -> torch.Tensor:
    gathered = group.sequence_entry
    if gathered is not None and gathered() is x:  # gathered along the sequence: its backward sums already
        return x
    grad = torch.is_grad_enabled()
    cached = group.entry
    if cached is not None and cached[0]() is x and cached[2] == grad:
        return cached[1]
    result = C.gather_rows(x, group) if group.batch_split else C.copy_to_shards(x, group)
    group.entry = (weakref.ref(x), result, grad)
    return result


class ColumnParallelLinear(nn.Module):
    """This device's share of a linear layer's output features (uneven allowed; by part for fused layers).

    The input must be whole on every device (or, with a batch split over the devices,
    each device's rows, which are gathered first). The output is this device's
    features when ``role`` is ``column`` (a row-parallel layer follows) or ``logits``
    (a parallel loss follows, while autograd records; ``Engine.predict`` gets whole
    logits); otherwise the features of every device are gathered.
    """

    def __init__(self, linear: nn.Module, shard: ShardContext) -> None:
        super().__init__()
        self.group = shard.group
        self.role: ShardRole = shard.role
        self.weight_layout = shard.weight_layout
        self.in_features, self.out_features = _features(linear, shard)
        self.parts = shard.parts
        part = self.out_features // shard.parts
        _check_divides(shard, part, "output features")
        self.sizes = self.group.sizes(part)
        dim = 0 if shard.weight_layout == "out_in" else 1
        self.weight = sharded_parameter(_weight(linear), group=self.group, dim=dim, parts=shard.parts)
        bias = getattr(linear, "bias", None)
        self.bias = sharded_parameter(bias, group=self.group, dim=0, parts=shard.parts) if bias is not None else None
        #: ``F.linear``, or another product of the same arguments (float8's: :mod:`epl.float8.sharded`).
        self.product: Callable[..., torch.Tensor] = F.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This device's output features (``column``/``logits``) or all of them (``alone``)."""
        group = self.group
        x = entered(x, group)
        weight = self.weight if self.weight_layout == "out_in" else self.weight.t()
        y = self.product(x, weight, self.bias)
        if self.role == "column":
            if group.random is not None:
                group.random.enter()  # dropouts of the sharded activations draw per device
            return y
        if self.role == "logits" and torch.is_grad_enabled():
            return mark_sharded_logits(y, group, self.out_features)
        sizes = [size * self.parts for size in self.sizes]
        y = C.gather_from_shards(y, group, -1, sizes)
        if self.parts > 1:
            y = torch.cat([piece for j in range(self.parts) for piece in _part_pieces(y, sizes, self.parts, j)], -1)
        return C.scatter_rows(y, group) if group.batch_split else y

    def extra_repr(self) -> str:
        """What ``print(model)`` shows of this layer."""
        parts = f", {self.parts} parts" if self.parts > 1 else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(shard {self.group.index} of {self.group.count}: {self.sizes[self.group.index] * self.parts}{parts}), "
            f"role={self.role}"
        )


def _part_pieces(y: torch.Tensor, sizes: list[int], parts: int, j: int) -> list[torch.Tensor]:
    """Part ``j`` of every device's gathered piece of a fused output, in device order."""
    return [piece.chunk(parts, -1)[j] for piece in y.split(sizes, -1)]


class RowParallelLinear(nn.Module):
    """This device's share of a linear layer's input features, which arrive sharded.

    The partial products are summed over the devices (each device's rows only, with
    a batch split over the devices); the bias, whole on every device, is added after.
    """

    def __init__(self, linear: nn.Module, shard: ShardContext) -> None:
        super().__init__()
        self.group = shard.group
        self.weight_layout = shard.weight_layout
        self.in_features, self.out_features = _features(linear, shard)
        self.group.require(self.in_features, f"{shard.name}: the input features of the linear layer")
        dim = 1 if shard.weight_layout == "out_in" else 0
        self.weight = sharded_parameter(_weight(linear), group=self.group, dim=dim)
        bias = getattr(linear, "bias", None)
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad) if bias is not None else None
        #: ``F.linear``, or another product of the same arguments (float8's: :mod:`epl.float8.sharded`).
        self.product: Callable[..., torch.Tensor] = F.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The whole output (this device's rows of it when the batch is split over the devices)."""
        group = self.group
        group.entry = group.traced_entry = None  # the region's input is no longer needed for sharing
        if group.random is not None and not group.sequence_depth:  # sequence parallel: the stack's end leaves
            group.random.leave()
        partial = self.product(x, self.weight if self.weight_layout == "out_in" else self.weight.t())
        if group.sequence_depth:  # sequence parallel: this device's tokens of the sum
            assert group.sequence_dim is not None
            y = C.reduce_scatter_rows(partial, group, group.sequence_dim)
        elif group.batch_split:
            y = C.reduce_scatter_rows(partial, group)
        else:
            y = C.reduce_from_shards(partial, group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        """What ``print(model)`` shows of this layer."""
        size = self.weight.shape[1 if self.weight_layout == "out_in" else 0]
        return (
            f"in_features={self.in_features} (shard {self.group.index} of {self.group.count}: {size}), "
            f"out_features={self.out_features}"
        )


def _check_divides(shard: ShardContext, part: int, what: str) -> None:
    shard.group.require(part, f"{shard.name}: the {what} of the linear layer")
    if shard.granule > 1 and part % (shard.granule * shard.count):
        heads = part // shard.granule
        raise AnnotationError(
            f"{shard.name}: {heads} attention heads of {shard.granule} features each cannot be shared equally by "
            f"{shard.count} devices (each device holds whole heads). Use a device count that divides {heads}, "
            "or create the attention outside the epl.split scope."
        )


def shard_linear(module: nn.Module, shard: ShardContext) -> nn.Module:
    """The split rule for linear-like modules: row-parallel as the last of a region, column-parallel otherwise.

    A layer alone (in no region) with fewer output features than devices, as a gate of one
    output (Qwen2-MoE's ``shared_expert_gate``), is kept whole: every device computes it.
    """
    if shard.role == "whole" or (shard.role == "alone" and _features(module, shard)[1] < shard.count):
        return module
    if shard.role == "row":
        return RowParallelLinear(module, shard)
    return ColumnParallelLinear(module, shard)
