"""Collectives as autograd functions: what split modules call to move tensors between shards.

Each function is a pair: an operator in the forward pass and its adjoint in the
backward pass, written once as an autograd Function over a link (:mod:`epl.sharding.links`)
that does the communicating. Eagerly, the link is the
:class:`~epl.interfaces.shard_group.ShardGroup`'s communicator: every call waits for its
collective, so a timeout surfaces where it happened, and counts it in ``group.collectives``
(tests assert there is no hidden traffic).
Inside a compiled region (``torch.compiler.is_compiling()``, ``compile.enabled``) over a communicator with a
torch process group, the same Functions run on a traced link, which issues torch's functional collectives and
holds only the process group's name, count and index, so dynamo traces them into the block's graph: a split
block compiles whole, and inductor sees (and may fuse around) the collectives. Those calls are the graph's, so
``group.collectives`` does not count them, and they wait as torch's process group does (its timeout:
``communication.timeout``). Over a communicator without one (another backend) they run eagerly
(``torch.compiler.disable``), a graph break at each.

==========================  ======================================  ======================================
function                    forward                                 backward
==========================  ======================================  ======================================
``copy_to_shards``          identity                                all-reduce (sum)
``reduce_from_shards``      all-reduce (sum)                        identity
``gather_from_shards``      all-gather along ``dim`` (uneven ok)    keep this shard's slice
``split_to_shards``         keep this shard's slice along ``dim``   all-gather along ``dim``
``gather_rows``             all-gather along dimension 0            reduce-scatter (sum) along dimension 0
``scatter_rows``            keep this device's rows                 all-gather along dimension 0
``reduce_scatter_rows``     reduce-scatter (sum) along dimension 0  all-gather along dimension 0
``all_to_all``              chunk j of dimension 0 to member j      all-to-all back
==========================  ======================================  ======================================

``copy_to_shards``/``reduce_from_shards`` are Megatron-LM's *f* and *g*; the
``rows`` functions are the sequence-parallel pair used when the batch is split over
the same devices (colocated ``replicate(n)`` and ``split(n)``).
:func:`sum_gradient_over_shards` is no function of activations: it sums the gradient
of a whole parameter that each device applies to its shard of an activation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

from epl.interfaces.shard_group import ShardGroup
from epl.sharding.links import Link, eager_link, traced_link

_F = TypeVar("_F", bound=Callable[..., Any])


def _eager(function: _F) -> _F:
    """``torch.compiler.disable(function)``, keeping its type (torch's decorator has none): ``function`` runs as it
    is under torch.compile, a break in the compiled graph."""
    return cast(_F, torch.compiler.disable(function))


def _applied(function: type[torch.autograd.Function], *args: Any) -> torch.Tensor:
    """``function.apply(*args)``, the one tensor an autograd Function of this module returns."""
    output: torch.Tensor = function.apply(*args)
    return output


def _run(function: type[torch.autograd.Function], tensor: torch.Tensor, group: ShardGroup, *args: Any) -> torch.Tensor:
    """``function`` applied to ``tensor`` over ``group``: on its traced link inside a compiled region (when it has
    one), else eagerly, a graph break."""
    link = traced_link(group)
    if link is not None:
        return _applied(function, tensor, link, *args)
    return _run_eager(function, tensor, group, *args)


@_eager
def _run_eager(
    function: type[torch.autograd.Function], tensor: torch.Tensor, group: ShardGroup, *args: Any
) -> torch.Tensor:
    return _applied(function, tensor, eager_link(group), *args)


def _gather(tensor: torch.Tensor, link: Link, dim: int, sizes: list[int] | None) -> torch.Tensor:
    """Concatenate every member's ``tensor`` along ``dim``; ``sizes`` gives uneven lengths (each piece padded to the
    longest for the all-gather, the padding dropped after it)."""
    dim = dim % tensor.dim()
    longest = max(sizes) if sizes else tensor.shape[dim]
    output = link.all_gather(_padded(tensor, dim, longest), dim)
    if sizes and any(size != longest for size in sizes):
        chunks = output.split(longest, dim)
        output = torch.cat([chunk.narrow(dim, 0, size) for chunk, size in zip(chunks, sizes, strict=True)], dim)
    # Contiguous, as the whole layer's output was: code after it may view it (view_as_complex, .view()).
    return output.contiguous()


def _padded(tensor: torch.Tensor, dim: int, longest: int) -> torch.Tensor:
    """``tensor`` with zeros after it along ``dim`` up to ``longest`` (an uneven piece of an all-gather)."""
    if tensor.shape[dim] >= longest:
        return tensor
    pad = list(tensor.shape)
    pad[dim] = longest - tensor.shape[dim]
    return torch.cat([tensor, tensor.new_zeros(pad)], dim=dim)


def _reduce_scatter(tensor: torch.Tensor, link: Link, dim: int) -> torch.Tensor:
    """This member's equal share along ``dim`` of the members' sum of ``tensor``."""
    dim = dim % tensor.dim()
    _rows_per_device(tensor.shape[dim], link.count)
    return link.reduce_scatter(tensor, dim).contiguous()


def _exchange(tensor: torch.Tensor, link: Link) -> torch.Tensor:
    """Chunk j of dimension 0 to member j, member j's chunk for this one into chunk j."""
    _rows_per_device(tensor.shape[0], link.count)
    return link.exchange(tensor)


def _rows_per_device(rows: int, count: int) -> int:
    """``rows`` shared equally by ``count`` devices, or the error that they cannot be."""
    if rows % count:
        raise ValueError(f"{rows} rows cannot be shared equally by {count} devices of a split TaskGraph.")
    return rows // count


def regather(tensor: torch.Tensor, group: ShardGroup, dim: int) -> torch.Tensor:
    """Every member's equal ``tensor`` concatenated along ``dim``, outside autograd (a saved input gathered again
    in the backward pass); counted as ``all_gather``."""
    return _gather(tensor, eager_link(group), dim, None)


class _CopyToShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, link: Link) -> torch.Tensor:
        ctx.link = link
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.link.all_reduce(grad), None


class _ReduceFromShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, link: Link) -> torch.Tensor:
        return link.all_reduce(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, link: Link, dim: int, sizes: list[int]) -> torch.Tensor:
        ctx.dim, ctx.start, ctx.size = dim, sum(sizes[: link.index]), sizes[link.index]
        return _gather(tensor, link, dim, sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return grad.narrow(ctx.dim, ctx.start, ctx.size).contiguous(), None, None, None


class _SplitToShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, link: Link, dim: int, sizes: list[int]) -> torch.Tensor:
        ctx.link, ctx.dim, ctx.sizes = link, dim, sizes
        return tensor.narrow(dim, sum(sizes[: link.index]), sizes[link.index]).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _gather(grad, ctx.link, ctx.dim, ctx.sizes), None, None, None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, link: Link, dim: int) -> torch.Tensor:
        ctx.link, ctx.dim = link, dim
        return _gather(tensor, link, dim, None)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter(grad, ctx.link, ctx.dim), None, None


class _ScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, link: Link) -> torch.Tensor:
        ctx.link = link
        rows = _rows_per_device(tensor.shape[0], link.count)
        return tensor[link.index * rows : (link.index + 1) * rows].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather(grad, ctx.link, 0, None), None


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, link: Link, dim: int) -> torch.Tensor:
        ctx.link, ctx.dim = link, dim
        return _reduce_scatter(tensor, link, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather(grad, ctx.link, ctx.dim, None), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, link: Link) -> torch.Tensor:
        ctx.link = link
        return _exchange(tensor, link)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _exchange(grad, ctx.link), None


def copy_to_shards(tensor: torch.Tensor, group: ShardGroup) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward (the input of column-parallel layers)."""
    return _run(_CopyToShards, tensor, group)


def reduce_from_shards(tensor: torch.Tensor, group: ShardGroup) -> torch.Tensor:
    """All-reduce (sum) forward; identity backward (the output of row-parallel layers)."""
    return _run(_ReduceFromShards, tensor, group)


def gather_from_shards(tensor: torch.Tensor, group: ShardGroup, dim: int, sizes: list[int]) -> torch.Tensor:
    """All-gather every shard's piece along ``dim`` (piece lengths ``sizes``); backward keeps this shard's slice."""
    return _run(_GatherFromShards, tensor, group, dim, sizes)


def split_to_shards(tensor: torch.Tensor, group: ShardGroup, dim: int, sizes: list[int]) -> torch.Tensor:
    """This shard's slice along ``dim`` (lengths ``sizes``); backward all-gathers the gradient."""
    return _run(_SplitToShards, tensor, group, dim, sizes)


def gather_rows(tensor: torch.Tensor, group: ShardGroup, dim: int = 0) -> torch.Tensor:
    """Every device's rows (along ``dim``, dimension 0 by default), in device order; backward reduce-scatters
    (sums) the gradient."""
    return _run(_GatherRows, tensor, group, dim)


def scatter_rows(tensor: torch.Tensor, group: ShardGroup) -> torch.Tensor:
    """This device's rows of ``tensor`` (identical on every device); backward all-gathers the gradient."""
    return _run(_ScatterRows, tensor, group)


def reduce_scatter_rows(tensor: torch.Tensor, group: ShardGroup, dim: int = 0) -> torch.Tensor:
    """Sum the devices' partial ``tensor`` and keep this device's rows (along ``dim``); backward all-gathers the
    gradient."""
    return _run(_ReduceScatterRows, tensor, group, dim)


def all_to_all(tensor: torch.Tensor, group: ShardGroup) -> torch.Tensor:
    """Send chunk j of dimension 0 to device j and receive device j's chunk into chunk j; backward sends back."""
    return _run(_AllToAll, tensor, group)


def sum_gradient_over_shards(parameter: torch.Tensor, group: ShardGroup) -> None:
    """Have ``parameter``'s gradient summed over ``group`` in each backward pass, before it is accumulated.

    For a parameter every device holds whole but applies to its shard of an activation
    only (a norm of each attention head: each device holds some heads), so each device's
    gradient covers its shard. (Not needed when the batch is split over the devices: the
    data-parallel reduction averages whole parameters over them, which sums the shards'
    parts of the gradient of the devices' mean loss.)
    """

    def summed(grad: torch.Tensor) -> torch.Tensor:
        return eager_link(group).all_reduce(grad)

    parameter.register_hook(summed)
    setattr(parameter, _SUMMED_OVER_SHARDS, True)


#: The mark :func:`sum_gradient_over_shards` leaves, for transforms that would replace the parameter (and its hook).
_SUMMED_OVER_SHARDS = "_epl_gradient_summed_over_shards"


def gradient_summed_over_shards(parameter: torch.Tensor) -> bool:
    """Whether a hook on ``parameter`` sums its gradient over a shard group (:func:`sum_gradient_over_shards`): a
    transform that replaces the parameter object would lose it, so ZeRO keeps such a parameter as it is."""
    return bool(getattr(parameter, _SUMMED_OVER_SHARDS, False))
