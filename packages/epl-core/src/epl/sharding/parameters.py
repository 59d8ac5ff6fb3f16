"""Parameters that hold one shard of a split tensor: marking them, and gathering or slicing the whole."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from epl.interfaces.shard_group import ShardGroup, shard_sizes

_SPEC = "_epl_shard_spec"


@dataclass(frozen=True)
class ShardSpec:
    """How a shard relates to the whole tensor: sharded along ``dim`` of ``size`` items over ``group``.

    ``parts`` > 1: the whole tensor is ``parts`` equal pieces along ``dim`` (a fused
    q/k/v weight), each sharded on its own; a shard is its slice of every piece, in order.
    """

    group: ShardGroup
    dim: int
    size: int
    parts: int = 1

    def slice_of(self, whole: torch.Tensor) -> torch.Tensor:
        """This device's shard of ``whole``."""
        pieces = whole.chunk(self.parts, self.dim) if self.parts > 1 else (whole,)
        part = self.size // self.parts
        start, length = self.group.slice(part).start, self.group.sizes(part)[self.group.index]
        return torch.cat([piece.narrow(self.dim, start, length) for piece in pieces], dim=self.dim)

    def piece_sizes(self) -> list[int]:
        """Every device's length along ``dim``."""
        return [size * self.parts for size in shard_sizes(self.size // self.parts, self.group.count)]


def assemble(shards: list[torch.Tensor], dim: int, parts: int = 1) -> torch.Tensor:
    """The whole tensor from every device's shard, in device order (see :class:`ShardSpec`)."""
    if parts == 1:
        return torch.cat(shards, dim=dim)
    chunks = [shard.chunk(parts, dim) for shard in shards]
    return torch.cat([chunk[j] for j in range(parts) for chunk in chunks], dim=dim)


def sharded_parameter(whole: torch.Tensor, *, group: ShardGroup, dim: int, parts: int = 1) -> nn.Parameter:
    """A parameter holding this device's shard of ``whole`` along ``dim``, marked as a shard.

    ``requires_grad`` is taken from ``whole``; the values are copied, so the shard
    starts exactly as the unsplit layer did.
    """
    spec = ShardSpec(group, dim % whole.dim(), whole.shape[dim], parts)
    parameter = nn.Parameter(spec.slice_of(whole).detach().clone(), requires_grad=whole.requires_grad)
    setattr(parameter, _SPEC, spec)
    return parameter


def shard_spec(tensor: torch.Tensor) -> ShardSpec | None:
    """The shard spec of ``tensor``, or None when every device holds it whole."""
    return getattr(tensor, _SPEC, None)


def set_shard_spec(tensor: torch.Tensor, spec: ShardSpec | None) -> None:
    """Mark ``tensor`` as the split piece ``spec`` describes (None: unmark it). A transform that replaces a split
    parameter by another object (FSDP2's ``fully_shard`` makes a ``DTensor`` parameter whose global shape is the
    piece) sets the old parameter's spec on the new one, so checkpoints, norms and pretrained I/O find the piece."""
    if spec is None:
        if hasattr(tensor, _SPEC):
            delattr(tensor, _SPEC)
        return
    setattr(tensor, _SPEC, spec)


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is one shard of a split tensor (each device holds a different part)."""
    return shard_spec(tensor) is not None


def gather_whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor a shard belongs to, gathered from every device of its group (a collective); for a tensor
    ZeRO also chunks (a DTensor), :func:`epl.sharding.chunks.whole_of`."""
    return gather_split(tensor, shard_spec(tensor))


def gather_split(tensor: torch.Tensor, spec: ShardSpec | None) -> torch.Tensor:
    """The whole tensor of which ``tensor`` is the piece ``spec`` describes, gathered from every device of its group
    (a collective); ``tensor`` itself (detached) when ``spec`` is None."""
    if spec is None:
        return tensor.detach()
    from epl.sharding.collectives import gather_from_shards

    with torch.no_grad():
        joined = gather_from_shards(tensor.detach(), spec.group, spec.dim, spec.piece_sizes())
    if spec.parts == 1:
        return joined
    return assemble(list(joined.split(spec.piece_sizes(), dim=spec.dim)), spec.dim, spec.parts)
