"""The pipeline executor: runs any schedule of forwards and backwards, with the transfers between stages."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import torch
import torch.utils._pytree as pytree
from torch import nn

from epl.plugin_api import (
    Action,
    ActionKind,
    BatchError,
    CoreSettings,
    EplError,
    ForwardContext,
    GradientReducer,
    LossFn,
    LossScaler,
    NonFiniteCheck,
    ParallelContext,
    Schedule,
    StepUpdate,
    Work,
    batch_size,
    clip_grad_norm,
    compute_loss,
    inside,
    micro_batches,
    split_batch,
    step_end_listeners,
    to_device,
)
from epl_pipeline.channel import Channel
from epl_pipeline.padding import Cut, cut, first_rows
from epl_pipeline.program import StageProgram
from epl_pipeline.resharding import Boundary, ReshardingChannel
from epl_pipeline.schedules import Event, micro_batch_order
from epl_pipeline.split_backward import PendingWeights, backward, backward_input, backward_weight
from epl_pipeline.topology import PipelineTopology, StageLink

I, W = ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT  # noqa: E741


class _StageChannels:
    """One stage's channels to its neighbours: for training, and for forward-only passes (evaluate, predict),
    whose values need no gradient and so are described apart."""

    def __init__(
        self, stage: int, previous: StageLink | None, following: StageLink | None, device: torch.device
    ) -> None:
        def channel(link: StageLink | None, what: str) -> Channel | ReshardingChannel | None:
            if isinstance(link, Boundary):
                return ReshardingChannel(link, device, what)
            return None if link is None else Channel(link.communicator, link.peer, device, what, link.gradients)

        self.inbound = channel(previous, f"The values stage {stage - 1} sends")
        self.outbound = channel(following, f"The values stage {stage} sends")
        self.eval_inbound = channel(previous, f"What stage {stage - 1} sends in engine.evaluate or predict")
        self.eval_outbound = channel(following, f"What stage {stage} sends in engine.evaluate or predict")

    def begin(self, *, training: bool) -> None:
        """Start a call on the training or the forward-only channels: the values' description may change."""
        for channel in (self.inbound, self.outbound) if training else (self.eval_inbound, self.eval_outbound):
            if channel is not None:
                channel.begin()

    def flush(self) -> None:
        """Wait for every send started on the training channels."""
        _flush(self.inbound, self.outbound)

    def flush_eval(self) -> None:
        """Wait for every send started on the forward-only channels."""
        _flush(self.eval_inbound, self.eval_outbound)


@dataclass
class _InFlight:
    """One micro-batch between its forward and its backward on this stage."""

    outputs: list[torch.Tensor]  # what the backward starts from (sent tensors needing a gradient, or the loss)
    inputs: list[torch.Tensor] = field(default_factory=list)  # received tensors that collect a gradient
    pending: PendingWeights | None = None  # between I and W (None: the first stage's W runs the whole backward)


class PipelineStepRunner:
    """Runs this rank's stages of one replica batch by the schedule's actions.

    Where this rank's stages stand (their links to the neighbouring stages' devices, the groups
    it meets in, its part of each micro-batch and of the replica's loss) is its ``topology``
    (:class:`~epl_pipeline.topology.PipelineTopology`); every micro-batch's rows must be a
    multiple of its ``rows_multiple``, and ``predict`` joins the last stage's parts.

    Each stage forward and the last stage's loss run inside ``forward_contexts`` (e.g.
    AMP's autocast), the backward outside them. What comes around the actions (the gradient
    reducer, clipping, AMP's loss scale, the update or its skip on every rank: ``nonfinite``)
    is :attr:`step_update`'s, in the order the core's ``StepUpdate`` gives every runner.
    With ``max_grad_norm`` the gradients are clipped by their 2-norm over every stage of the
    replica (the topology's ``stage_peers``) and every shard; a weight tied between stages
    (each holds a copy) is counted once, by its first stage.
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        loss_fn: LossFn | None,
        program: StageProgram,
        schedule: Schedule,
        topology: PipelineTopology,
        num_micro_batch: int,
        gradient_reducer: GradientReducer | None,
        loss_scaler: LossScaler | None = None,
        forward_contexts: Sequence[ForwardContext] = (),
        max_grad_norm: float | None = None,
        clip_after_reduction: bool = False,
        nonfinite: NonFiniteCheck | None = None,
    ) -> None:
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.program, self.num_micro_batch = program, num_micro_batch
        self.topology = topology
        #: This rank's stages, in order (the first is its place along the pipeline, its lane in ``schedule``).
        self.stages = list(topology.stages)
        #: The ranks along the pipeline (the schedule's lanes; each runs one or more stages).
        self.lanes = len(schedule)
        self.actions = schedule[self.stages[0]]
        self._actions = [action for action in self.actions if action is not None]
        self.device, self.gradient_reducer = topology.device, gradient_reducer
        self.loss_scaler, self.forward_contexts = loss_scaler, list(forward_contexts)
        self.max_grad_norm = max_grad_norm
        #: Clip after the gradient reduction whatever the config says: a tied weight's gradient is whole only
        #: once reduced between its stages.
        self.clip_after_reduction = clip_after_reduction
        self.channels = {stage: _StageChannels(stage, *topology.links[stage], self.device) for stage in self.stages}
        #: Stages without a previous stage whose W's run in the order of their I's: their I's compute and send
        #: nothing, so their W's receive the gradients (in the order the I's would have).
        self._whole_at_weight = {
            stage
            for stage in self.stages
            if self.channels[stage].inbound is None
            and micro_batch_order(self._actions, stage, (I,)) == micro_batch_order(self._actions, stage, (W,))
        }
        self._in_flight: dict[tuple[int, int], _InFlight] = {}  # by (stage, micro-batch)
        self._losses: dict[int, torch.Tensor] = {}
        params = [p for p in model.parameters() if p.requires_grad]
        #: What comes around the actions of a step, in every runner's order. Its step-end listeners are told once
        #: the step's last action has run, before the gradients are reduced (ZeRO under a zero-bubble schedule
        #: reduces its stages' gradients there; see ``listen_to_step_ends``). The gradient reducer never decides
        #: non-finite steps here: it covers one stage's copies, and the loss is the last stage's alone.
        self.step_update = StepUpdate(
            params=lambda: params,
            gradient_reducer=gradient_reducer,
            loss_scaler=loss_scaler,
            clip_norm=None if max_grad_norm is None else lambda: _clip(params, max_grad_norm, topology),
            clip_after_reduction=clip_after_reduction,
            step_ends=step_end_listeners(model),
        )
        #: The actions of the last step with their start (after their inputs arrived) and end (``time.time``).
        self.last_timeline: list[Event] = []
        #: Most micro-batches whose activations this stage held at once, in the last step.
        self.peak_in_flight = 0
        self._started = 0.0  # when the running action's inputs had arrived
        self._following: Action | None = None  # the action after the running one, whose inputs are received ahead
        #: The step's loss all-reduce over the replica, once started, and the tensor it fills.
        self._loss_sum: tuple[Work, torch.Tensor] | None = None
        #: Decides with every rank whether each step's update is applied (None: the loss scaler alone decides).
        self.nonfinite = nonfinite
        #: This rank's micro-batch losses of the step (the last stage's; None elsewhere), for ``nonfinite``.
        self._own_losses: torch.Tensor | None = None

    @classmethod
    def from_context(cls, context: ParallelContext, program: StageProgram, schedule: Schedule) -> Self:
        """The runner of ``program`` by ``schedule`` for the model, optimizer and loss of ``context``, over this rank's
        :class:`~epl_pipeline.topology.PipelineTopology` (made here: a collective of every rank)."""
        return cls(
            model=context.model,
            optimizer=context.optimizer,
            loss_fn=context.loss_fn,
            program=program,
            schedule=schedule,
            topology=PipelineTopology.from_context(context, schedule),
            num_micro_batch=context.plan.num_micro_batch,
            gradient_reducer=context.gradient_reducer,
            loss_scaler=context.loss_scaler,
            forward_contexts=context.forward_contexts,
            max_grad_norm=CoreSettings.from_config(context.config).optimizer.max_grad_norm,
            # a tied weight's copies, and ZeRO's gradients (reduced in the backward), are whole only once reduced
            clip_after_reduction=bool(context.plan.shared) or bool(context.reduced_in_backward),
            nonfinite=NonFiniteCheck.from_context(context),
        )

    @property
    def grad_norm(self) -> float | None:
        """The last step's gradient 2-norm before clipping, over every stage (None without ``max_grad_norm``)."""
        norm = self.step_update.grad_norm
        return None if norm is None else float(norm)

    def clip_gradients(self) -> None:
        """Scale the gradients so that the 2-norm over every stage and shard is at most ``max_grad_norm``."""
        self.step_update.clip()

    @property
    def stage(self) -> int:
        """This rank's first stage (its place along the pipeline)."""
        return self.stages[0]

    @property
    def last(self) -> bool:
        """Whether this rank runs the last stage (which computes the loss)."""
        return self.stages[-1] == self.program.num_stages - 1

    def step(self, inputs: Any, targets: Any = None) -> torch.Tensor:
        """Train on one replica batch; return the replica's mean loss (the same on every stage)."""
        if self.optimizer is None:
            raise EplError("Engine.step needs an optimizer: pass optimizer=... to epl.parallelize().")
        pieces = self._micro_batches(inputs, targets)
        for channels in self.channels.values():
            channels.begin(training=True)  # a batch of another size than the last step's is described again
        self.step_update.run(self.optimizer, lambda: self._run_actions(pieces), check=self.nonfinite)
        assert self._loss_sum is not None, "the last stage starts the loss all-reduce after its last loss"
        (work, loss), self._loss_sum = self._loss_sum, None
        work.wait()
        return loss

    def _run_actions(self, pieces: list[tuple[Any, Any]]) -> tuple[None, torch.Tensor | None]:
        """The step's actions in the schedule's order, timed, and every send waited for; returns this rank's
        micro-batch losses (the last stage's; None elsewhere) for the check of non-finite steps."""
        timeline, self.peak_in_flight = [], 0
        self._loss_sum = None
        if not self.last:  # adds nothing to the replica's loss: its share of the all-reduce can start now
            self._start_replica_loss([])
        actions = self._actions
        for index, action in enumerate(actions):
            self._following = actions[index + 1] if index + 1 < len(actions) else None
            self._started = time.time()
            self._run(action, pieces)
            timeline.append(Event(action, self._started, time.time()))
            if len(self._in_flight) > self.peak_in_flight:
                self.peak_in_flight = len(self._in_flight)
        for channels in self.channels.values():
            channels.flush()
        self.last_timeline = timeline
        own_losses, self._own_losses = self._own_losses, None
        return None, own_losses

    @torch.no_grad()
    def evaluate(self, inputs: Any, targets: Any = None) -> torch.Tensor:
        """The replica's mean loss of one replica batch of any size by a forward-only pass (no gradient, no update).

        Each micro-batch's loss counts by its rows that are not padding (a batch that does not divide into the
        micro-batches has its last one padded): the mean over the batch's rows, as one process computes it.
        """
        results, pieces = self._forward_only(inputs, targets, call="engine.evaluate")
        loss = torch.zeros((), dtype=torch.float64, device=self.device)  # every member's on the replica's device
        if self.last and self.topology.loss_share and results:
            _, parts = self.topology.shares[self.stages[-1]]
            rows = torch.tensor([real for _, real in results], dtype=torch.float64, device=self.device)
            losses = torch.stack([value for value, _ in results]).to(torch.float64)
            loss = (losses * rows).sum() * (parts / pieces.total) * self.topology.loss_share
        self.topology.replica.all_reduce(loss).wait()
        return loss

    def _replica_loss(self, losses: list[torch.Tensor]) -> tuple[Work, torch.Tensor]:
        """Start summing the mean of the last stage's micro-batch ``losses`` over its parts, on every stage of the
        replica: the all-reduce, and the tensor that holds the replica's loss once it completes."""
        loss = torch.zeros((), dtype=torch.float64, device=self.device)  # every member's on the replica's device
        if self.last and self.topology.loss_share:
            loss = torch.stack(losses).mean().to(torch.float64) * self.topology.loss_share
        return self.topology.replica.all_reduce(loss), loss

    def _start_replica_loss(self, losses: list[torch.Tensor]) -> None:
        """Start the step's loss all-reduce over the replica, which :meth:`step` waits for when it returns.

        A stage that adds nothing to the loss starts it when the step begins, the last stage once its last
        micro-batch's loss is known, so that it travels while the stages still compute (the replica's
        collectives keep one order on every stage: this one comes before the clipping's, on each of them).
        """
        self._loss_sum = self._replica_loss(losses)
        self._own_losses = torch.stack(losses) if losses else None
        self._losses.clear()

    def _micro_batches(self, inputs: Any, targets: Any) -> list[tuple[Any, Any]]:
        """``inputs`` and ``targets`` on this device, cut into micro-batches whose rows share out over every stage."""
        inputs, targets = to_device(inputs, self.device), to_device(targets, self.device)
        size, multiple = batch_size(inputs), self.num_micro_batch * self.topology.rows_multiple
        if size is not None and size % multiple:
            shared = (
                f" that each share out over the pipeline's replicate stages ({self.topology.rows_multiple} equal parts)"
                if self.topology.rows_multiple > 1
                else ""
            )
            raise BatchError(
                f"engine.step got a batch of {size} rows, which does not divide into pipeline.num_micro_batch="
                f"{self.num_micro_batch} micro-batches of equal size{shared}. Train on batch sizes that are multiples "
                f"of {multiple} (they may change from step to step); a DataLoader's last batch of an epoch is smaller "
                "unless drop_last=True. engine.evaluate and engine.predict take batches of any size."
            )
        return micro_batches(inputs, targets, self.num_micro_batch)

    def _own_part(self, stage: int, values: Any) -> Any:
        """This device's part of one micro-batch's ``values`` on ``stage`` (all of them unless it shares them out)."""
        index, count = self.topology.shares[stage]
        if count == 1 or values is None:
            return values
        return split_batch(values, count, what=f"pipeline stage {stage}")[index]

    @torch.no_grad()
    def predict(self, inputs: Any) -> Any:
        """The model's outputs for a replica batch of any size on the last stage's ranks (micro-batches joined,
        padding rows left out), None elsewhere."""
        results, pieces = self._forward_only(inputs, None, call="engine.predict")
        if not self.last:
            return None
        results = [
            first_rows(self._whole_micro_batch(result), pieces.rows, real)[0]
            for result, real in zip(results, pieces.real, strict=True)
        ]
        if len(results) == 1:
            return results[0]
        return pytree.tree_map(
            lambda *parts: torch.cat(parts) if isinstance(parts[0], torch.Tensor) else parts[0], *results
        )

    def _whole_micro_batch(self, output: Any) -> Any:
        """The last stage's output of a whole micro-batch: its parts gathered from the devices that share it out."""
        _, count = self.topology.shares[self.stages[-1]]
        if count == 1:
            return output
        assert self.topology.last_stage is not None, "a last stage that shares micro-batches out has its group"
        leaves, structure = pytree.tree_flatten(output)
        rows = batch_size([leaf for leaf in leaves if isinstance(leaf, torch.Tensor)])
        whole = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == rows:
                gathered = leaf.new_empty((rows * self.topology.last_stage.world_size, *leaf.shape[1:]))
                self.topology.last_stage.all_gather(gathered, leaf.contiguous()).wait()
                leaf = gathered
            whole.append(leaf)
        return pytree.tree_unflatten(whole, structure)

    def _forward_only(self, inputs: Any, targets: Any, *, call: str) -> tuple[list[Any], Cut]:
        """Each micro-batch through this rank's stages in order: received, run, sent on. The last stage gives each
        micro-batch's output (``engine.predict``), or its loss and this device's rows of it that are not padding
        (``engine.evaluate``; a part of padding only gives none). Every rank goes through (micro-batch, stage) in
        the same order, so none waits on a later one. Also returns how the batch was cut."""
        with_loss = call == "engine.evaluate"
        inputs, targets = to_device(inputs, self.device), to_device(targets, self.device)
        own_loss = with_loss and self.loss_fn is None and targets is None
        pieces = cut(inputs, targets, self.num_micro_batch, self.topology.rows_multiple, call=call, own_loss=own_loss)
        for channels in self.channels.values():
            channels.begin(training=False)  # a batch of another size than the last call's is described again
        results = []
        for (micro_inputs, micro_targets), real in zip(pieces.pieces, pieces.real, strict=True):
            for stage in self.stages:
                channels = self.channels[stage]
                received = channels.eval_inbound.receive()[0] if channels.eval_inbound is not None else None
                own_inputs = self._own_part(stage, micro_inputs)
                with inside(self.forward_contexts):
                    result = self.program.run(self.model, stage, own_inputs, received)
                if channels.eval_outbound is not None:
                    channels.eval_outbound.send(result, rows=batch_size(own_inputs))
                elif with_loss:
                    rows, own_real = self._rows_on(stage, pieces.rows, real)
                    if own_real:
                        own_targets = self._own_part(stage, micro_targets)
                        loss = self._loss_of_rows(result, own_targets, rows, own_real, pieces)
                        results.append((loss.detach(), own_real))
                else:
                    results.append(result)
        for channels in self.channels.values():
            channels.flush_eval()
        return results, pieces

    def _rows_on(self, stage: int, rows: int, real: int) -> tuple[int, int]:
        """This device's rows of a micro-batch of ``rows`` on ``stage``, and how many of them are not padding (the
        micro-batch's first ``real`` rows are the batch's)."""
        index, count = self.topology.shares[stage]
        own = rows // count
        return own, min(max(real - index * own, 0), own)

    def _loss_of_rows(self, output: Any, targets: Any, rows: int, real: int, pieces: Cut) -> torch.Tensor:
        """The loss of the first ``real`` of the micro-batch's ``rows`` (the others are padding): with ``loss_fn``,
        of the outputs and targets cut to them; the model's own loss ignores them by their labels (-100)."""
        if real < rows and self.loss_fn is not None:
            output, found = first_rows(output, rows, real)
            targets = first_rows(targets, rows, real)[0]
            if not found:
                raise BatchError(
                    f"engine.evaluate got a batch of {pieces.total} rows, which does not divide into "
                    f"pipeline.num_micro_batch={self.num_micro_batch} micro-batches, so its last micro-batch is "
                    f"padded; the model's output ({type(output).__name__}) holds no tensor with a row per sample, so "
                    "EPL cannot leave the padding rows out before loss_fn. Pass a batch size that is a multiple of "
                    f"{self.num_micro_batch * self.topology.rows_multiple}."
                )
        return self._loss(output, targets)

    def _loss(self, output: Any, targets: Any) -> torch.Tensor:
        """The last stage's scalar loss of one micro-batch (inside the forward contexts)."""
        with inside(self.forward_contexts):
            return compute_loss(output, targets, self.loss_fn)

    def _run(self, action: Action, pieces: list[tuple[Any, Any]]) -> None:
        key = (action.stage, action.micro_batch)
        if action.kind is ActionKind.FORWARD:
            self._forward(*key, *pieces[action.micro_batch])
        elif action.kind is ActionKind.BACKWARD:
            self._backward(*key, split=False)
        elif action.kind is ActionKind.BACKWARD_INPUT:
            self._backward(*key, split=True)
        elif action.kind is ActionKind.BACKWARD_WEIGHT:
            flight = self._in_flight.pop(key)
            if flight.pending is None:  # the first stage's I left the whole backward to its W
                self._backward_whole(action.stage, flight)
                return
            self._receive_ahead()
            backward_weight(flight.pending)
        else:
            raise EplError(f"The pipeline executor runs F, B, I and W actions, not {action.kind.name}.")

    def _receive_ahead(self) -> None:
        """Once the running action has its inputs, post the receives of the next action's: they then travel while
        this one computes (the order of posted receives stays the schedule's, which the senders follow)."""
        following = self._following
        if following is None:
            return
        channels = self.channels[following.stage]
        if following.kind is ActionKind.FORWARD and channels.inbound is not None:
            channels.inbound.prefetch()
        elif following.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT) and channels.outbound is not None:
            channels.outbound.prefetch_gradients()

    def _forward(self, stage: int, m: int, inputs: Any, targets: Any) -> None:
        inbound, outbound = self.channels[stage].inbound, self.channels[stage].outbound
        values, received = inbound.receive() if inbound is not None else (None, [])
        if inbound is not None:
            self._started = time.time()  # the action starts once its inputs have arrived
        self._receive_ahead()
        inputs = self._own_part(stage, inputs)
        with inside(self.forward_contexts):
            result = self.program.run(self.model, stage, inputs, values)
        if outbound is not None:
            sent = outbound.send(result, rows=batch_size(inputs))
            assert outbound.description is not None
            specs = outbound.description.tensor_specs
            outputs = [t for t, spec in zip(sent, specs, strict=True) if spec.requires_grad]
        else:
            loss = self._loss(result, self._own_part(stage, targets))
            self._losses[m] = loss.detach()
            if len(self._losses) == self.num_micro_batch:  # the step's last loss: the replica's loss can travel
                self._start_replica_loss([self._losses[m] for m in range(self.num_micro_batch)])
            outputs = [self.step_update.scaled(loss / self.num_micro_batch, check=self.nonfinite)]
        self._in_flight[stage, m] = _InFlight(outputs, received)

    def _backward(self, stage: int, m: int, *, split: bool) -> None:
        inbound, outbound = self.channels[stage].inbound, self.channels[stage].outbound
        if split and stage in self._whole_at_weight:
            # The first stage sends no input gradient: its I computes nothing and nobody waits for it. Its W
            # receives the gradient and runs the whole backward (gradients are received in the order of the
            # W's, which is that of the I's), so what the schedule puts between them does not wait for it.
            self._receive_ahead()
            return
        flight = self._in_flight[stage, m] if split else self._in_flight.pop((stage, m))
        grads: list[torch.Tensor | None]
        if outbound is None:
            grads = [None]
        else:
            grads = list(outbound.receive_gradients())
            self._started = time.time()
        self._receive_ahead()
        if split:
            # the parameters the forward used: under ZeRO, the gathered ones FSDP2 puts in the modules for the step
            used = [p for p in self.model.parameters() if p.requires_grad]
            input_grads, flight.pending = backward_input(flight.outputs, grads, flight.inputs, used)
            input_grads = input_grads or [None] * len(flight.inputs)
        else:
            if flight.outputs:
                backward(flight.outputs, grads)
            input_grads = [t.grad for t in flight.inputs]
        flight.outputs = []
        if inbound is not None:
            inbound.send_gradients(
                [g if g is not None else torch.zeros_like(t) for g, t in zip(input_grads, flight.inputs, strict=True)]
            )
        flight.inputs = []

    def _backward_whole(self, stage: int, flight: _InFlight) -> None:
        """The first stage's W after an I that did nothing: receive the gradient, then the whole backward."""
        outbound = self.channels[stage].outbound
        grads: list[torch.Tensor | None] = [None]
        if outbound is not None:
            grads = list(outbound.receive_gradients())
            self._started = time.time()
        self._receive_ahead()
        if flight.outputs:
            backward(flight.outputs, grads)
        flight.outputs = flight.inputs = []


def _clip(params: list[nn.Parameter], max_norm: float, topology: PipelineTopology) -> torch.Tensor:
    """Scale ``params``' gradients to a 2-norm of at most ``max_norm`` over every stage of the lane and every shard
    (a weight tied to an earlier stage's counted there); the norm before."""
    return clip_grad_norm(
        params,
        max_norm,
        topology.stage_peers,
        topology.counted_elsewhere,
        topology.stage_copies,
        device=topology.device,
    )


def _flush(*channels: Channel | ReshardingChannel | None) -> None:
    """Wait for every send started on ``channels`` (None: no such link)."""
    for channel in channels:
        if channel is not None:
            channel.flush()
