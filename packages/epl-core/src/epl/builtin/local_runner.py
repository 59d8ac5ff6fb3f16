"""The core's step runner: forward, backward and update in this process, micro-batches as gradient accumulation."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Self

import torch
from torch import nn

from epl.config.settings import CoreSettings
from epl.errors import EplError
from epl.plugins.context import CarriesNonFiniteVerdict, GradientReducer, LossFn, LossScaler, ParallelContext
from epl.runtime.batch import call_model, micro_batches, to_device
from epl.runtime.loss import compute_loss
from epl.runtime.nonfinite import NonFiniteCheck
from epl.runtime.update import StepUpdate
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


class LocalStepRunner:
    """Runs a one-stage plan: ``num_micro_batch`` forward/backward passes, then one optimizer step.

    What comes around the passes (the gradient reducer, clipping to ``optimizer.max_grad_norm``,
    AMP's loss scale, the update or its skip on every rank when some rank's loss or gradients are
    not finite) is :attr:`step_update`'s, in the order :mod:`epl.runtime.update` gives every runner.
    The forward and the loss run inside ``forward_contexts`` (AMP's autocast), the backward outside them.

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
        #: What comes around the forwards and backwards of a step, in every runner's order.
        self.step_update = StepUpdate(
            params=model.parameters,
            gradient_reducer=gradient_reducer,
            loss_scaler=loss_scaler,
            clip_norm=None if max_grad_norm is None else lambda: clip_grad_norm(model.parameters(), max_grad_norm),
            step_ends=step_end_listeners(model),  # told once a step's last backward has run (listen_to_step_ends)
            # the reducer, when it can carry the non-finite verdict (plain data parallelism; see its docs)
            verdicts=gradient_reducer if isinstance(gradient_reducer, CarriesNonFiniteVerdict) else None,
        )
        #: What is told before each micro-batch (ZeRO v0 reduces in the last; offload sums gradients meanwhile).
        self._listeners = micro_batch_listeners(model) if num_micro_batch > 1 else []

    @property
    def grad_norm(self) -> float | None:
        """The total gradient norm before clipping of the last step (None without ``optimizer.max_grad_norm``)."""
        norm = self.step_update.grad_norm
        return None if norm is None else float(norm)

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
            max_grad_norm=CoreSettings.from_config(context.config).optimizer.max_grad_norm,
            loss_scaler=context.loss_scaler,
            forward_contexts=context.forward_contexts,
            nonfinite=NonFiniteCheck.from_context(context),
        )

    def step(self, inputs: Any, targets: Any = None) -> torch.Tensor:
        """Train on one batch; return its mean loss, detached."""
        if self.optimizer is None:
            raise EplError("Engine.step needs an optimizer: pass optimizer=... to epl.parallelize().")
        inputs, targets = to_device(inputs, self.device), to_device(targets, self.device)
        return self.step_update.run(self.optimizer, lambda: self._passes(inputs, targets), check=self.nonfinite)

    def _passes(self, inputs: Any, targets: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's forwards and backwards (one per micro-batch); its mean loss, detached: what the step returns,
        and this rank's loss for the check of non-finite steps."""
        parts = self.num_micro_batch
        if parts == 1:
            loss = self.loss(inputs, targets)
            self.backward(loss)
            return loss.detach(), loss.detach()
        losses = []
        pieces = list(micro_batches(inputs, targets, parts))
        for index, (micro_inputs, micro_targets) in enumerate(pieces):
            for listener in self._listeners:
                listener(index, len(pieces))
            loss = self.loss(micro_inputs, micro_targets)
            self.backward(loss / parts)
            losses.append(loss.detach())
        mean = torch.stack(losses).mean()
        return mean, mean

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` (multiplied by the loss scale under AMP)."""
        self.step_update.scaled(loss, check=self.nonfinite).backward()

    def update(self, loss: torch.Tensor | None = None) -> bool:
        """The optimizer step, unless some rank's loss (``loss``: this rank's) or gradients are not finite (then
        none, on every rank); True: applied."""
        assert self.optimizer is not None
        return self.step_update.apply(self.optimizer, loss, check=self.nonfinite)

    def finish_gradients(self) -> None:
        """Reduce gradients over parameter copies (if any), clip them (if configured) and unscale them (AMP)."""
        self.step_update.finish_gradients()

    def clip_gradients(self) -> None:
        """Scale the gradients so that their total 2-norm is at most ``optimizer.max_grad_norm``; keep the norm.

        The norm is the whole model's (a split tensor's shards counted once over their shard group,
        :mod:`epl.sharding.norms`), of the reduced gradient or, when clipping comes before the
        data-parallel reduction, of the gradient of this rank's rows.
        """
        self.step_update.clip()

    @torch.no_grad()
    def evaluate(self, inputs: Any, targets: Any = None) -> torch.Tensor:
        """The loss of one batch, without gradients, touching neither gradients nor optimizer state."""
        inputs, targets = to_device(inputs, self.device), to_device(targets, self.device)
        return self.loss(inputs, targets).detach()

    def loss(self, inputs: Any, targets: Any) -> torch.Tensor:
        """The scalar loss of ``inputs`` against ``targets`` (computed inside the forward contexts)."""
        with inside(self.forward_contexts):
            return compute_loss(call_model(self.model, inputs), targets, self.loss_fn)
