"""Expert parallelism for :class:`epl.nn.Experts`: each device holds a contiguous range of the experts."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from epl.errors import AnnotationError
from epl.interfaces.shard_group import ShardGroup
from epl.interfaces.split_rule import ShardContext
from epl.nn.moe import Experts, expert_feed_forward
from epl.sharding import collectives as C
from epl.sharding.parameters import sharded_parameter


class ExpertParallelExperts(nn.Module):
    """This device's experts.

    With the batch split over the devices (the manual's recipe), every device
    dispatches its own tokens to all experts; one all-to-all sends each expert's
    tokens to the device that holds it and a second brings the results back.
    Without it, every device has the same tokens, runs its experts on them, and
    the results are all-gathered.
    """

    #: This device's experts' weights, stacked by expert (set in ``__init__`` by name).
    w_in: nn.Parameter
    b_in: nn.Parameter
    w_out: nn.Parameter
    b_out: nn.Parameter

    def __init__(self, experts: Experts, shard: ShardContext) -> None:
        super().__init__()
        if experts.num_experts % shard.count:
            raise AnnotationError(
                f"{shard.name}: {experts.num_experts} experts cannot be shared equally by {shard.count} devices. "
                f"Use a number of experts that is a multiple of {shard.count}."
            )
        self.group = shard.group
        self.num_experts = experts.num_experts
        self.local_experts = experts.num_experts // shard.count
        for name in ("w_in", "b_in", "w_out", "b_out"):
            full = getattr(experts, name)
            setattr(self, name, sharded_parameter(full, group=self.group, dim=0))

    def forward(self, dispatched: torch.Tensor) -> torch.Tensor:
        """[num_experts, slots, d_model] in, the same out: every expert's tokens, processed."""
        group, local = self.group, self.local_experts
        if not group.batch_split:
            sizes = [local] * group.count
            mine = C.split_to_shards(dispatched, group, 0, sizes)
            return C.gather_from_shards(self._run(mine), group, 0, sizes)
        experts, slots, width = dispatched.shape
        received = C.all_to_all(dispatched, group)  # chunk i: device i's tokens for my experts
        by_expert = received.reshape(group.count, local, slots, width).transpose(0, 1).reshape(local, -1, width)
        processed = self._run(by_expert)
        back = processed.reshape(local, group.count, slots, width).transpose(0, 1).reshape(experts, slots, width)
        return C.all_to_all(back, group)

    def _run(self, tokens: torch.Tensor) -> torch.Tensor:
        return expert_feed_forward(tokens, self.w_in, self.b_in, self.w_out, self.b_out)

    def extra_repr(self) -> str:
        """What ``print(model)`` shows of this layer."""
        first = self.group.index * self.local_experts
        return f"experts {first}..{first + self.local_experts - 1} of {self.num_experts}"


def shard_experts(module: Experts, shard: ShardContext) -> nn.Module:
    """The split rule for :class:`epl.nn.Experts`: expert parallel."""
    return ExpertParallelExperts(module, shard)


def stacked_experts_count(module: nn.Module) -> int | None:
    """The number of experts of a module holding weights stacked by expert, or None.

    Every parameter it holds itself has 3 or more dimensions and the same first size,
    and one of its integer attributes says that size (``num_experts``). torch's own layers
    are never experts: a bias-free ``Conv1d`` has a 3-dimensional weight whose first size
    is its ``out_channels``.
    """
    if type(module).__module__.startswith("torch.nn."):
        return None
    params = list(module.parameters(recurse=False))
    if not params or any(p.dim() < 3 for p in params):
        return None
    counts = {p.shape[0] for p in params}
    if len(counts) != 1:
        return None
    (count,) = counts
    named = [name for name, value in vars(module).items() if type(value) is int and value == count]
    return count if named else None


@dataclass(frozen=True)
class ExpertRange:
    """The experts one device holds of a fused experts module: ``first`` .. ``first + count - 1`` of ``total``."""

    group: ShardGroup
    first: int
    count: int
    total: int


def _expert_parallel_forward(
    self: nn.Module, tokens: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Every token's weighted sum over its experts, like the unsplit module (see :func:`shard_stacked_experts`)."""
    held = cast(ExpertRange, self._epl_experts)
    group = held.group
    if group.batch_split:
        tokens, top_k_index = C.gather_rows(tokens, group), C.gather_rows(top_k_index, group)
        top_k_weights = C.gather_rows(top_k_weights, group)
    else:
        tokens, top_k_weights = C.copy_to_shards(tokens, group), C.copy_to_shards(top_k_weights, group)
    local = top_k_index - held.first
    mine = (local >= 0) & (local < held.count)
    local = local.masked_fill(~mine, held.count)
    original = cast(type[nn.Module], type(self).__mro__[1]).forward
    partial = original(self, tokens, local, top_k_weights.masked_fill(~mine, 0.0))
    # The input-gradient collectives above run backward only where a gradient reaches them, and a device whose
    # experts no token was routed to computes nothing from its inputs: it would skip them while the others wait
    # (a mismatch). The tie keeps both inputs on every device's graph, whatever the routing.
    partial = _Tie.apply(partial, tokens, top_k_weights)
    return C.reduce_scatter_rows(partial, group) if group.batch_split else C.reduce_from_shards(partial, group)


class _Tie(torch.autograd.Function):
    """``output`` itself, with ``inputs`` on its graph: backward, they receive zeros besides what else reaches them."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.inputs = [(t.shape, t.dtype, t.device) for t in inputs]
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (grad, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.inputs))


def _extra_repr(self: nn.Module) -> str:
    held = cast(ExpertRange, self._epl_experts)
    return f"experts {held.first}..{held.first + held.count - 1} of {held.total} (expert parallel)"


#: One expert-parallel class per fused experts class (so that two modules of one class share it).
_EXPERT_PARALLEL_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


def _expert_parallel_class(cls: type[nn.Module]) -> type[nn.Module]:
    """``cls`` with its forward wrapped for expert parallelism (parameter names stay those of ``cls``)."""
    if cls not in _EXPERT_PARALLEL_CLASSES:
        methods = {"forward": _expert_parallel_forward, "extra_repr": _extra_repr}
        _EXPERT_PARALLEL_CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (cls,), methods)
    return _EXPERT_PARALLEL_CLASSES[cls]


def _positional(function: Callable[..., object]) -> list[str]:
    """The names of the positional parameters of ``function`` after ``self``."""
    parameters = list(inspect.signature(function).parameters.values())[1:]
    return [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def shard_stacked_experts(module: nn.Module, shard: ShardContext) -> nn.Module:
    """The fallback rule for fused experts modules (transformers' Mixtral/Qwen-MoE style): expert parallel.

    The module is called as ``experts(tokens, top_k_index, top_k_weights)``. Each device
    keeps a copy of it holding its experts only (its expert count attribute lowered to
    match) and runs it on every token routed to one of them; routes to other devices'
    experts point at the expert count, which such modules skip, with weight zero. The
    partial outputs are summed over the devices: one all-reduce forward, one for the
    input gradients backward. With the batch split over the devices, each device's
    tokens are gathered first and the sum is reduce-scattered back.
    """
    count = stacked_experts_count(module)
    assert count is not None
    if len(_positional(type(module).forward)) < 3:
        raise AnnotationError(
            f"{shard.name}: {type(module).__qualname__} holds {count} experts stacked in its weights, but its forward "
            "takes no routing (EPL shards fused experts called as experts(tokens, top_k_index, top_k_weights), "
            "as Mixtral's and Qwen-MoE's). Register a split rule for it (docs/split.md, 'Writing a rule'), or "
            "create the experts outside the epl.split scope."
        )
    if count % shard.count:
        raise AnnotationError(
            f"{shard.name}: {count} experts cannot be shared equally by {shard.count} devices. "
            f"Use a number of experts that is a multiple of {shard.count}."
        )
    local_count = count // shard.count
    local = copy.copy(module)
    local._parameters = dict(module._parameters)
    local._buffers = dict(module._buffers)
    local._modules = dict(module._modules)
    for name, value in vars(module).items():
        if type(value) is int and value == count:
            setattr(local, name, local_count)
    for name, param in module.named_parameters(recurse=False):
        setattr(local, name, sharded_parameter(param, group=shard.group, dim=0))
    if hasattr(local, "_is_expert_parallel"):
        # transformers' kernels then mask the routes to other devices' experts
        local._is_expert_parallel = True  # type: ignore[assignment]  # Module.__setattr__ takes any value
    held = ExpertRange(shard.group, shard.index * local_count, local_count, count)
    local._epl_experts = held  # type: ignore[assignment]  # Module.__setattr__ takes any value
    local.__class__ = _expert_parallel_class(type(module))
    return local
