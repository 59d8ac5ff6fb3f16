"""How split's collectives communicate: eagerly over a ShardGroup's communicator, or traced into a compiled graph.

A link gives :mod:`epl.sharding.collectives` four primitives over equal pieces (all-reduce, all-gather along a
dimension, reduce-scatter along a dimension, all-to-all along dimension 0) and the member count and index, so each
collective's forward/backward pairing is written once. :class:`EagerLink` waits for each collective on the
:class:`~epl.interfaces.shard_group.ShardGroup`'s communicator and counts it in ``group.collectives``;
:class:`TracedLink` holds only the process group's name, the count and the index (constants to dynamo) and issues
torch's functional collectives, which dynamo traces into the compiled graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, cast

import torch

from epl.interfaces.communicator import ReduceOp
from epl.interfaces.shard_group import ShardGroup
from epl.torch_private import functional_collectives

#: What an all-reduce combines: the members' sum, or their elementwise maximum.
Combine = Literal["sum", "max"]


class Link(Protocol):
    """The primitives a collective of :mod:`epl.sharding.collectives` is written with."""

    @property
    def count(self) -> int:
        """How many members."""
        ...

    @property
    def index(self) -> int:
        """This member's place."""
        ...

    def all_reduce(self, tensor: torch.Tensor, combine: Combine = "sum") -> torch.Tensor:
        """Every member's ``tensor`` combined: their sum, or their elementwise maximum."""
        ...

    def all_gather(self, piece: torch.Tensor, dim: int) -> torch.Tensor:
        """Every member's equal ``piece`` concatenated along ``dim`` (non-negative), in member order."""
        ...

    def reduce_scatter(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This member's equal share along ``dim`` (non-negative, divisible by the count) of the members' sum."""
        ...

    def exchange(self, tensor: torch.Tensor) -> torch.Tensor:
        """Chunk j of dimension 0 sent to member j; chunk j of the result is member j's chunk for this one."""
        ...


@dataclass(frozen=True)
class EagerLink:
    """The group's communicator, each collective waited for (its timeout surfaces here) and counted (made by
    :func:`eager_link`)."""

    group: ShardGroup
    count: int
    index: int

    def all_reduce(self, tensor: torch.Tensor, combine: Combine = "sum") -> torch.Tensor:
        """Every member's ``tensor`` combined (sum or maximum); counted as ``all_reduce``."""
        self.group.collectives["all_reduce"] += 1
        result = tensor.clone(memory_format=torch.contiguous_format)
        self.group.communicator.all_reduce(result, ReduceOp.SUM if combine == "sum" else ReduceOp.MAX).wait()
        return result

    def all_gather(self, piece: torch.Tensor, dim: int) -> torch.Tensor:
        """Every member's equal ``piece`` concatenated along ``dim``; counted as ``all_gather``."""
        self.group.collectives["all_gather"] += 1
        piece = piece.movedim(dim, 0).contiguous()
        output = piece.new_empty((self.count * piece.shape[0], *piece.shape[1:]))
        self.group.communicator.all_gather(output, piece).wait()
        return output.movedim(0, dim)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This member's equal share along ``dim`` of the members' sum; counted as ``reduce_scatter``."""
        self.group.collectives["reduce_scatter"] += 1
        source = tensor.movedim(dim, 0).contiguous()
        output = source.new_empty((source.shape[0] // self.count, *source.shape[1:]))
        self.group.communicator.reduce_scatter(output, source, ReduceOp.SUM).wait()
        return output.movedim(0, dim)

    def exchange(self, tensor: torch.Tensor) -> torch.Tensor:
        """An all-to-all along dimension 0; counted as ``all_to_all``."""
        self.group.collectives["all_to_all"] += 1
        source = tensor.contiguous()
        output = torch.empty_like(source)
        self.group.communicator.all_to_all(output, source).wait()
        return output


@dataclass(frozen=True)
class TracedLink:
    """Torch's functional collectives on the process group named ``name``: what dynamo traces into a graph (they
    wait as the process group does, and ``group.collectives`` does not count them)."""

    name: str
    count: int
    index: int

    def all_reduce(self, tensor: torch.Tensor, combine: Combine = "sum") -> torch.Tensor:
        """Every member's ``tensor`` combined (sum or maximum)."""
        funcol = functional_collectives()
        return cast(torch.Tensor, funcol.wait_tensor(funcol.all_reduce(tensor.contiguous(), combine, self.name)))

    def all_gather(self, piece: torch.Tensor, dim: int) -> torch.Tensor:
        """Every member's equal ``piece`` concatenated along ``dim``."""
        funcol = functional_collectives()
        return cast(torch.Tensor, funcol.wait_tensor(funcol.all_gather_tensor(piece.contiguous(), dim, self.name)))

    def reduce_scatter(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This member's equal share along ``dim`` of the members' sum."""
        funcol = functional_collectives()
        scattered = funcol.reduce_scatter_tensor(tensor.contiguous(), "sum", dim, self.name)
        return cast(torch.Tensor, funcol.wait_tensor(scattered))

    def exchange(self, tensor: torch.Tensor) -> torch.Tensor:
        """An all-to-all along dimension 0."""
        funcol = functional_collectives()
        exchanged = funcol.all_to_all_single(tensor.contiguous(), None, None, self.name)
        return cast(torch.Tensor, funcol.wait_tensor(exchanged))


def eager_link(group: ShardGroup) -> EagerLink:
    """The link ``group``'s collectives run on eagerly."""
    return EagerLink(group, group.count, group.index)


def tracing(group: ShardGroup) -> bool:
    """Whether ``group``'s collectives are traced here: inside a compiled region, over a communicator with a torch
    process group."""
    return group.traced_group is not None and torch.compiler.is_compiling()


def traced_link(group: ShardGroup) -> TracedLink | None:
    """The link ``group``'s collectives are traced on (:func:`tracing`); None when they run eagerly."""
    name = group.traced_group
    return TracedLink(name, group.count, group.index) if name is not None and tracing(group) else None


def link_of(group: ShardGroup) -> Link:
    """The link ``group``'s collectives run on here: traced inside a compiled region, else eager."""
    return traced_link(group) or eager_link(group)
