"""Parameters that hold one shard of a split tensor: marking them, and gathering or slicing the whole."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from epl.interfaces.shard_group import ShardGroup, shard_sizes

_SPEC = "_epl_shard_spec"


@dataclass(frozen=True)
class ShardSpec:
    """How a shard relates to the whole tensor: sharded along ``dim`` of ``size`` items over ``group``."""

    group: ShardGroup
    dim: int
    size: int

    def slice_of(self, whole: torch.Tensor) -> torch.Tensor:
        """This device's shard of ``whole``."""
        return whole.narrow(self.dim, self.group.slice(self.size).start, self.group.sizes(self.size)[self.group.index])


def sharded_parameter(whole: torch.Tensor, *, group: ShardGroup, dim: int) -> nn.Parameter:
    """A parameter holding this device's shard of ``whole`` along ``dim``, marked as a shard.

    ``requires_grad`` is taken from ``whole``; the values are copied, so the shard
    starts exactly as the unsplit layer did.
    """
    spec = ShardSpec(group, dim % whole.dim(), whole.shape[dim])
    parameter = nn.Parameter(spec.slice_of(whole).detach().clone(), requires_grad=whole.requires_grad)
    setattr(parameter, _SPEC, spec)
    return parameter


def shard_spec(tensor: torch.Tensor) -> ShardSpec | None:
    """The shard spec of ``tensor``, or None when every device holds it whole."""
    return getattr(tensor, _SPEC, None)


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is one shard of a split tensor (each device holds a different part)."""
    return shard_spec(tensor) is not None


def gather_whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor a shard belongs to, gathered from every device of its group (a collective)."""
    spec = shard_spec(tensor)
    if spec is None:
        return tensor.detach()
    from epl.sharding.collectives import gather_from_shards

    with torch.no_grad():
        return gather_from_shards(tensor.detach(), spec.group, spec.dim, shard_sizes(spec.size, spec.group.count))
