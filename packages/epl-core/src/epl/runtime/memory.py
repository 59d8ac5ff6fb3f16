"""``Engine.memory_report``: the bytes a rank holds, counted from its tensors, and its activations, measured."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class MemoryReport:
    """Bytes on this rank: parameters, gradients and optimizer states exactly; activations as measured.

    ``activation_peak_bytes`` is the peak of what autograd saved for backward during one
    forward and backward of the batch given to :meth:`Engine.memory_report` (None without one).
    """

    rank: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    activation_peak_bytes: int | None = None

    @property
    def total_bytes(self) -> int:
        """Everything above."""
        return sum(
            (self.parameter_bytes, self.gradient_bytes, self.optimizer_state_bytes, self.activation_peak_bytes or 0)
        )

    def __str__(self) -> str:
        def mib(value: int | None) -> str:
            return "not measured" if value is None else f"{value / 2**20:.2f} MiB"

        return (
            f"rank {self.rank}: parameters {mib(self.parameter_bytes)}, gradients {mib(self.gradient_bytes)}, "
            f"optimizer states {mib(self.optimizer_state_bytes)}, activations (peak) {mib(self.activation_peak_bytes)}"
        )


def tensor_bytes(tensors: Any) -> int:
    """Bytes of ``tensors``, each storage counted once."""
    storages: dict[int, int] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and not tensor.is_sparse:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of the optimizer's state tensors, leaving out scalars such as step counters.

    A wrapper that keeps the state elsewhere (ZeRO's partition optimizer) exposes it as ``state``.
    """
    if optimizer is None:
        return 0
    from epl.sharding.data_shards import local_tensor

    return tensor_bytes(
        local_tensor(value)
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    )


def parameter_and_gradient_bytes(model: nn.Module) -> tuple[int, int]:
    """Bytes of the model's parameters, and of their gradients where they exist (ZeRO's: this rank's chunks)."""
    from epl.sharding.data_shards import local_tensor

    params = list(model.parameters())
    return tensor_bytes(local_tensor(p) for p in params), tensor_bytes(
        local_tensor(p.grad) for p in params if p.grad is not None
    )
