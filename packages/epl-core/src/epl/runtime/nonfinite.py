"""Non-finite steps: an update is applied only when every rank of the job saw a finite loss and finite gradients.

Once a step's gradients are complete (reduced, clipped, unscaled), each rank folds what it already knows into two
flags: its loss was not finite (any micro-batch's; on a pipeline, the last stage's), and its gradients were not
finite, read from what already went over them: AMP's loss scaler (it checks every gradient as it unscales it),
the norm ``optimizer.max_grad_norm`` computes, or else one pass over this rank's gradients
(``optimizer.check_finite_gradients``). One all-gather of those two numbers over every rank of the job (the world
communicator: every replica, stage and shard) decides for all of them: every rank applies the update, or every
rank skips it, its gradients dropped, its weights and optimizer state untouched, and the LR scheduler not stepped.

Where the gradient reduction already reaches every rank with every trainable parameter (plain data parallelism),
it carries the verdict instead (:class:`NonFiniteVerdict`): a rank whose loss was not finite puts a NaN into its
last bucket, and the averaged gradients, the same on every rank, are checked by the mean's division. No collective
is added then (but on a skipped step, to name the ranks whose loss was not finite), and no extra pass over the
gradients.
With epl-memory's loss scaler the same all-gather replaces the scaler's own all-reduce, and the scaler then adjusts
its scale by what the ranks found. The gathered flags say which ranks saw what, so an error can name them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from epl.config.settings import CoreSettings
from epl.interfaces.communicator import Communicator
from epl.interfaces.nonfinite_verdict import NonFiniteVerdict
from epl.sharding.data_shards import local_tensor
from epl.torch_private import foreach_norm

__all__ = ["NonFiniteCheck", "NonFiniteVerdict", "StepOutcome", "nonfinite_gradients"]

if TYPE_CHECKING:
    from typing_extensions import TypeIs

    from epl.plugins.capabilities import FoldingLossScaler
    from epl.plugins.context import LossScaler, ParallelContext


@dataclass(frozen=True)
class StepOutcome:
    """Whether a step's update was applied, and the ranks (global) that found its loss or gradients not finite."""

    applied: bool
    #: Ranks whose loss was NaN or Inf.
    loss_ranks: tuple[int, ...] = ()
    #: Ranks whose gradients held a NaN or Inf (or, through their norm, were too large to measure).
    gradient_ranks: tuple[int, ...] = ()
    #: A loss scaler that decides alone (a plugin's, without ``found_nonfinite``) found a non-finite gradient.
    scaler_skipped: bool = False
    #: The gradients averaged over every rank held a NaN or Inf (found by the reduction: which rank's is unknown).
    averaged_gradients: bool = False

    def describe(self) -> str:
        """What was not finite, where: ``"the loss on rank 1; the gradients on ranks 0, 1"``."""
        parts = []
        if self.loss_ranks:
            parts.append(f"the loss on {_ranks(self.loss_ranks)}")
        if self.gradient_ranks:
            parts.append(f"the gradients on {_ranks(self.gradient_ranks)}")
        if self.averaged_gradients:
            parts.append("the gradients averaged over every rank")
        if self.scaler_skipped:
            parts.append("a gradient (found by the loss scaler)")
        return "; ".join(parts) or "nothing"


class NonFiniteCheck:
    """Decides, with every rank of the job, whether this step's update is applied (see the module doc).

    ``communicator``: every rank of the job (None or one member: this process alone); ``device``: where the flags
    are gathered (the communicator's device); ``check_gradients``: read the gradients when nothing else did (no
    loss scaler, no clipping norm). :attr:`last` is the outcome of the latest step (None before one).
    """

    def __init__(
        self, communicator: Communicator | None, device: torch.device, *, check_gradients: bool = True
    ) -> None:
        self.communicator = communicator if communicator is not None and communicator.world_size > 1 else None
        #: The global ranks whose flags :meth:`decide` gathers, in the communicator's order.
        self.ranks: tuple[int, ...] = tuple(communicator.ranks) if communicator is not None else (0,)
        self.device = device
        self.check_gradients = check_gradients
        self.last: StepOutcome | None = None

    @classmethod
    def from_context(cls, context: ParallelContext) -> NonFiniteCheck:
        """The check of ``context``'s job: its world communicator, its device, ``optimizer.check_finite_gradients``."""
        return cls(
            context.communicator,
            context.cluster.device,
            check_gradients=CoreSettings.from_config(context.config).optimizer.check_finite_gradients,
        )

    @torch.no_grad()
    def decide(
        self,
        params: Iterable[nn.Parameter],
        *,
        loss: torch.Tensor | None = None,
        grad_norm: torch.Tensor | None = None,
        loss_scaler: LossScaler | None = None,
        verdict: NonFiniteVerdict | None = None,
    ) -> StepOutcome:
        """Agree with every rank whether this step's update is applied; a collective of every rank of the job.

        ``loss``: this rank's loss of the step (None where it has none: a pipeline stage before the last);
        ``grad_norm``: the norm clipping computed this step (None: not clipped); ``loss_scaler``: AMP's, whose
        check of the gradients is folded into this one when it has ``found_nonfinite`` and ``record`` (epl-memory's),
        and which otherwise decides alone (its ``update``) before this check; ``verdict``: the gradient reduction's,
        which covers every rank (then no collective here unless the step is skipped, and ``grad_norm`` is not read).
        """
        params = list(params)
        if verdict is not None:
            return self._adopt(verdict, params, loss, loss_scaler)
        scaler_skipped = False
        gradients: list[torch.Tensor] = []
        folded = loss_scaler if _folds(loss_scaler) else None
        if folded is not None:
            gradients.append(folded.found_nonfinite(params))
        elif loss_scaler is not None:
            scaler_skipped = not loss_scaler.update(params)
        if grad_norm is not None:
            gradients.append(~torch.isfinite(grad_norm))
        elif loss_scaler is None and self.check_gradients:
            gradients.append(nonfinite_gradients(params, self.device))
        flags = torch.zeros(2, dtype=torch.float32, device=self.device)
        if loss is not None:
            flags[0] = (~torch.isfinite(loss.detach())).any().to(self.device)
        for flag in gradients:
            flags[1] += flag.to(device=self.device, dtype=torch.float32)
        rows, ranks = self._gather(flags)
        outcome = StepOutcome(
            applied=not scaler_skipped and not any(row[0] or row[1] for row in rows),
            loss_ranks=tuple(rank for rank, row in zip(ranks, rows, strict=True) if row[0]),
            gradient_ranks=tuple(rank for rank, row in zip(ranks, rows, strict=True) if row[1]),
            scaler_skipped=scaler_skipped,
        )
        if folded is not None:
            folded.record(not outcome.gradient_ranks)
        self.last = outcome
        return outcome

    def _adopt(
        self,
        verdict: NonFiniteVerdict,
        params: list[nn.Parameter],
        loss: torch.Tensor | None,
        loss_scaler: LossScaler | None,
    ) -> StepOutcome:
        """The outcome the gradient reduction's ``verdict`` gives: every rank reads the same number, so no
        collective, except on a skip, where every rank gathers whose loss was not finite so the warning names them."""
        scaler_skipped = False
        if _folds(loss_scaler):
            loss_scaler.found_nonfinite(params)  # unscales; the verdict covers its find
        elif loss_scaler is not None:
            scaler_skipped = not loss_scaler.update(params)
        found = bool(verdict.found.item() > 0)
        loss_ranks: tuple[int, ...] = ()
        if found:
            flags = torch.zeros(2, dtype=torch.float32, device=self.device)
            if loss is not None:
                flags[0] = (~torch.isfinite(loss.detach())).any().to(self.device)
            rows, ranks = self._gather(flags)
            loss_ranks = tuple(rank for rank, row in zip(ranks, rows, strict=True) if row[0])
        outcome = StepOutcome(
            applied=not (scaler_skipped or found),
            loss_ranks=loss_ranks,
            scaler_skipped=scaler_skipped,
            averaged_gradients=found and not loss_ranks,
        )
        if _folds(loss_scaler):
            loss_scaler.record(not found)
        self.last = outcome
        return outcome

    def _gather(self, flags: torch.Tensor) -> tuple[list[list[float]], tuple[int, ...]]:
        """Every rank's two flags (one all-gather; read on the host) and the ranks they belong to."""
        if self.communicator is None:
            return [flags.tolist()], self.ranks
        everyone = torch.zeros(2 * self.communicator.world_size, dtype=flags.dtype, device=flags.device)
        self.communicator.all_gather(everyone, flags).wait()
        return everyone.view(-1, 2).tolist(), self.ranks


@torch.no_grad()
def nonfinite_gradients(params: Iterable[nn.Parameter], device: torch.device) -> torch.Tensor:
    """1.0 (float32, on ``device``) when a gradient of ``params`` holds a NaN or Inf, else 0.0; no host sync.

    One read of every gradient: on a CPU each one summed (the cheapest full read there; low-precision ones in float32,
    and a sum past the float range counts as not finite), elsewhere the largest magnitude of each, by one fused
    kernel.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        grad = local_tensor(grad)  # ZeRO's chunk: the other chunks are checked by their ranks
        if grad.is_sparse:
            grad = grad._values()
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    found = torch.zeros((), dtype=torch.bool, device=device)
    for (where, dtype), grads in groups.items():
        if where.type == "cpu":
            wide = dtype if dtype in (torch.float32, torch.float64) else torch.float32
            partial = torch.stack([grad.sum(dtype=wide) for grad in grads])
        else:
            partial = torch.stack(foreach_norm(grads, float("inf")))  # the largest |value|: NaN and Inf kept
        found = found | (~torch.isfinite(partial)).any().to(device)
    return found.to(torch.float32)


def _folds(scaler: Any) -> TypeIs[FoldingLossScaler]:
    """Whether ``scaler`` hands its local finding to this check (``found_nonfinite``) and takes the verdict
    (``record``), instead of deciding with a collective of its own."""
    from epl.plugins.capabilities import FoldingLossScaler

    return isinstance(scaler, FoldingLossScaler)


def _ranks(ranks: tuple[int, ...]) -> str:
    """``rank 1`` or ``ranks 0, 1``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(rank) for rank in ranks)
