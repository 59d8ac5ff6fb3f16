"""What a plugin's step runner or loss scaler may offer beyond its protocol, as ``runtime_checkable`` Protocols.

The engine asks ``isinstance(runner, EvaluatingRunner)``, never ``getattr(runner, "evaluate", None)``: a capability
has one name, one signature and one docstring here, and a plugin's object has it by having the methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from torch import nn


@runtime_checkable
class EvaluatingRunner(Protocol):
    """A step runner that computes a batch's loss without training (``Engine.evaluate``)."""

    def evaluate(self, inputs: Any, targets: Any = None) -> torch.Tensor:
        """The loss as ``step`` returns it, with no gradient and no update."""
        ...


@runtime_checkable
class PredictingRunner(Protocol):
    """A step runner of several stages that returns the model's outputs (``Engine.predict``)."""

    def predict(self, inputs: Any) -> Any:
        """The model's outputs on the ranks that hold them, None on the others."""
        ...


@runtime_checkable
class ClippingRunner(Protocol):
    """A step runner that clips gradients and keeps the norm it clipped (``Engine.grad_norm``)."""

    @property
    def grad_norm(self) -> float | None:
        """The last step's total gradient norm before clipping (None without ``optimizer.max_grad_norm``)."""
        ...


@runtime_checkable
class MeasurableRunner(Protocol):
    """A one-stage step runner whose loss of a batch ``Engine.memory_report(batch)`` can differentiate."""

    def loss(self, inputs: Any, targets: Any) -> torch.Tensor:
        """The loss of a batch as this rank computes it, with its autograd graph."""
        ...


@runtime_checkable
class SharingRunner(Protocol):
    """A step runner that gives each rank a part of the replica batch (data parallelism's share)."""

    def share(self, inputs: Any, targets: Any = None) -> tuple[Any, Any]:
        """The part of a replica batch a step gives this rank."""
        ...


@runtime_checkable
class ChecksNonFiniteSteps(Protocol):
    """A step runner whose every rank agrees, each step, whether the update was applied
    (:class:`epl.runtime.nonfinite.NonFiniteCheck`)."""

    nonfinite: Any


@runtime_checkable
class CountsSkippedSteps(Protocol):
    """A loss scaler that counts the updates it skipped: how the engine learns of a skip from a runner that does
    not check non-finite steps itself (the LR scheduler must not step then)."""

    @property
    def skipped_steps(self) -> int:
        """Updates skipped so far."""
        ...


@runtime_checkable
class FoldingLossScaler(Protocol):
    """A loss scaler that hands its local finding to the runner's check of non-finite steps and takes the
    verdict, instead of deciding with a collective of its own."""

    def found_nonfinite(self, params: Iterable[nn.Parameter]) -> torch.Tensor:
        """This rank's finding: above 0 when a gradient was not finite (no collective)."""
        ...

    def record(self, finite: bool) -> bool:
        """Adjust the scale by every rank's verdict; True: the update is applied."""
        ...
