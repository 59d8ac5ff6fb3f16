"""What the Plan says each rank would hold: :class:`MemoryEstimate`, and the :class:`EstimatedTensor` rows behind it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from epl.placement.render import format_bytes

if TYPE_CHECKING:
    import torch

#: The parameters of the shard that replaces one module: (name in the model, a tensor of the shard's
#: shape and dtype, on the ``meta`` device, whether it is a shard of a split tensor).
ShardPieces = list[tuple[str, "torch.Tensor", bool]]


class ShardShapes(Protocol):
    """What each device of the split TaskGraphs would hold, worked out without the devices (``epl_estimate_shards``)."""

    def pieces(self, taskgraph: int, position: int) -> Mapping[int, tuple[int, ShardPieces]]:
        """``id(model parameter)`` -> (a key of the module it belongs to, the parameters of that module's shard).

        For device ``position`` of split TaskGraph ``taskgraph``. Raise an :class:`~epl.errors.EplError`
        where the run would (the Plan then fails with it); any other exception when it cannot be worked
        out without the devices: the estimate then shards each parameter along dimension 0 and says so.
        """
        ...


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated bytes one rank holds during training: parameters, gradients, optimizer states.

    The same quantities as :class:`epl.runtime.memory.MemoryReport` after a step;
    activations are not estimated. ``optimizer_state_bytes`` is None when the
    optimizer's state is unknown (a class not in :data:`OPTIMIZER_STATES`).
    ``notes`` say what the numbers assume (the optimizer, a plugin's adjustment).
    """

    rank: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int | None
    notes: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int | None:
        """Parameters, gradients and optimizer states; None when the states are unknown."""
        if self.optimizer_state_bytes is None:
            return None
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes

    def __str__(self) -> str:
        states = "unknown" if self.optimizer_state_bytes is None else format_bytes(self.optimizer_state_bytes)
        return (
            f"rank {self.rank}: parameters {format_bytes(self.parameter_bytes)}, "
            f"gradients {format_bytes(self.gradient_bytes)}, optimizer states {states} (activations not estimated)"
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MemoryEstimate:
        """Rebuild an estimate from ``dataclasses.asdict`` output."""
        return cls(**{**data, "notes": tuple(data.get("notes", ()))})


@dataclass(frozen=True)
class EstimatedTensor:
    """One parameter as a rank would hold it (its shard, where a split rule shards it)."""

    #: Its name in the model (for a shard, the name in the sharded module: ``head.weight``).
    name: str
    #: The TaskGraph that holds it.
    taskgraph: int
    numel: int
    element_size: int
    requires_grad: bool
    #: A split rule's shard: each device of the split TaskGraph holds a different part.
    sharded: bool
    #: Bytes of the optimizer's state tensors shaped like it (Adam: exp_avg, exp_avg_sq), 0 when the
    #: optimizer does not hold it; None: unknown.
    state_bytes: int | None
    #: Its length along dimension 0 (what ZeRO chunks; 1 for a scalar).
    rows: int = 1

    @property
    def bytes(self) -> int:
        """Bytes of the tensor."""
        return self.numel * self.element_size

    @property
    def gradient_bytes(self) -> int:
        """Bytes of its gradient (none without ``requires_grad``)."""
        return self.bytes if self.requires_grad else 0


def distinct_notes(estimates: Iterable[MemoryEstimate]) -> list[str]:
    """The distinct notes of ``estimates``, in order."""
    return list(dict.fromkeys(note for estimate in estimates for note in estimate.notes))
