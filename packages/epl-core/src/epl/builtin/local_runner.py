"""The core's step runner: forward, backward and update in this process, micro-batches as gradient accumulation."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Self

import torch
from torch import nn

from epl.errors import EplError
from epl.plugins.context import CarriesNonFiniteVerdict, GradientReducer, LossFn, LossScaler, ParallelContext
from epl.runtime.batch import call_model, micro_batches, to_device
from epl.runtime.loss import compute_loss
from epl.runtime.nonfinite import NonFiniteCheck, NonFiniteVerdict
from epl.sharding.data_shards import micro_batch_listeners, step_end_listeners
from epl.sharding.norms import clip_grad_norm

ForwardContext = Callable[[], contextlib.AbstractContextManager[Any]]


#: What :func:`inside` returns when there is nothing to enter (reusable: it holds no state).
_NOTHING = contextlib.nullcontext()


def inside(forward_contexts: Sequence[ForwardContext]) -> contextlib.AbstractContextManager[None]:
    """Enter every one of ``forward_contexts`` (e.g. AMP's autocast) for a forward and its loss.

    Without any (no AMP), a shared no-op: a forward then builds no context managers per micro-batch.
    """
    return _entered(forward_contexts) if forward_contexts else _NOTHING


@contextlib.contextmanager
def _entered(forward_contexts: Sequence[ForwardContext]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for enter in forward_contexts:
            stack.enter_context(enter())
        yield


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


class LocalStepRunner:
    """Runs a one-stage plan: ``num_micro_batch`` forward/backward passes, then one optimizer step.

    Between the last backward and the update, the gradient reducer (data parallelism)
    finishes and gradients are clipped to ``optimizer.max_grad_norm`` if set.

    The forward and the loss run inside ``forward_contexts`` (AMP's autocast), the
    backward outside them. With a loss scaler (AMP), each loss is scaled before its
    backward, the gradients are unscaled once, before clipping (which the reducer may
    call before or after its reduction) or else after the reduction. The update is
    skipped (gradients dropped) on every rank when any rank's loss or gradients are not
    finite (``nonfinite``, :mod:`epl.runtime.nonfinite`; the loss scaler's check folded in).

    Each micro-batch's loss is divided by the number of micro-batches before its
    backward, so the accumulated gradients are those of the mean loss over the
    whole batch; the returned loss is the mean of the micro-batch losses.
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        loss_fn: LossFn | None,
        num_micro_batch: int,
        device: torch.device,
        gradient_reducer: GradientReducer | None = None,
        max_grad_norm: float | None = None,
        loss_scaler: LossScaler | None = None,
        forward_contexts: Sequence[ForwardContext] = (),
        nonfinite: NonFiniteCheck | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.num_micro_batch = num_micro_batch
        self.device = device
        self.gradient_reducer = gradient_reducer
        self.max_grad_norm = max_grad_norm
        self.loss_scaler = loss_scaler
        self.forward_contexts = list(forward_contexts)
        #: Decides with every rank whether each step's update is applied (None: the loss scaler alone decides).
        self.nonfinite = nonfinite
        #: The reducer, when it can carry the non-finite verdict (plain data parallelism; see its docs).
        self._verdicts = gradient_reducer if isinstance(gradient_reducer, CarriesNonFiniteVerdict) else None
        self._grad_norm: torch.Tensor | None = None
        #: What is told before each micro-batch (ZeRO v0 reduces in the last; offload sums gradients meanwhile).
        self._listeners = micro_batch_listeners(model) if num_micro_batch > 1 else []
        #: What is told once a step's last backward has run (see ``listen_to_step_ends``).
        self._step_ends = step_end_listeners(model)

    @property
    def grad_norm(self) -> float | None:
        """The total gradient norm before clipping of the last step (None without ``optimizer.max_grad_norm``)."""
        return None if self._grad_norm is None else float(self._grad_norm)

    @classmethod
    def from_context(cls, context: ParallelContext, **extra: Any) -> Self:
        """The runner for the model, optimizer and loss of ``context`` (``extra``: a subclass's arguments)."""
        return cls(
            **extra,
            model=context.model,
            optimizer=context.optimizer,
            loss_fn=context.loss_fn,
            num_micro_batch=context.plan.num_micro_batch,
            device=context.cluster.device,
            gradient_reducer=context.gradient_reducer,
            max_grad_norm=context.config["optimizer.max_grad_norm"],
            loss_scaler=context.loss_scaler,
            forward_contexts=context.forward_contexts,
            nonfinite=NonFiniteCheck.from_context(context),
        )

    def step(self, inputs: Any, targets: Any = None) -> torch.Tensor:
        """Train on one batch; return its mean loss, detached."""
        if self.optimizer is None:
            raise EplError("Engine.step needs an optimizer: pass optimizer=... to epl.parallelize().")
        inputs, targets = to_device(inputs, self.device), to_device(targets, self.device)
        self.optimizer.zero_grad(set_to_none=True)
        self._grad_norm = None
        if self.gradient_reducer is not None:
            self.gradient_reducer.start()
        if self.loss_scaler is not None:
            self.loss_scaler.start()
        parts = self.num_micro_batch
        if parts == 1:
            loss = self.loss(inputs, targets)
            self.backward(loss)
            self.finish_gradients()
            self.update(loss.detach())
            return loss.detach()
        losses = []
        pieces = list(micro_batches(inputs, targets, parts))
        for index, (micro_inputs, micro_targets) in enumerate(pieces):
            for listener in self._listeners:
                listener(index, len(pieces))
            loss = self.loss(micro_inputs, micro_targets)
            self.backward(loss / parts)
            losses.append(loss.detach())
        self.finish_gradients()
        mean = torch.stack(losses).mean()
        self.update(mean)
        return mean

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` (multiplied by the loss scale under AMP)."""
        if self._verdicts is not None and self.nonfinite is not None:
            self._verdicts.observe_loss(loss)
        (loss if self.loss_scaler is None else self.loss_scaler.scale_loss(loss)).backward()

    def update(self, loss: torch.Tensor | None = None) -> bool:
        """The optimizer step, unless some rank's loss (``loss``: this rank's) or gradients are not finite (then
        none, on every rank); True: applied."""
        assert self.optimizer is not None
        return step_or_skip(
            self.optimizer,
            self.loss_scaler,
            self.model.parameters(),
            check=self.nonfinite,
            loss=loss,
            grad_norm=self._grad_norm,
            verdict=self._verdicts.nonfinite_verdict() if self._verdicts is not None else None,
        )

    def finish_gradients(self) -> None:
        """Reduce gradients over parameter copies (if any), clip them (if configured) and unscale them (AMP)."""
        for listener in self._step_ends:
            listener()
        clip = self.clip_gradients if self.max_grad_norm is not None else None
        if self.gradient_reducer is not None:
            self.gradient_reducer.finish(clip)
        elif clip is not None:
            clip()
        if self.loss_scaler is not None:
            self.loss_scaler.unscale(self.model.parameters())  # nothing left to do when clipping unscaled them

    def clip_gradients(self) -> None:
        """Scale the gradients so that their total 2-norm is at most ``optimizer.max_grad_norm``; keep the norm.

        The norm is the whole model's (a split tensor's shards counted once over their shard group,
        :mod:`epl.sharding.norms`), of the reduced gradient or, when clipping comes before the
        data-parallel reduction, of the gradient of this rank's rows.
        """
        assert self.max_grad_norm is not None
        if self.loss_scaler is not None:
            self.loss_scaler.unscale(self.model.parameters())  # clip the true gradients
        self._grad_norm = clip_grad_norm(self.model.parameters(), self.max_grad_norm).detach()

    @torch.no_grad()
    def evaluate(self, inputs: Any, targets: Any = None) -> torch.Tensor:
        """The loss of one batch, without gradients, touching neither gradients nor optimizer state."""
        inputs, targets = to_device(inputs, self.device), to_device(targets, self.device)
        return self.loss(inputs, targets).detach()

    def loss(self, inputs: Any, targets: Any) -> torch.Tensor:
        """The scalar loss of ``inputs`` against ``targets`` (computed inside the forward contexts)."""
        with inside(self.forward_contexts):
            return compute_loss(call_model(self.model, inputs), targets, self.loss_fn)
