"""Collectives as autograd functions: what split modules call to move tensors between shards.

Each function is a pair: an operator in the forward pass and its adjoint in the
backward pass, over the :class:`~epl.interfaces.shard_group.ShardGroup`'s communicator.
Every call waits for its collective, so a timeout surfaces where it happened,
and counts it in ``group.collectives`` (tests assert there is no hidden traffic).
Inside a compiled region (``torch.compiler.is_compiling()``, ``compile.enabled``) over a communicator with a
torch process group, each function is issued as torch's functional collectives instead, in autograd Functions of
the same forward/backward pairs, which dynamo traces into the block's graph: a split block compiles whole, and
inductor sees (and may fuse around) the collectives. Those calls are the graph's, so ``group.collectives`` does not
count them, and they wait as torch's process group does (its timeout: ``communication.timeout``). Over a
communicator without one (another backend) they run as they are (``torch.compiler.disable``), a graph break at each.

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
from epl.torch_private import functional_collectives

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
    piece = _padded(tensor, dim, max(sizes) if sizes else tensor.shape[dim]).movedim(dim, 0).contiguous()
    output = piece.new_empty((group.count * piece.shape[0], *piece.shape[1:]))
    group.communicator.all_gather(output, piece).wait()
    chunks = list(output.split(piece.shape[0]))
    if sizes:
        chunks = [chunk[:size] for chunk, size in zip(chunks, sizes, strict=True)]
    # Contiguous, as the whole layer's output was: code after it may view it (view_as_complex, .view()).
    return torch.cat(chunks).movedim(0, dim).contiguous()


def _padded(tensor: torch.Tensor, dim: int, longest: int) -> torch.Tensor:
    """``tensor`` with zeros after it along ``dim`` up to ``longest`` (an uneven piece of an all-gather)."""
    if tensor.shape[dim] >= longest:
        return tensor
    pad = list(tensor.shape)
    pad[dim] = longest - tensor.shape[dim]
    return torch.cat([tensor, tensor.new_zeros(pad)], dim=dim)


def _rows_per_device(rows: int, count: int) -> int:
    """``rows`` shared equally by ``count`` devices, or the error that they cannot be."""
    if rows % count:
        raise ValueError(f"{rows} rows cannot be shared equally by {count} devices of a split TaskGraph.")
    return rows // count


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
    return _rows_per_device(tensor.shape[0], group.count)


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


def _traced(group: ShardGroup) -> str | None:
    """The process group's name when ``group``'s collectives are traced (inside a compiled region, over a
    communicator with a torch process group); None when they run as they are."""
    if group.traced_group is None or not torch.compiler.is_compiling():
        return None
    return group.traced_group


def _traced_all_reduce(tensor: torch.Tensor, name: str) -> torch.Tensor:
    funcol = functional_collectives()
    return cast(torch.Tensor, funcol.wait_tensor(funcol.all_reduce(tensor.contiguous(), "sum", name)))


def _traced_gather(tensor: torch.Tensor, name: str, count: int, dim: int, sizes: list[int] | None) -> torch.Tensor:
    """:func:`_gather` by a functional all-gather: uneven pieces padded to the longest, the padding dropped."""
    funcol = functional_collectives()
    dim = dim % tensor.dim()
    longest = max(sizes) if sizes else tensor.shape[dim]
    piece = _padded(tensor, dim, longest)
    output = cast(torch.Tensor, funcol.wait_tensor(funcol.all_gather_tensor(piece.contiguous(), dim, name)))
    if sizes and any(size != longest for size in sizes):
        chunks = output.split(longest, dim)
        output = torch.cat([chunk.narrow(dim, 0, size) for chunk, size in zip(chunks, sizes, strict=True)], dim)
    return output.contiguous()


def _traced_reduce_scatter(tensor: torch.Tensor, name: str, count: int, dim: int) -> torch.Tensor:
    dim = dim % tensor.dim()
    _rows_per_device(tensor.shape[dim], count)
    funcol = functional_collectives()
    return cast(torch.Tensor, funcol.wait_tensor(funcol.reduce_scatter_tensor(tensor.contiguous(), "sum", dim, name)))


class _TracedCopy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str) -> torch.Tensor:
        ctx.name = name
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _traced_all_reduce(grad, ctx.name), None


class _TracedReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return _traced_all_reduce(tensor, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _TracedGather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, name: str, count: int, index: int, dim: int, sizes: list[int]
    ) -> torch.Tensor:
        ctx.dim, ctx.start, ctx.size = dim, sum(sizes[:index]), sizes[index]
        return _traced_gather(tensor, name, count, dim, sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None, None]:
        return grad.narrow(ctx.dim, ctx.start, ctx.size).contiguous(), None, None, None, None, None


class _TracedSplit(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, name: str, count: int, index: int, dim: int, sizes: list[int]
    ) -> torch.Tensor:
        ctx.name, ctx.count, ctx.dim, ctx.sizes = name, count, dim, sizes
        return tensor.narrow(dim, sum(sizes[:index]), sizes[index]).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None, None]:
        return _traced_gather(grad, ctx.name, ctx.count, ctx.dim, ctx.sizes), None, None, None, None, None


class _TracedGatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str, count: int, dim: int) -> torch.Tensor:
        ctx.name, ctx.count, ctx.dim = name, count, dim
        return _traced_gather(tensor, name, count, dim, None)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _traced_reduce_scatter(grad, ctx.name, ctx.count, ctx.dim), None, None, None


class _TracedScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str, count: int, index: int) -> torch.Tensor:
        ctx.name, ctx.count = name, count
        rows = _rows_per_device(tensor.shape[0], count)
        return tensor[index * rows : (index + 1) * rows].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _traced_gather(grad, ctx.name, ctx.count, 0, None), None, None, None


class _TracedReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str, count: int, dim: int) -> torch.Tensor:
        ctx.name, ctx.count, ctx.dim = name, count, dim
        return _traced_reduce_scatter(tensor, name, count, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _traced_gather(grad, ctx.name, ctx.count, ctx.dim, None), None, None, None


class _TracedAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str, count: int) -> torch.Tensor:
        _rows_per_device(tensor.shape[0], count)
        ctx.name, ctx.count = name, count
        return _traced_all_to_all(tensor, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _traced_all_to_all(grad, ctx.name), None, None


def _traced_all_to_all(tensor: torch.Tensor, name: str) -> torch.Tensor:
    funcol = functional_collectives()
    return cast(torch.Tensor, funcol.wait_tensor(funcol.all_to_all_single(tensor.contiguous(), None, None, name)))


def copy_to_shards(tensor: torch.Tensor, group: ShardGroup) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward (the input of column-parallel layers)."""
    name = _traced(group)
    if name is not None:
        return _applied(_TracedCopy, tensor, name)
    return _copy_to_shards_eager(tensor, group)


@_eager
def _copy_to_shards_eager(tensor: torch.Tensor, group: ShardGroup) -> torch.Tensor:
    return _applied(_CopyToShards, tensor, group)


def reduce_from_shards(tensor: torch.Tensor, group: ShardGroup) -> torch.Tensor:
    """All-reduce (sum) forward; identity backward (the output of row-parallel layers)."""
    name = _traced(group)
    if name is not None:
        return _applied(_TracedReduce, tensor, name)
    return _reduce_from_shards_eager(tensor, group)


@_eager
def _reduce_from_shards_eager(tensor: torch.Tensor, group: ShardGroup) -> torch.Tensor:
    return _applied(_ReduceFromShards, tensor, group)


def gather_from_shards(tensor: torch.Tensor, group: ShardGroup, dim: int, sizes: list[int]) -> torch.Tensor:
    """All-gather every shard's piece along ``dim`` (piece lengths ``sizes``); backward keeps this shard's slice."""
    name = _traced(group)
    if name is not None:
        return _applied(_TracedGather, tensor, name, group.count, group.index, dim, sizes)
    return _gather_from_shards_eager(tensor, group, dim, sizes)


@_eager
def _gather_from_shards_eager(tensor: torch.Tensor, group: ShardGroup, dim: int, sizes: list[int]) -> torch.Tensor:
    return _applied(_GatherFromShards, tensor, group, dim, sizes)


def split_to_shards(tensor: torch.Tensor, group: ShardGroup, dim: int, sizes: list[int]) -> torch.Tensor:
    """This shard's slice along ``dim`` (lengths ``sizes``); backward all-gathers the gradient."""
    name = _traced(group)
    if name is not None:
        return _applied(_TracedSplit, tensor, name, group.count, group.index, dim, sizes)
    return _split_to_shards_eager(tensor, group, dim, sizes)


@_eager
def _split_to_shards_eager(tensor: torch.Tensor, group: ShardGroup, dim: int, sizes: list[int]) -> torch.Tensor:
    return _applied(_SplitToShards, tensor, group, dim, sizes)


def gather_rows(tensor: torch.Tensor, group: ShardGroup, dim: int = 0) -> torch.Tensor:
    """Every device's rows (along ``dim``, dimension 0 by default), in device order; backward reduce-scatters
    (sums) the gradient."""
    name = _traced(group)
    if name is not None:
        return _applied(_TracedGatherRows, tensor, name, group.count, dim)
    return _gather_rows_eager(tensor, group, dim)


@_eager
def _gather_rows_eager(tensor: torch.Tensor, group: ShardGroup, dim: int = 0) -> torch.Tensor:
    return _applied(_GatherRows, tensor, group, dim)


def scatter_rows(tensor: torch.Tensor, group: ShardGroup) -> torch.Tensor:
    """This device's rows of ``tensor`` (identical on every device); backward all-gathers the gradient."""
    name = _traced(group)
    if name is not None:
        return _applied(_TracedScatterRows, tensor, name, group.count, group.index)
    return _scatter_rows_eager(tensor, group)


@_eager
def _scatter_rows_eager(tensor: torch.Tensor, group: ShardGroup) -> torch.Tensor:
    return _applied(_ScatterRows, tensor, group)


def reduce_scatter_rows(tensor: torch.Tensor, group: ShardGroup, dim: int = 0) -> torch.Tensor:
    """Sum the devices' partial ``tensor`` and keep this device's rows (along ``dim``); backward all-gathers the
    gradient."""
    name = _traced(group)
    if name is not None:
        return _applied(_TracedReduceScatterRows, tensor, name, group.count, dim)
    return _reduce_scatter_rows_eager(tensor, group, dim)


@_eager
def _reduce_scatter_rows_eager(tensor: torch.Tensor, group: ShardGroup, dim: int = 0) -> torch.Tensor:
    return _applied(_ReduceScatterRows, tensor, group, dim)


def all_to_all(tensor: torch.Tensor, group: ShardGroup) -> torch.Tensor:
    """Send chunk j of dimension 0 to device j and receive device j's chunk into chunk j; backward sends back."""
    name = _traced(group)
    if name is not None:
        return _applied(_TracedAllToAll, tensor, name, group.count)
    return _all_to_all_eager(tensor, group)


@_eager
def _all_to_all_eager(tensor: torch.Tensor, group: ShardGroup) -> torch.Tensor:
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
