"""ZeRO: the copies of a parameter group split its optimizer state (v0), gradients (v1) and parameters (v2).

Every parameter with several copies has one owner among them (a balanced partition
of whole parameters). The owner alone keeps its optimizer state and applies the
update (v0). From v1 on, gradients are reduced to the owner only and the other
copies drop theirs; from v2 on, the other copies also drop the parameter's data
between uses and receive it from the owner just in time (``epl_memory.residency``).
For fp32 Adam with N copies, a device holds 4Ψ+4Ψ+8Ψ/N bytes (v0), 4Ψ+12Ψ/N (v1)
or 16Ψ/N (v2) instead of 16Ψ (Ψ: parameters of the group), up to the partition's
imbalance.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from epl.plugin_api import Communicator, ConfigError, TransformPhase, WrapperPhase, broadcast_tensors, group_options

if TYPE_CHECKING:
    from epl.plugin_api import ParallelContext
    from epl_memory.residency import JustInTimeParameters


def balanced_partition(params: Sequence[nn.Parameter], parts: int) -> list[list[nn.Parameter]]:
    """``params`` in ``parts`` lists of about equal element counts (largest first, to the lightest list).

    Deterministic: every device computes the same partition from the same parameter order.
    """
    order = sorted(range(len(params)), key=lambda i: (-params[i].numel(), i))
    loads = [0] * parts
    owners: list[list[int]] = [[] for _ in range(parts)]
    for index in order:
        lightest = min(range(parts), key=lambda part: (loads[part], part))
        owners[lightest].append(index)
        loads[lightest] += params[index].numel()
    return [[params[i] for i in sorted(indices)] for indices in owners]


@dataclass(frozen=True)
class Partition:
    """The copies of some parameters: who owns which, and the communicator over them."""

    communicator: Communicator
    #: For each member (communicator rank), the parameters whose optimizer state it keeps.
    owners: list[list[nn.Parameter]]

    @property
    def mine(self) -> list[nn.Parameter]:
        """The parameters this device owns."""
        return self.owners[self.communicator.rank]

    def owner_of(self) -> dict[int, int]:
        """Parameter id -> the member that owns it."""
        return {id(p): member for member, params in enumerate(self.owners) for p in params}


def partitions_over(
    communicators: Mapping[tuple[int, ...], Communicator], groups: Mapping[Any, Any]
) -> list[Partition]:
    """One balanced partition per group of copies with several devices.

    ``groups`` maps each :class:`epl.placement.copies.Copies` to its tensors, as
    :meth:`ParallelContext.copies_of_tensors` returns it.
    """
    return [
        Partition(communicators[copies.devices], balanced_partition(members, len(copies.devices)))
        for copies, members in groups.items()
        if len(copies.devices) > 1
    ]


class OwnerShards:
    """Residency of ZeRO v2: a parameter's data lives on its owner; the others receive it by broadcast."""

    def __init__(self, partitions: Sequence[Partition]) -> None:
        self._where = {
            id(p): (part, member) for part in partitions for member, owned in enumerate(part.owners) for p in owned
        }

    def keeps(self, param: nn.Parameter) -> bool:
        """Whether this device owns ``param`` (or nobody else holds a copy of it)."""
        where = self._where.get(id(param))
        return where is None or where[0].communicator.rank == where[1]

    def fetch(self, params: Sequence[nn.Parameter]) -> None:
        """Broadcast ``params`` from their owners, one flat broadcast per partition and owner."""
        batches: dict[tuple[int, int], tuple[Partition, list[nn.Parameter]]] = {}
        for param in params:
            where = self._where.get(id(param))
            if where is not None:
                part, member = where
                batches.setdefault((id(part), member), (part, []))[1].append(param)
        for (_, member), (part, members) in batches.items():
            broadcast_tensors([p.data for p in members], part.communicator, src=member)

    def store(self, params: Sequence[nn.Parameter]) -> None:
        """Nothing to do: the owner's data is the parameter's value."""


class ZeroOptimizer(torch.optim.Optimizer):
    """The user's optimizer, rebuilt over this device's partition; updated parameters are broadcast by their owner.

    ``param_groups`` still lists every parameter (learning-rate schedulers change them
    as usual); their hyperparameters are copied to the partition's optimizer before each step.
    ``state_dict`` holds this device's partition.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        partitions: Sequence[Partition],
        *,
        fetched_when_used: Collection[nn.Parameter] = (),
    ) -> None:
        super().__init__([dict(group) for group in optimizer.param_groups], optimizer.defaults)
        self.partitions = list(partitions)
        #: Parameters the other copies fetch from the owner when they use them (v2): not broadcast after a step.
        #: Every other parameter's new value is (v0, v1, and v2's tied weights, which stay on every copy).
        self._fetched_when_used = {id(p) for p in fetched_when_used}
        shared = {id(p) for part in self.partitions for owners in part.owners for p in owners}
        owned = {id(p) for part in self.partitions for p in part.mine}
        self._local_groups: list[tuple[int, dict[str, Any]]] = []
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if id(p) in owned or id(p) not in shared]
            if params:
                self._local_groups.append((index, {**group_options(group), "params": params}))
        self._owned = owned | {id(p) for _, group in self._local_groups for p in group["params"]}
        kind = type(optimizer)
        accepted = inspect.signature(kind.__init__).parameters
        defaults = {key: value for key, value in optimizer.defaults.items() if key in accepted}
        try:
            self.local = kind([group for _, group in self._local_groups] or [{"params": []}], **defaults)
        except Exception as exc:
            raise ConfigError(
                f"zero.level rebuilds the optimizer over each device's partition as "
                f"{kind.__name__}(param_groups, **defaults), which failed: {exc}. "
                "Use a torch.optim optimizer, or leave zero.level unset."
            ) from exc
        #: The state this device keeps: the partition optimizer's (checkpoints read and fill it).
        self.state = self.local.state

    def holds_state(self, param: nn.Parameter) -> bool:
        """Whether this device keeps ``param``'s optimizer state (it owns it, or nobody shares it)."""
        return id(param) in self._owned

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Apply the optimizer to this device's partition, then share every partition's new values."""
        for (index, _), local in zip(self._local_groups, self.local.param_groups, strict=True):
            local.update(group_options(self.param_groups[index]))
        loss = self.local.step(closure) if self._local_groups else None
        for part in self.partitions:
            for owner, params in enumerate(part.owners):
                kept = [p for p in params if id(p) not in self._fetched_when_used]
                if kept:
                    broadcast_tensors(kept, part.communicator, src=owner)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """This device's partition of the optimizer state."""
        return self.local.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned on this device."""
        self.local.load_state_dict(state_dict)


@dataclass
class ZeroState:
    """ZeRO's state in a ParallelContext: made by :class:`ZeroPartitioning`, read by :class:`ZeroStatePartition`."""

    #: The partition of the parameters over each group of copies.
    partitions: list[Partition] | None = None
    #: v2: the parameters fetched just in time.
    residency: JustInTimeParameters | None = None


class ZeroPartitioning:
    """Model transform (``zero.level``): choose each parameter's owner; from v1 on, route gradients to it.

    At v2 the other copies also release the parameters' data until they are used.
    It runs after every transform that replaces or moves parameters.
    """

    name = "zero_partitioning"
    phase = TransformPhase.PARTITION_PARAMETERS

    def __call__(self, model: nn.Module, context: ParallelContext) -> nn.Module:
        """Partition ``model``'s parameters over their copies; record it in ``context``; return ``model``."""
        level = context.config["zero.level"]
        partitions = partitions_over(context.copy_communicators(), context.copies_of_tensors(list(model.parameters())))
        state = context.state(ZeroState)
        state.partitions = partitions
        if level in ("v1", "v2"):
            for part in partitions:
                context.gradient_owners.update(part.owner_of())
        if level == "v2":
            from epl_memory.residency import JustInTimeParameters, stage_entries

            moving = JustInTimeParameters(model, OwnerShards(partitions), stage_entries(model, context))
            moving.release_all()
            state.residency = moving
        return model


class ZeroStatePartition:
    """Optimizer wrapper (``zero.level``): each copy keeps the optimizer state of the parameters it owns."""

    name = "zero_state_partition"
    phase = WrapperPhase.PARTITION_OPTIMIZER

    def __call__(self, optimizer: torch.optim.Optimizer, context: ParallelContext) -> torch.optim.Optimizer:
        """Rebuild ``optimizer`` over this device's partition (made by :class:`ZeroPartitioning`)."""
        state = context.state(ZeroState)
        assert state.partitions is not None, "ZeroPartitioning (a model transform) runs before the optimizer"
        moving = state.residency
        fetched = moving.params if moving is not None else ()
        zero = ZeroOptimizer(optimizer, state.partitions, fetched_when_used=fetched)
        if moving is not None:  # what a step fetched but no gradient released (frozen or unused parameters)
            zero.register_step_post_hook(lambda *_: moving.release_all())
        return zero
