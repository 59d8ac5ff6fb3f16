"""ZeRO v0: each copy of a parameter group keeps the optimizer state of its own partition only.

Gradients are reduced as in plain data parallelism (every copy holds the whole
gradient); then each device applies the optimizer to the parameters it owns and
broadcasts them to the other copies. With N copies, an Adam state costs 8Ψ/N bytes
per device instead of 8Ψ (Ψ: parameters of the group).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from epl.comm.broadcast import broadcast_tensors
from epl.comm.protocol import Communicator
from epl.errors import ConfigError


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


class ZeroOptimizer(torch.optim.Optimizer):
    """The user's optimizer, rebuilt over this device's partition; updated parameters are broadcast by their owner.

    ``param_groups`` still lists every parameter (learning-rate schedulers change them
    as usual); their hyperparameters are copied to the partition's optimizer before each step.
    ``state_dict`` holds this device's partition.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, partitions: Sequence[Partition]) -> None:
        super().__init__([dict(group) for group in optimizer.param_groups], optimizer.defaults)
        self.partitions = list(partitions)
        shared = {id(p) for part in self.partitions for owners in part.owners for p in owners}
        owned = {id(p) for part in self.partitions for p in part.mine}
        self._local_groups: list[tuple[int, dict[str, Any]]] = []
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if id(p) in owned or id(p) not in shared]
            if params:
                self._local_groups.append((index, {**_options(group), "params": params}))
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

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Apply the optimizer to this device's partition, then share every partition's new values."""
        for (index, _), local in zip(self._local_groups, self.local.param_groups, strict=True):
            local.update(_options(self.param_groups[index]))
        loss = self.local.step(closure) if self._local_groups else None
        for part in self.partitions:
            for owner, params in enumerate(part.owners):
                broadcast_tensors(params, part.communicator, src=owner)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """This device's partition of the optimizer state."""
        return self.local.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned on this device."""
        self.local.load_state_dict(state_dict)

    def state_bytes(self) -> int:
        """Bytes of the optimizer state this device keeps: its state tensors, not the scalar step counters."""
        return sum(
            value.numel() * value.element_size()
            for state in self.local.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor) and value.dim() > 0
        )


def _options(group: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}
