"""Collectives as autograd functions: what split modules call to move tensors between shards.

Each function is a pair: an operator in the forward pass and its adjoint in the
backward pass, over the :class:`~epl.interfaces.shard_group.ShardGroup`'s communicator.
Every call waits for its collective, so a timeout surfaces where it happened,
and counts it in ``group.collectives`` (tests assert there is no hidden traffic).
``torch.compile`` runs them as they are (``torch.compiler.disable``): a compiled block breaks its graph at each,
rather than tracing the communicator and guarding on its counters.

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

from epl.interfaces.communicator import ReduceOp
from epl.interfaces.shard_group import ShardGroup

_F = TypeVar("_F", bound=Callable[..., Any])


def _eager(function: _F) -> _F:
    """``torch.compiler.disable(function)``, keeping its type (torch's decorator has none): ``function`` runs as it
    is under torch.compile, a break in the compiled graph."""
    return cast(_F, torch.compiler.disable(function))


def _applied(function: type[torch.autograd.Function], *args: Any) -> torch.Tensor:
    """``function.apply(*args)``, the one tensor an autograd Function of this module returns."""
    output: torch.Tensor = function.apply(*args)
    return output


def _all_reduce(tensor: torch.Tensor, group: ShardGroup) -> torch.Tensor:
    group.collectives["all_reduce"] += 1
    result = tensor.clone(memory_format=torch.contiguous_format)
    group.communicator.all_reduce(result, ReduceOp.SUM).wait()
    return result


def _gather(tensor: torch.Tensor, group: ShardGroup, dim: int, sizes: list[int] | None) -> torch.Tensor:
    """Concatenate every member's ``tensor`` along ``dim``; ``sizes`` gives uneven lengths."""
    group.collectives["all_gather"] += 1
    dim = dim % tensor.dim()
    longest = max(sizes) if sizes else tensor.shape[dim]
    piece = tensor
    if piece.shape[dim] < longest:
        pad = list(piece.shape)
        pad[dim] = longest - piece.shape[dim]
        piece = torch.cat([piece, piece.new_zeros(pad)], dim=dim)
    piece = piece.movedim(dim, 0).contiguous()
    output = piece.new_empty((group.count * piece.shape[0], *piece.shape[1:]))
    group.communicator.all_gather(output, piece).wait()
    chunks = list(output.split(piece.shape[0]))
    if sizes:
        chunks = [chunk[:size] for chunk, size in zip(chunks, sizes, strict=True)]
    # Contiguous, as the whole layer's output was: code after it may view it (view_as_complex, .view()).
    return torch.cat(chunks).movedim(0, dim).contiguous()


def regather(tensor: torch.Tensor, group: ShardGroup, dim: int) -> torch.Tensor:
    """Every member's equal ``tensor`` concatenated along ``dim``, outside autograd (a saved input gathered again
    in the backward pass); counted as ``all_gather``."""
    return _gather(tensor, group, dim, None)


def _reduce_scatter_rows(tensor: torch.Tensor, group: ShardGroup) -> torch.Tensor:
    group.collectives["reduce_scatter"] += 1
    rows = _own_rows_count(tensor, group)
    output = tensor.new_empty((rows, *tensor.shape[1:]))
    group.communicator.reduce_scatter(output, tensor.contiguous(), ReduceOp.SUM).wait()
    return output


def _reduce_scatter_along(tensor: torch.Tensor, group: ShardGroup, dim: int) -> torch.Tensor:
    """:func:`_reduce_scatter_rows` along ``dim``: this device's equal share of the sum."""
    if dim % tensor.dim() == 0:
        return _reduce_scatter_rows(tensor, group)
    return _reduce_scatter_rows(tensor.movedim(dim, 0), group).movedim(0, dim).contiguous()


def _own_rows_count(tensor: torch.Tensor, group: ShardGroup) -> int:
    if tensor.shape[0] % group.count:
        raise ValueError(
            f"{tensor.shape[0]} rows cannot be shared equally by {group.count} devices of a split TaskGraph."
        )
    return tensor.shape[0] // group.count


def _own_rows(tensor: torch.Tensor, group: ShardGroup) -> torch.Tensor:
    rows = _own_rows_count(tensor, group)
    return tensor[group.index * rows : (group.index + 1) * rows]


class _CopyToShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ShardGroup) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ShardGroup) -> torch.Tensor:
        return _all_reduce(tensor, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ShardGroup, dim: int, sizes: list[int]) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.sizes = group, dim, sizes
        return _gather(tensor, group, dim, sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        start = sum(ctx.sizes[: ctx.group.index])
        return grad.narrow(ctx.dim, start, ctx.sizes[ctx.group.index]).contiguous(), None, None, None


class _SplitToShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ShardGroup, dim: int, sizes: list[int]) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.sizes = group, dim, sizes
        start = sum(sizes[: group.index])
        return tensor.narrow(dim, start, sizes[group.index]).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _gather(grad, ctx.group, ctx.dim, ctx.sizes), None, None, None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ShardGroup, dim: int = 0) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _gather(tensor, group, dim, None)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter_along(grad, ctx.group, ctx.dim), None, None


class _ScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ShardGroup) -> torch.Tensor:
        ctx.group = group
        return _own_rows(tensor, group).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather(grad, ctx.group, 0, None), None


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ShardGroup, dim: int = 0) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter_along(tensor, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather(grad, ctx.group, ctx.dim, None), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ShardGroup) -> torch.Tensor:
        ctx.group = group
        return _exchange(tensor, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _exchange(grad, ctx.group), None


def _exchange(tensor: torch.Tensor, group: ShardGroup) -> torch.Tensor:
    _own_rows_count(tensor, group)
    group.collectives["all_to_all"] += 1
    source = tensor.contiguous()
    output = torch.empty_like(source)
    group.communicator.all_to_all(output, source).wait()
    return output


@_eager
def copy_to_shards(tensor: torch.Tensor, group: ShardGroup) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward (the input of column-parallel layers)."""
    return _applied(_CopyToShards, tensor, group)


@_eager
def reduce_from_shards(tensor: torch.Tensor, group: ShardGroup) -> torch.Tensor:
    """All-reduce (sum) forward; identity backward (the output of row-parallel layers)."""
    return _applied(_ReduceFromShards, tensor, group)


@_eager
def gather_from_shards(tensor: torch.Tensor, group: ShardGroup, dim: int, sizes: list[int]) -> torch.Tensor:
    """All-gather every shard's piece along ``dim`` (piece lengths ``sizes``); backward keeps this shard's slice."""
    return _applied(_GatherFromShards, tensor, group, dim, sizes)


@_eager
def split_to_shards(tensor: torch.Tensor, group: ShardGroup, dim: int, sizes: list[int]) -> torch.Tensor:
    """This shard's slice along ``dim`` (lengths ``sizes``); backward all-gathers the gradient."""
    return _applied(_SplitToShards, tensor, group, dim, sizes)


@_eager
def gather_rows(tensor: torch.Tensor, group: ShardGroup, dim: int = 0) -> torch.Tensor:
    """Every device's rows (along ``dim``, dimension 0 by default), in device order; backward reduce-scatters
    (sums) the gradient."""
    return _applied(_GatherRows, tensor, group, dim)


@_eager
def scatter_rows(tensor: torch.Tensor, group: ShardGroup) -> torch.Tensor:
    """This device's rows of ``tensor`` (identical on every device); backward all-gathers the gradient."""
    return _applied(_ScatterRows, tensor, group)


@_eager
def reduce_scatter_rows(tensor: torch.Tensor, group: ShardGroup, dim: int = 0) -> torch.Tensor:
    """Sum the devices' partial ``tensor`` and keep this device's rows (along ``dim``); backward all-gathers the
    gradient."""
    return _applied(_ReduceScatterRows, tensor, group, dim)


@_eager
def all_to_all(tensor: torch.Tensor, group: ShardGroup) -> torch.Tensor:
    """Send chunk j of dimension 0 to device j and receive device j's chunk into chunk j; backward sends back."""
    return _applied(_AllToAll, tensor, group)


def sum_gradient_over_shards(parameter: torch.Tensor, group: ShardGroup) -> None:
    """Have ``parameter``'s gradient summed over ``group`` in each backward pass, before it is accumulated.

    For a parameter every device holds whole but applies to its shard of an activation
    only (a norm of each attention head: each device holds some heads), so each device's
    gradient covers its shard. (Not needed when the batch is split over the devices: the
    data-parallel reduction averages whole parameters over them, which sums the shards'
    parts of the gradient of the devices' mean loss.)
    """

    def summed(grad: torch.Tensor) -> torch.Tensor:
        return _all_reduce(grad, group)

    parameter.register_hook(summed)
    setattr(parameter, _SUMMED_OVER_SHARDS, True)


#: The mark :func:`sum_gradient_over_shards` leaves, for transforms that would replace the parameter (and its hook).
_SUMMED_OVER_SHARDS = "_epl_gradient_summed_over_shards"


def gradient_summed_over_shards(parameter: torch.Tensor) -> bool:
    """Whether a hook on ``parameter`` sums its gradient over a shard group (:func:`sum_gradient_over_shards`): a
    transform that replaces the parameter object would lose it, so ZeRO keeps such a parameter as it is."""
    return bool(getattr(parameter, _SUMMED_OVER_SHARDS, False))
