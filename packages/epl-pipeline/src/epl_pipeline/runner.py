"""The pipeline executor: runs any schedule of forwards and backwards, with the sends and receives between stages."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from epl.comm.protocol import Communicator, Work
from epl.engine.batch import call_model, split_batch, to_device
from epl.engine.extensions import GradientReducer, LossFn
from epl.errors import EplError
from epl.schedule import ActionKind, Schedule
from epl_pipeline.stages import StageDone

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
#: Header of an activation: dtype code, number of dimensions, then the sizes.
_HEADER = 8


class PipelineStepRunner:
    """Runs this rank's stage of one replica batch by the schedule's actions."""

    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        loss_fn: LossFn | None,
        schedule: Schedule,
        stage: int,
        num_stages: int,
        num_micro_batch: int,
        world: Communicator,
        previous_rank: int | None,
        next_rank: int | None,
        replica: Communicator,
        last_stage_member: int,
        device: torch.device,
        gradient_reducer: GradientReducer | None,
    ) -> None:
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.actions = schedule[stage]
        self.stage, self.num_stages, self.num_micro_batch = stage, num_stages, num_micro_batch
        self.world, self.previous_rank, self.next_rank = world, previous_rank, next_rank
        self.replica, self.last_stage_member = replica, last_stage_member
        self.device, self.gradient_reducer = device, gradient_reducer
        self._inputs: dict[int, torch.Tensor] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._losses: dict[int, torch.Tensor] = {}
        self._sends: list[tuple[Work, torch.Tensor]] = []
        self._micro_batch = 0

    @property
    def last(self) -> bool:
        """Whether this rank runs the last stage (which computes the loss)."""
        return self.stage == self.num_stages - 1

    # -- called by the stage proxies -----------------------------------------------------
    def receive(self, stage: int) -> torch.Tensor:
        """This micro-batch's input from the previous stage, as a leaf that collects its gradient."""
        assert self.previous_rank is not None
        header = torch.empty(_HEADER, dtype=torch.int64)
        self.world.recv(header, self.previous_rank).wait()
        dtype, ndim = _DTYPES[int(header[0])], int(header[1])
        tensor = torch.empty([int(d) for d in header[2 : 2 + ndim]], dtype=dtype, device=self.device)
        self.world.recv(tensor, self.previous_rank).wait()
        tensor.requires_grad_(True)
        self._inputs[self._micro_batch] = tensor
        return tensor

    def send(self, output: torch.Tensor) -> None:
        """Send this micro-batch's output to the next stage (kept for its backward)."""
        assert self.next_rank is not None
        if output.dtype not in _DTYPES or output.dim() > _HEADER - 2:
            raise EplError(
                f"Pipeline stages pass floating tensors of at most {_HEADER - 2} dimensions, "
                f"got {output.dtype} {list(output.shape)}."
            )
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[1] = _DTYPES.index(output.dtype), output.dim()
        header[2 : 2 + output.dim()] = torch.tensor(output.shape)
        data = output.detach().contiguous()
        self._sends += [
            (self.world.send(header, self.next_rank), header),
            (self.world.send(data, self.next_rank), data),
        ]
        self._outputs[self._micro_batch] = output

    # -- one step ------------------------------------------------------------------------
    def step(self, inputs: Any, targets: Any = None) -> torch.Tensor:
        """Train on one replica batch; return the replica's mean loss (the same on every stage)."""
        if self.optimizer is None:
            raise EplError("Engine.step needs an optimizer: pass optimizer=... to epl.parallelize().")
        inputs, targets = to_device(inputs, self.device), to_device(targets, self.device)
        what = f"pipeline.num_micro_batch={self.num_micro_batch}"
        micro_inputs = split_batch(inputs, self.num_micro_batch, what=what)
        micro_targets = split_batch(targets, self.num_micro_batch, what=what) if targets is not None else None
        self.optimizer.zero_grad(set_to_none=True)
        if self.gradient_reducer is not None:
            self.gradient_reducer.start()
        for action in self.actions:
            if action is None:
                continue
            if action.kind is ActionKind.FORWARD:
                self._forward(action.micro_batch, micro_inputs, micro_targets)
            else:
                self._backward(action.micro_batch)
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        if self.gradient_reducer is not None:
            self.gradient_reducer.finish(None)
        self.optimizer.step()
        loss = (
            torch.stack([self._losses[m] for m in range(self.num_micro_batch)]).mean() if self.last else torch.zeros(())
        )
        self._losses.clear()
        loss = loss.to(torch.float64)
        self.replica.broadcast(loss, self.last_stage_member).wait()
        return loss

    def _forward(self, m: int, micro_inputs: list[Any], micro_targets: list[Any] | None) -> None:
        self._micro_batch = m
        try:
            output = call_model(self.model, micro_inputs[m])
        except StageDone:
            return
        if self.loss_fn is None:
            loss = output
        else:
            loss = self.loss_fn(output, micro_targets[m]) if micro_targets is not None else self.loss_fn(output)
        self._losses[m] = loss
        self._outputs[m] = loss

    def _backward(self, m: int) -> None:
        output = self._outputs.pop(m)
        if self.last:
            (output / self.num_micro_batch).backward()
            self._losses[m] = self._losses[m].detach()
        else:
            assert self.next_rank is not None
            grad = torch.empty_like(output)
            self.world.recv(grad, self.next_rank).wait()
            output.backward(grad)
        if self.stage > 0:
            assert self.previous_rank is not None
            received = self._inputs.pop(m)
            grad_in = received.grad if received.grad is not None else torch.zeros_like(received)
            self._sends.append((self.world.send(grad_in, self.previous_rank), grad_in))
