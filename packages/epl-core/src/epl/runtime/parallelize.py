"""``epl.parallelize`` and ``epl.plan``: from annotated model to Engine (or to Plan only)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, Union

import torch
from torch import nn

from epl.annotations.taskgraph import TaskGraph, holders_of
from epl.config import Config
from epl.config.settings import CoreSettings
from epl.errors import EplError, PlacementError
from epl.interfaces.collectives import broadcast_tensors
from epl.materialize.streaming import StreamedInit, streamed
from epl.materialize.units import has_meta_tensors, named_tensors
from epl.placement.build import build_local_plan, build_plan
from epl.placement.plan import Plan, TaskGraphSpec
from epl.placement.request import PlanReady, current_request
from epl.planner import apply, fit_check
from epl.plugins.context import LossFn, ParallelContext
from epl.runtime.batch import to_device
from epl.runtime.batch_check import batch_check
from epl.runtime.engine import Engine
from epl.runtime.env import Env
from epl.runtime.vocabulary_check import vocabulary_check
from epl.sharding.vocabulary import ModelVocabulary

OptimizerSpec = Union[torch.optim.Optimizer, Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer], None]


def parallelize(
    model: nn.Module,
    optimizer: OptimizerSpec = None,
    loss_fn: LossFn | None = None,
    *,
    example_inputs: Any = None,
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
) -> Engine:
    """Turn the annotated ``model`` into an :class:`Engine` for this rank.

    Builds the Plan from the captured TaskGraphs, stops capturing annotations,
    moves the model to this rank's device, applies the plugins' model
    transforms, builds the optimizer over this rank's parameters (``optimizer``
    is a factory ``params -> Optimizer``, or an optimizer already built over
    ``model``'s parameters), applies the plugins' optimizer wrappers, asks for
    the gradient reducer and the loss scaler (AMP) and picks the step runner.
    ``example_inputs`` (optional): one micro-batch's inputs as ``Engine.step`` takes them, for
    what runs the model once while parallelizing (the split layout, the cut of a model into
    pipeline stages, pipelines of models ``torch.fx`` cannot trace); without it EPL guesses
    inputs from the model (transformers' ``dummy_inputs``, or a batch for its first layer).
    ``lr_scheduler`` (optional): a factory ``optimizer -> LR scheduler``, built over the optimizer
    EPL builds; ``Engine.step`` steps it and checkpoints save it.
    Without ``loss_fn`` the model's output is the loss (a scalar, or a transformers output's ``.loss``).
    In ``epl plan`` runs it raises ``PlanReady`` instead.
    """
    env = Env.get()
    if not isinstance(model, nn.Module):
        raise EplError(f"epl.parallelize takes an nn.Module, got {type(model).__name__}.")
    if optimizer is not None and next(model.parameters(), None) is None:
        raise EplError(
            f"{type(model).__name__} has no parameters, so the optimizer has nothing to train: register its layers "
            "as attributes of the model (self.layer = nn.Linear(...), nn.ModuleList for lists), or pass no optimizer "
            "to run it without training."
        )
    request = current_request()
    planning = request is not None
    lazy = _lazy_init(model, env, planning) if has_meta_tensors(model) and _streams(model, planning) else None
    if lazy is not None:
        env.annotations.forget_tensors()
    with streamed(lazy):
        taskgraphs = _taskgraphs(model, env, example_inputs, own_loss=loss_fn is None)
    plan = _plan_for(taskgraphs, env)
    env.annotations.remove()
    if request is not None:
        if request.optimizer is not None:
            from epl.placement.plan_memory import optimizer_class

            optimizer = optimizer_class(request.optimizer)
        with streamed(lazy):
            raise PlanReady(_with_memory(plan, model, taskgraphs, env, optimizer), model=model, config=env.config)
    first_step_check = fit_check.before_launch(  # before the model takes its device's memory
        model, plan, taskgraphs, env.config, env.cluster, env.plugins, optimizer, own_loss=loss_fn is None
    )
    model = _to_device(model, env.cluster.device)
    assert env.communicator is not None, "only a plan-only run has no communicator, and it stopped above"
    context = ParallelContext(
        cluster=env.cluster,
        config=env.config,
        communicator=env.communicator,
        plugins=env.plugins,
        plan=plan,
        taskgraphs=taskgraphs,
        model=model,
        loss_fn=loss_fn,
        example_inputs=to_device(example_inputs, env.cluster.device),
        lazy_init=lazy,
    )
    vocabulary = ModelVocabulary.of(context.model)  # before a pipeline cuts the model into stages
    with streamed(lazy):
        for transform in env.plugins.model_transforms(context):
            context.model = transform(context.model, context)
    _require_values(context.model)
    context.optimizer = _build_optimizer(optimizer, context.model)
    if context.optimizer is not None:
        for wrapper in env.plugins.optimizer_wrappers(context):
            context.optimizer = wrapper(context.optimizer, context)
    context.gradient_reducer = env.plugins.make_gradient_reducer(context)
    context.loss_scaler = env.plugins.make_loss_scaler(context)
    context.step_runner = env.plugins.make_step_runner(context)
    engine = Engine(context, context.step_runner)
    settings = CoreSettings.from_config(env.config)
    engine.batch_check = batch_check(
        plan,
        env.communicator,
        env.cluster.rank,
        settings.io.check_batches,
        settings.io.check_batches_every,
        presliced=settings.context.presliced,
    )
    engine.vocabulary_check = vocabulary_check(context, vocabulary)
    engine.fit_check = first_step_check
    if lr_scheduler is not None:
        if context.optimizer is None:
            raise EplError("epl.parallelize got lr_scheduler=... but no optimizer=... for it to schedule.")
        engine.lr_scheduler = lr_scheduler(context.optimizer)
    return engine


def plan(
    model: nn.Module,
    *,
    world_size: int | None = None,
    gpu_per_worker: int | None = None,
    optimizer: OptimizerSpec = None,
) -> Plan:
    """The Plan for ``model``'s annotations on ``world_size`` devices, without running anything.

    Defaults to the current cluster. ``Plan.memory`` estimates each rank's bytes of
    parameters, gradients and optimizer states (activations are not estimated; see
    :mod:`epl.placement.plan_memory`); ``optimizer`` is what ``epl.parallelize`` takes (a
    factory, e.g. ``torch.optim.Adam``, or an optimizer over ``model``'s parameters),
    None for no optimizer. Capturing goes on: call it as often as you like before
    ``epl.parallelize``.
    """
    env = Env.get()
    taskgraphs = _taskgraphs(model, env)
    if world_size is None:
        return _with_memory(_plan_for(taskgraphs, env), model, taskgraphs, env, optimizer)
    for name, value in (("world_size", world_size), ("gpu_per_worker", gpu_per_worker)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise PlacementError(f"epl.plan({name}=...) takes a positive integer, got {value!r}.")
    built = _build(taskgraphs, env.config, world_size, gpu_per_worker)
    return _with_memory(built, model, taskgraphs, env, optimizer)


def _with_memory(plan: Plan, model: nn.Module, taskgraphs: list[TaskGraph], env: Env, optimizer: OptimizerSpec) -> Plan:
    """``plan`` with each rank's memory estimate."""
    from epl.placement.plan_memory import with_memory

    return with_memory(plan, model, taskgraphs, config=env.config, hooks=env.plugins, optimizer=optimizer)


def _lazy_init(model: nn.Module, env: Env, planning: bool) -> StreamedInit:
    """The init units of ``model``, built on ``meta``, with the job's seed: rank 0's ``torch.initial_seed()``, so
    that every rank gives a layer the same values, whatever seed each was given (``planning``: ``epl plan``, one
    process, values on the CPU)."""
    seed = torch.tensor([torch.initial_seed() % (1 << 63)], dtype=torch.int64)  # an unseeded process's is 64-bit
    if not planning and env.communicator is not None and env.cluster.world_size > 1:
        broadcast_tensors([seed], env.communicator)
    return StreamedInit(model, int(seed.item()), "cpu" if planning else env.cluster.device)


#: ``epl plan`` runs the example forwards of a model built on meta with values (one layer at a time) when its
#: parameters take at most this many bytes; above, on meta (shapes only: a split's layout falls back to tracing).
PLAN_WITH_VALUES_BYTES = 1 << 30


def _streams(model: nn.Module, planning: bool) -> bool:
    """Whether the example forwards of ``model``, built on meta, run with values (always, in a run)."""
    return not planning or sum(p.numel() * p.element_size() for p in model.parameters()) <= PLAN_WITH_VALUES_BYTES


def _to_device(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` on ``device``; tensors on ``meta`` stay there until :mod:`epl.materialize` gives them values."""
    moved: nn.Module = model._apply(lambda t: t if t.is_meta else t.to(device))  # returns the module itself
    return moved


def _require_values(model: nn.Module) -> None:
    """Refuse a model that still holds ``meta`` tensors after the transforms (a plugin's transform made them)."""
    left = [name for name, tensor in named_tensors(model) if tensor.is_meta]
    if left:
        raise EplError(
            f"After epl.parallelize this rank's model still holds {len(left)} tensor(s) on the meta device, "
            f"first {left[0]!r}; a model transform made them without values. Report it to the plugin that made them."
        )


def _taskgraphs(model: nn.Module, env: Env, example_inputs: Any = None, own_loss: bool = True) -> list[TaskGraph]:
    """The annotated TaskGraphs of ``model``, or a plugin's automatic partition of it; under
    ``auto.auto_parallel: "plan"`` the planner's layout first sets ``env.config`` (:mod:`epl.planner.apply`)."""
    taskgraphs = env.annotations.taskgraphs_for(model)
    if apply.wants_plan(env.config):
        devices_per_node = env.cluster.gpu_per_worker or env.cluster.world_size
        world = env.cluster.world_size
        layout = apply.choose_layout(model, env.config, world, devices_per_node, own_loss).layout
        env.config = apply.planned_config(env.config, layout)
        taskgraphs = apply.split_taskgraphs(taskgraphs, layout)
    return env.plugins.partition_model(model, taskgraphs, env.config, example_inputs)


def _plan_for(taskgraphs: list[TaskGraph], env: Env) -> Plan:
    return _build(taskgraphs, env.config, env.cluster.world_size, env.cluster.gpu_per_worker)


def _build(taskgraphs: list[TaskGraph], config: Config, world_size: int, gpu_per_worker: int | None) -> Plan:
    specs = [TaskGraphSpec.from_taskgraph(tg) for tg in taskgraphs]
    if world_size == 1:
        return build_local_plan(specs, config=config)
    plan = build_plan(specs, world_size=world_size, gpu_per_worker=gpu_per_worker, config=config)
    return dataclasses.replace(plan, shared=_shared(taskgraphs)) if plan.num_stages > 1 else plan


def _shared(taskgraphs: list[TaskGraph]) -> tuple[tuple[int, ...], ...]:
    """The sets of TaskGraphs that hold a tensor together (a pipeline partition that cut tied weights apart)."""
    return tuple(dict.fromkeys(tuple(sorted(o)) for o in holders_of(taskgraphs).values() if len(o) > 1))


def _build_optimizer(optimizer: OptimizerSpec, model: nn.Module) -> torch.optim.Optimizer | None:
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        if optimizer is not None:
            ours = {id(p) for p in model.parameters()}
            foreign = sum(1 for group in optimizer.param_groups for p in group["params"] if id(p) not in ours)
            if foreign:
                raise EplError(
                    f"The optimizer holds {foreign} parameters that this rank's model does not hold. "
                    "Pipelines keep only this rank's stage and epl.split replaces parameters by shards, so "
                    "pass a factory: optimizer=lambda params: torch.optim.Adam(params)."
                )
        return optimizer
    if not callable(optimizer):
        raise EplError(
            f"optimizer must be a torch.optim.Optimizer or a factory params -> Optimizer, got {optimizer!r}."
        )
    built = optimizer(model.parameters())
    if not isinstance(built, torch.optim.Optimizer):
        raise EplError(f"The optimizer factory returned {type(built).__name__}, not a torch.optim.Optimizer.")
    return built
