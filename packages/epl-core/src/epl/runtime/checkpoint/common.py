"""What the checkpoint modules share: the engine they save and load, its collective timeout, error text."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch import nn

from epl.interfaces.facts import Communication

if TYPE_CHECKING:
    from epl.placement.plan import Plan
    from epl.plugins.context import LossScaler, ParallelContext


class CheckpointedEngine(Protocol):
    """What saving and loading read and restore of :class:`epl.runtime.engine.Engine` (which calls them)."""

    #: The version of the state :meth:`load_state_dict` reads.
    STATE_VERSION: ClassVar[int]
    global_step: int
    context: ParallelContext

    @property
    def skipped_steps(self) -> int:
        """Steps whose update was skipped (non-finite), kept across a save and load."""
        ...

    @property
    def model(self) -> nn.Module:
        """This rank's model."""
        ...

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """This rank's optimizer."""
        ...

    @property
    def loss_scaler(self) -> LossScaler | None:
        """The loss scaler (AMP), if any."""
        ...

    @property
    def plan(self) -> Plan:
        """The Plan the engine runs."""
        ...

    @property
    def lr_scheduler(self) -> Any:
        """The LR scheduler the engine steps, if any."""
        ...

    def state_dict(self, *, full: bool = False) -> dict[str, Any]:
        """The engine's state (``full``: whole tensors gathered from shards)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        ...


def timeout(engine: CheckpointedEngine) -> float:
    """``communication.timeout``: how long a checkpoint collective, or a wait for a background save, may take."""
    return engine.context.facts(Communication).timeout_s


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message (its type's name when it has none)."""
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def few(items: list[str], count: int = 5) -> str:
    """The first ``count`` of ``items``, and how many more there are."""
    return ", ".join(items[:count]) + (f" and {len(items) - count} more" if len(items) > count else "")
