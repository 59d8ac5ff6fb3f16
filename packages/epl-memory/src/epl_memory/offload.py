"""Offload v0: weights live in host memory and visit the device only while a block uses them.

Each parameter's home is a (pinned, on CUDA) host copy. Before a block's forward, and
again before its backward, its parameters are copied to the device; afterwards the
device copy is freed. The optimizer steps with every parameter on the device, and the
new values go home. Gradients stay on the device.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from epl.plugin_api import TransformPhase, WrapperPhase
from epl_memory.residency import JustInTimeParameters

if TYPE_CHECKING:
    from epl.plugin_api import ParallelContext

_log = logging.getLogger("epl.memory")


#: What ``offload.level`` does on a process without an accelerator.
CPU_NOTE = (
    "offload.level 'v0' keeps weights in host memory and moves each to the accelerator just in time; this "
    "process runs on the CPU, where the weights already are in host memory, so offloading changes nothing here."
)


class HostCopies:
    """Residency of offload v0: every parameter's value is kept in host memory."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        pin = any(p.device.type == "cuda" for p in params)
        self.home = {id(p): _host_copy(p, pin) for p in params}

    def keeps(self, param: nn.Parameter) -> bool:
        """Parameters with a home copy are released from the device between uses."""
        return id(param) not in self.home

    def fetch(self, params: Sequence[nn.Parameter]) -> None:
        """Copy ``params`` from host memory to the device."""
        for param in params:
            home = self.home.get(id(param))
            if home is not None:
                param.data.copy_(home, non_blocking=True)

    def store(self, params: Sequence[nn.Parameter]) -> None:
        """Copy ``params``' device values home (they must be fetched)."""
        for param in params:
            home = self.home.get(id(param))
            if home is not None:
                home.copy_(param.data, non_blocking=False)

    def host_bytes(self) -> int:
        """Bytes of the host copies."""
        return sum(copy.numel() * copy.element_size() for copy in self.home.values())


def offload_parameters(model: nn.Module, entries: Sequence[nn.Module] = ()) -> JustInTimeParameters:
    """Keep ``model``'s parameters in host memory and fetch them just in time; return the hooks' owner.

    ``entries``: modules called directly instead of ``model`` (pipeline stage roots).
    """
    residency = HostCopies(list(model.parameters()))
    moving = JustInTimeParameters(model, residency, entries)
    moving.release_all()
    return moving


def step_with_parameters_fetched(optimizer: torch.optim.Optimizer, moving: JustInTimeParameters) -> None:
    """Make every ``optimizer.step`` run with the parameters on the device, and send the new values home."""

    def before(*_: object) -> None:
        moving.fetch_all()

    def after(*_: object) -> None:
        moving.store_all()
        moving.release_all()

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)


def _host_copy(param: nn.Parameter, pin: bool) -> torch.Tensor:
    copy = param.detach().to("cpu", copy=True)
    return copy.pin_memory() if pin else copy


@dataclass
class OffloadState:
    """Offload's state in a ParallelContext: made by :class:`OffloadWeights`, read by :class:`OffloadStep`."""

    #: This device's weights, kept in host memory and fetched while used (None on a CPU device: nothing moves).
    moving: JustInTimeParameters | None = None


class OffloadWeights:
    """Model transform (``offload.level = v0``): weights in host memory, on the device only while used."""

    name = "offload_weights"
    phase = TransformPhase.OFFLOAD

    def __call__(self, model: nn.Module, context: ParallelContext) -> nn.Module:
        """Move ``model``'s weights home and install the just-in-time hooks (on a CPU: say why nothing moves)."""
        if context.cluster.device.type == "cpu":
            _log.warning(CPU_NOTE)
            return model
        from epl_memory.residency import stage_entries

        context.state(OffloadState).moving = offload_parameters(model, stage_entries(model, context))
        return model


class OffloadStep:
    """Optimizer wrapper (``offload.level = v0``): the update runs with the weights fetched, then sends them home."""

    name = "offload_step"
    phase = WrapperPhase.OFFLOAD

    def __call__(self, optimizer: torch.optim.Optimizer, context: ParallelContext) -> torch.optim.Optimizer:
        """Add the fetch and store around ``optimizer.step``; return ``optimizer``."""
        moving = context.state(OffloadState).moving
        if moving is not None:
            step_with_parameters_fetched(optimizer, moving)
        return optimizer
