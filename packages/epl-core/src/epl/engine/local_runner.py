"""The core's step runner: forward, backward and update in this process, micro-batches as gradient accumulation."""

from __future__ import annotations

from typing import Any, Self

import torch
from torch import nn

from epl.engine.batch import call_model, micro_batches, to_device
from epl.engine.extensions import GradientReducer, LossFn, ParallelContext
from epl.errors import EplError


class LocalStepRunner:
    """Runs a one-stage plan: ``num_micro_batch`` forward/backward passes, then one optimizer step.

    Between the last backward and the update, the gradient reducer (data parallelism)
    finishes and gradients are clipped to ``optimizer.max_grad_norm`` if set.

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
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.num_micro_batch = num_micro_batch
        self.device = device
        self.gradient_reducer = gradient_reducer
        self.max_grad_norm = max_grad_norm

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
        )

    def step(self, inputs: Any, targets: Any = None) -> torch.Tensor:
        """Train on one batch; return its mean loss, detached."""
        if self.optimizer is None:
            raise EplError("Engine.step needs an optimizer: pass optimizer=... to epl.parallelize().")
        inputs, targets = to_device(inputs, self.device), to_device(targets, self.device)
        self.optimizer.zero_grad(set_to_none=True)
        if self.gradient_reducer is not None:
            self.gradient_reducer.start()
        parts = self.num_micro_batch
        if parts == 1:
            loss = self.loss(inputs, targets)
            loss.backward()
            self.finish_gradients()
            self.optimizer.step()
            return loss.detach()
        losses = []
        for micro_inputs, micro_targets in micro_batches(inputs, targets, parts):
            loss = self.loss(micro_inputs, micro_targets)
            (loss / parts).backward()
            losses.append(loss.detach())
        self.finish_gradients()
        self.optimizer.step()
        return torch.stack(losses).mean()

    def finish_gradients(self) -> None:
        """Reduce gradients over parameter copies (if any) and clip them (if configured)."""
        clip = self.clip_gradients if self.max_grad_norm is not None else None
        if self.gradient_reducer is not None:
            self.gradient_reducer.finish(clip)
        elif clip is not None:
            clip()

    def clip_gradients(self) -> None:
        """Scale this rank's gradients so that their total norm is at most ``optimizer.max_grad_norm``."""
        assert self.max_grad_norm is not None
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)

    def loss(self, inputs: Any, targets: Any) -> torch.Tensor:
        """The scalar loss of ``inputs`` against ``targets``."""
        outputs = call_model(self.model, inputs)
        if self.loss_fn is None:
            if targets is not None:
                raise EplError("Engine.step got targets but epl.parallelize() had no loss_fn; pass loss_fn=... .")
            loss = outputs
        else:
            loss = self.loss_fn(outputs, targets) if targets is not None else self.loss_fn(outputs)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise EplError(f"The loss must be a scalar tensor, got {shape}. Reduce it (e.g. reduction='mean').")
        return loss
