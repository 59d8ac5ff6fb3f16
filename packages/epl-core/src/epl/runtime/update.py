"""The order of a training step around a runner's forwards and backwards, written once for every step runner.

A step runner runs its forwards and backwards its own way (micro-batches one after another, or a pipeline's
schedule); what comes around them is :class:`StepUpdate`'s, in this order (:meth:`StepUpdate.run`):

1. :meth:`~StepUpdate.begin`: the gradients are dropped (set to None), the gradient reducer and the loss scaler
   start the step;
2. the runner's passes, each loss through :meth:`~StepUpdate.scaled` before its backward (AMP's loss scale);
3. :meth:`~StepUpdate.finish_gradients`: the step-end listeners are told
   (:func:`~epl.sharding.data_shards.listen_to_step_ends`); the reducer finishes its reduction, with the gradients
   clipped before it or after it (:meth:`~StepUpdate.clip`, which unscales them first); the gradients are unscaled
   (a second unscale in a step does nothing);
4. :meth:`~StepUpdate.apply`: the optimizer steps, or every rank skips the update when some rank's loss or
   gradients are not finite (:func:`step_or_skip`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import torch
from torch import nn

from epl.plugins.context import CarriesNonFiniteVerdict, GradientReducer, LossScaler
from epl.runtime.nonfinite import NonFiniteCheck, NonFiniteVerdict

Result = TypeVar("Result")


def step_or_skip(
    optimizer: torch.optim.Optimizer,
    loss_scaler: LossScaler | None,
    params: Iterable[nn.Parameter],
    *,
    check: NonFiniteCheck | None = None,
    loss: torch.Tensor | None = None,
    grad_norm: torch.Tensor | None = None,
    verdict: NonFiniteVerdict | None = None,
) -> bool:
    """The optimizer step, unless some rank's loss or gradients are not finite (then drop them); True: applied.

    With ``check`` (the runners': :class:`~epl.runtime.nonfinite.NonFiniteCheck`) every rank of the job agrees
    from this rank's ``loss`` (None where it has none), the norm clipping computed (``grad_norm``; None: not
    clipped) and the loss scaler's check of the gradients, or from the gradient reduction's ``verdict`` when it
    carries one; without, the loss scaler alone decides (no scaler: applied). Every rank of the job reaches the
    same verdict (by a collective, or from the reduction's numbers), so all of them skip together. A skipped step
    leaves the weights and the optimizer's state as they were.
    """
    params = list(params)
    if check is not None:
        applied = check.decide(params, loss=loss, grad_norm=grad_norm, loss_scaler=loss_scaler, verdict=verdict).applied
    else:
        applied = loss_scaler is None or loss_scaler.update(params)
    if applied:
        optimizer.step()
        return True
    optimizer.zero_grad(set_to_none=True)
    for param in params:  # also those the optimizer does not hold: nothing of this step reaches the next one
        param.grad = None
    return False


class StepUpdate:
    """What comes around one step runner's forwards and backwards, in the order of the module doc.

    ``params()`` lists the parameters whose gradients are unscaled, clipped and stepped (anew at each call);
    ``clip_norm()`` scales the gradients to ``optimizer.max_grad_norm`` and returns their norm before (None: no
    clipping); ``clip_after_reduction``: clip after the reduction, whatever the reducer chooses; ``step_ends``: the
    step-end listeners (:func:`~epl.sharding.data_shards.step_end_listeners`); ``verdicts``: the gradient reducer,
    when it decides for every rank whether a step was finite (it then sees each loss in :meth:`scaled`).
    """

    def __init__(
        self,
        *,
        params: Callable[[], Iterable[nn.Parameter]],
        gradient_reducer: GradientReducer | None = None,
        loss_scaler: LossScaler | None = None,
        clip_norm: Callable[[], torch.Tensor] | None = None,
        clip_after_reduction: bool = False,
        step_ends: Sequence[Callable[[], None]] = (),
        verdicts: CarriesNonFiniteVerdict | None = None,
    ) -> None:
        self.params = params
        self.gradient_reducer = gradient_reducer
        self.loss_scaler = loss_scaler
        self.clip_norm = clip_norm
        self.clip_after_reduction = clip_after_reduction
        self.step_ends = list(step_ends)
        self.verdicts = verdicts
        #: The norm of the last step's gradients before clipping (None: not clipped).
        self.grad_norm: torch.Tensor | None = None

    def run(
        self,
        optimizer: torch.optim.Optimizer,
        passes: Callable[[], tuple[Result, torch.Tensor | None]],
        *,
        check: NonFiniteCheck | None,
    ) -> Result:
        """One training step: :meth:`begin`, the runner's ``passes`` (its forwards and backwards, returning what
        the step returns and this rank's loss for ``check``, None where it has none), :meth:`finish_gradients`,
        :meth:`apply`. Returns what ``passes`` returned first."""
        self.begin(optimizer)
        result, loss = passes()
        self.finish_gradients()
        self.apply(optimizer, loss, check=check)
        return result

    def begin(self, optimizer: torch.optim.Optimizer) -> None:
        """A step begins: drop the gradients, start the gradient reducer and the loss scaler."""
        optimizer.zero_grad(set_to_none=True)
        self.grad_norm = None
        if self.gradient_reducer is not None:
            self.gradient_reducer.start()
        if self.loss_scaler is not None:
            self.loss_scaler.start()

    def scaled(self, loss: torch.Tensor, *, check: NonFiniteCheck | None) -> torch.Tensor:
        """``loss`` as its backward takes it: multiplied by the loss scale (AMP). The reducer that decides whether
        the step was finite sees it first (when the runner checks non-finite steps: ``check``)."""
        if self.verdicts is not None and check is not None:
            self.verdicts.observe_loss(loss)
        return loss if self.loss_scaler is None else self.loss_scaler.scale_loss(loss)

    def finish_gradients(self) -> None:
        """After the step's last backward: tell the step-end listeners, complete the reduction (clipping before or
        after it), unscale the gradients."""
        for listener in self.step_ends:
            listener()
        clip = self.clip if self.clip_norm is not None else None
        if self.gradient_reducer is not None:
            self.gradient_reducer.finish(None if self.clip_after_reduction else clip)
            if self.clip_after_reduction and clip is not None:
                clip()
        elif clip is not None:
            clip()
        if self.loss_scaler is not None:
            self.loss_scaler.unscale(self.params())  # nothing left to do when clipping unscaled them

    def clip(self) -> None:
        """Unscale the gradients (AMP: clip the true ones), then scale them to the clipping norm; keep the norm."""
        assert self.clip_norm is not None, "clipping needs optimizer.max_grad_norm"
        if self.loss_scaler is not None:
            self.loss_scaler.unscale(self.params())
        self.grad_norm = self.clip_norm().detach()

    def apply(
        self, optimizer: torch.optim.Optimizer, loss: torch.Tensor | None, *, check: NonFiniteCheck | None
    ) -> bool:
        """The optimizer step, unless some rank's loss (``loss``: this rank's) or gradients are not finite (then
        none, on every rank: :func:`step_or_skip`); True: applied."""
        return step_or_skip(
            optimizer,
            self.loss_scaler,
            self.params(),
            check=check,
            loss=loss,
            grad_norm=self.grad_norm,
            verdict=self.verdicts.nonfinite_verdict() if self.verdicts is not None else None,
        )
